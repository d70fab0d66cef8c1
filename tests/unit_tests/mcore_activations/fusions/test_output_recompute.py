"""The output-recompute option: fc2 saves a recipe of its input, not the input, with bitwise the
gradients of keeping it, and nothing a caller can see is freed or changed.

Numerics: for every catalogue activation (GLU interleave included), with and without bias and
token weights, with the in-place backward off and on, on the eager torch backend (and the
Triton kernels under ``-m gpu``): nothing keeps the activation's output after the forward, and
every gradient equals the option-off one bit for bit. Views fc2 saves, a second backward through
a retained graph, the forward's kernel backend, inputs changed in place between the passes (an
error, never other numbers), another consumer of the output (kept, still exact). The layers (the
fork's ``MLP`` and ``TEGroupedMLP``, its 'moe_act' on every path). Where the option stands aside:
no gradient, no autograd node of the output's own, saved-tensor hooks, a non-contiguous output,
storage shared with other values, the unfused path, FP8 input store, ``torch.compile``. The
option's argument, process default and environment variable are checked like the in-place one.
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mcore_activations.activation_path import FUSED_KERNEL_PATH, UNFUSED_PATH, LayerActivation
from mcore_activations.fusions import output_recompute
from mcore_activations.fusions.activation_ops import use_kernel_backend
from mcore_activations.fusions.in_place import use_in_place_backward
from mcore_activations.fusions.output_recompute import use_recompute_output
from tests.unit_tests.activation_catalog import SPECS, layout_cases, spec_of

ROOT = Path(__file__).resolve().parents[4]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

BACKENDS = [
    pytest.param("eager", "cpu", id="eager"),
    pytest.param("triton", "cuda", id="triton-cuda", marks=pytest.mark.gpu),
]


def _inputs(spec, dtype, has_bias, has_probs, rows, ffn, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = 2 * ffn if spec.gated else ffn
    x = (torch.randn(rows, width, generator=gen) * 3.0).to(dtype)
    bias = (torch.randn(width, generator=gen) * 0.5).to(dtype) if has_bias else None
    probs = torch.rand(rows, 1, generator=gen).to(dtype) if has_probs else None
    weight = torch.randn(ffn, 5, generator=gen).to(dtype)
    grad = torch.randn(rows, 5, generator=gen).to(dtype)
    return [t.to(device) if t is not None else None for t in (x, bias, probs, weight, grad)]


def _fused(spec=None, **kwargs):
    return LayerActivation(spec or SPECS["swiglu_clamp"], FUSED_KERNEL_PATH, F.silu, **kwargs)


def _step(activation, x, bias, probs, weight, grad, consume=lambda y, w: y @ w):
    """fc1 stand-in -> activation -> fc2 stand-in (a matmul, which saves its input) and back;
    returns the gradients and whether anything kept the activation's output after the forward."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, bias)]
    leaves += [probs.detach().clone().requires_grad_() if probs is not None else None]
    w = weight.detach().clone().requires_grad_()
    fc1_out = leaves[0] * 1
    y = activation(fc1_out, leaves[1], leaves[2])
    with activation.fc2_saves_recipe(y, fc1_out, leaves[1], leaves[2]):
        out = consume(y, w)
    ref = weakref.ref(y)
    del y
    kept = ref() is not None
    out.backward(grad)
    grads = [t.grad for t in leaves if t is not None] + [w.grad]
    return kept, out.detach(), grads


def check_recompute(spec, dtype, has_bias, has_probs, backend, device, rows=7, ffn=12):
    x, bias, probs, weight, grad = _inputs(spec, dtype, has_bias, has_probs, rows, ffn, device)
    what = f"{spec.name} {dtype} bias={has_bias} probs={has_probs} {backend}"
    with use_kernel_backend(backend):
        for in_place in (False, True):
            kept_layer = _fused(spec, in_place_backward=in_place)
            recipe_layer = _fused(spec, in_place_backward=in_place, recompute_output=True)
            kept, out_ref, grads_ref = _step(kept_layer, x, bias, probs, weight, grad)
            still_kept, out, grads = _step(recipe_layer, x, bias, probs, weight, grad)
            assert kept and not still_kept, f"{what}: fc2 still keeps the output"
            assert torch.equal(out, out_ref), what
            for a, b in zip(grads, grads_ref):
                assert torch.equal(a, b), f"{what} in_place={in_place}: a gradient differs"


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("has_probs", [False, True], ids=["", "probs"])
@pytest.mark.parametrize("has_bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("name,interleave", layout_cases())
def test_recomputed_output_gives_the_same_gradients_bitwise(
    name, interleave, has_bias, has_probs, backend, device
):
    spec = spec_of(name, glu_interleave_size=interleave)
    index = sorted(SPECS).index(name) + int(has_bias) + 2 * int(has_probs)
    check_recompute(spec, DTYPES[index % 3], has_bias, has_probs, backend, device)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_recompute_every_dtype(dtype, backend, device):
    check_recompute(SPECS["swiglu_clamp"], dtype, True, True, backend, device, rows=1, ffn=40)


@pytest.mark.parametrize(
    "consume",
    [
        pytest.param(lambda y, w: y.t().contiguous().t() @ w, id="a copy"),
        pytest.param(lambda y, w: (y.t().t() @ w) + (y.view(-1)[:5] * 2).sum(), id="two views"),
        pytest.param(lambda y, w: (w.t() @ y.t()).t(), id="a transposed view"),
    ],
)
def test_views_the_consumer_saves_are_recomputed_as_views(consume):
    spec = SPECS["quick_geglu_gpt_oss"]
    x, bias, probs, weight, grad = _inputs(spec, torch.float32, True, True, 6, 8, "cpu")
    _, out_ref, grads_ref = _step(_fused(spec), x, bias, probs, weight, grad, consume)
    _, out, grads = _step(
        _fused(spec, recompute_output=True), x, bias, probs, weight, grad, consume
    )
    assert torch.equal(out, out_ref)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_ref))


class _SavesSplits(torch.autograd.Function):
    """A grouped GEMM's way of saving its input: one view per expert, all in one node."""

    @staticmethod
    def forward(ctx, y, w, splits):
        ctx.save_for_backward(*torch.split(y, splits), w)
        ctx.experts = len(splits)
        return y @ w

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        y = torch.cat(saved[: ctx.experts])
        return grad @ saved[-1].t(), y.t() @ grad, None


@pytest.mark.parametrize("where", ["one node", "a node per view"])
def test_views_saved_per_expert_share_one_recomputation(where):
    """fc2 saving one view of its input per expert recomputes the input once per backward, not
    once per view (a copy of the whole output each), and again for a retained graph's second
    backward."""
    x = torch.randn(12, 8, requires_grad=True)
    w = torch.randn(8, 3, requires_grad=True)
    calls = []

    def recompute(target):
        calls.append(1)
        target.copy_(x.detach() * 2)

    y = x * 2
    hooks = output_recompute.recompute_when_saved(y, recompute, (x,))
    with hooks:
        if where == "one node":
            out = _SavesSplits.apply(y, w, [5, 0, 4, 3])
        else:
            out = torch.cat([part @ w for part in torch.split(y, [5, 0, 4, 3])])
    assert hooks.recipes >= 3
    expected = (x.detach() * 2) @ w.detach()
    del y
    out.sum().backward(retain_graph=True)
    assert len(calls) == 1
    grad_w = w.grad.clone()
    out.sum().backward()
    assert len(calls) == 2 and torch.allclose(w.grad, 2 * grad_w)
    assert torch.allclose(out, expected)


@pytest.mark.parametrize("in_place", [False, True], ids=["", "in place"])
def test_the_backward_frees_what_the_recipe_read_without_the_cycle_collector(in_place):
    """After the backward nothing of the recipe is left: fc1's output, the bias and the token
    weights go when the graph does, not when Python's cycle collector next runs (a cycle through
    the hooks kept fc1's output alive past its backward, twice the output's size per layer)."""
    spec = SPECS["swiglu_clamp"]
    x, bias, probs, weight, grad = _inputs(spec, torch.float32, True, True, 4, 8, "cpu")
    activation = _fused(spec, recompute_output=True, in_place_backward=in_place)
    leaves = [t.clone().requires_grad_() for t in (x, bias, probs, weight)]
    gc.collect()
    gc.disable()
    try:
        fc1_out = leaves[0] * 1
        bias_in, probs_in = leaves[1] * 1, leaves[2] * 1  # non-leaves: only the graph keeps them
        y = activation(fc1_out, bias_in, probs_in)
        with activation.fc2_saves_recipe(y, fc1_out, bias_in, probs_in):
            out = y @ leaves[3]
        refs = [weakref.ref(t) for t in (fc1_out, bias_in, probs_in, y)]
        del fc1_out, bias_in, probs_in, y
        out.backward(grad)
        del out
        assert [r() is None for r in refs] == [True] * 4
    finally:
        gc.enable()


class _SavesBytes(torch.autograd.Function):
    """An fc2 stand-in that saves its input as a view in another dtype."""

    @staticmethod
    def forward(ctx, y, w):
        ctx.save_for_backward(y.view(torch.uint8), w)
        return y @ w

    @staticmethod
    def backward(ctx, grad):
        y_bytes, w = ctx.saved_tensors
        y = y_bytes.view(w.dtype)
        return grad @ w.t(), y.t() @ grad


def _change_before_saving(y, w):
    y.clamp_(-0.01, 0.01)  # a forward pre-hook of fc2's clipping its input in place
    return y @ w


@pytest.mark.parametrize(
    "consume",
    [_SavesBytes.apply, _change_before_saving],
    ids=["view in another dtype", "changed in place before fc2 saves it"],
)
def test_what_a_recomputation_would_not_reproduce_is_saved_as_it_is(consume):
    spec = SPECS["swiglu_clamp"]
    x, bias, probs, weight, grad = _inputs(spec, torch.bfloat16, True, True, 4, 8, "cpu")
    with _recipes_made() as made:
        kept, out, grads = _step(
            _fused(recompute_output=True), x, bias, probs, weight, grad, consume
        )
    _, out_ref, grads_ref = _step(_fused(), x, bias, probs, weight, grad, consume)
    assert made == [0]  # no recipe: fc2 keeps what it saved
    assert torch.equal(out, out_ref)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_ref))


def test_the_output_changed_in_place_after_fc2_saved_it_raises():
    spec = SPECS["swiglu_clamp"]
    x, bias, probs, weight, grad = _inputs(spec, torch.float32, True, True, 4, 8, "cpu")
    w = weight.clone().requires_grad_()
    leaf = x.clone().requires_grad_()
    for enabled, message in ((False, "modified by an inplace operation"), (True, "fc2's forward")):
        activation = _fused(recompute_output=enabled)
        fc1_out = leaf * 1
        y = activation(fc1_out, bias, probs)
        with activation.fc2_saves_recipe(y, fc1_out, bias, probs):
            out = y @ w
        y.mul_(2)  # torch refuses the backward when fc2 keeps y; the recipe must as well
        with pytest.raises(RuntimeError, match=message):
            out.backward(grad)


def test_retained_graph_second_backward_recomputes_again():
    spec = SPECS["swiglu_clamp"]
    x, bias, probs, weight, grad = _inputs(spec, torch.float32, True, True, 4, 8, "cpu")
    w = weight.clone().requires_grad_()
    leaf = x.clone().requires_grad_()
    activation = _fused(recompute_output=True)
    fc1_out = leaf * 1
    y = activation(fc1_out, bias, probs)
    with activation.fc2_saves_recipe(y, fc1_out, bias, probs):
        out = y @ w
    del y
    out.backward(grad, retain_graph=True)
    first = w.grad.clone()
    w.grad = None
    out.backward(grad)
    assert torch.equal(w.grad, first)


def test_an_in_place_backward_that_already_ran_makes_the_second_one_raise():
    spec = SPECS["swiglu_clamp"]
    x, _, _, weight, grad = _inputs(spec, torch.float32, False, False, 4, 8, "cpu")
    activation = _fused(recompute_output=True, in_place_backward=True)
    fc1_out = x.clone().requires_grad_() * 1
    y = activation(fc1_out)
    with activation.fc2_saves_recipe(y, fc1_out):
        out = y @ weight.clone().requires_grad_()
    del y
    out.backward(grad, retain_graph=True)
    with pytest.raises(RuntimeError, match="modified in place after the forward"):
        out.backward(grad)


def test_token_weights_changed_in_place_between_the_passes_raise():
    spec = SPECS["swiglu"]
    x, _, probs, weight, grad = _inputs(spec, torch.float32, False, True, 4, 8, "cpu")
    activation = _fused(spec, recompute_output=True)
    fc1_out = x.clone().requires_grad_() * 1
    y = activation(fc1_out, None, probs)
    with activation.fc2_saves_recipe(y, fc1_out, None, probs):
        out = y @ weight.clone().requires_grad_()
    del y
    probs.mul_(0.5)  # a reused buffer
    with pytest.raises(RuntimeError, match="modified in place after the forward"):
        out.backward(grad)


def test_the_forwards_kernel_backend_is_used_again():
    spec = SPECS["situ_glu"]
    x, bias, probs, weight, grad = _inputs(spec, torch.float32, True, True, 6, 8, "cpu")
    got = []
    for enabled in (False, True):
        activation = _fused(spec, recompute_output=enabled)
        leaf, w = x.clone().requires_grad_(), weight.clone().requires_grad_()
        with use_kernel_backend("eager"):
            fc1_out = leaf * 1
            y = activation(fc1_out, bias, probs)
            with activation.fc2_saves_recipe(y, fc1_out, bias, probs):
                out = y @ w
        del y
        with use_kernel_backend("inductor"):
            out.backward(grad)
        got.append((leaf.grad, w.grad))
    assert all(torch.equal(a, b) for a, b in zip(*got))


@pytest.mark.parametrize("where", ["inside", "after"])
def test_another_consumer_of_the_output_gives_the_same_numbers(where):
    """An auxiliary loss on fc2's input: made inside the block (a forward hook on fc2) it saves
    a recipe too; made after it, it keeps the output itself. The numbers are the same."""
    spec = SPECS["swiglu_clamp"]
    x, bias, probs, weight, grad = _inputs(spec, torch.float32, True, True, 4, 8, "cpu")
    aux = []

    def consume(y, w):
        out = y @ w
        if where == "inside":
            aux.append(y.square().mean())
        return out

    results = []
    for enabled in (False, True):
        activation = _fused(spec, recompute_output=enabled)
        leaf, w = x.clone().requires_grad_(), weight.clone().requires_grad_()
        fc1_out = leaf * 1
        y = activation(fc1_out, bias, probs)
        with activation.fc2_saves_recipe(y, fc1_out, bias, probs):
            out = consume(y, w)
        extra = aux[-1] if where == "inside" else y.square().mean()
        del y
        (out.square().sum() + extra).backward()
        results.append((leaf.grad, w.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize(
    "case",
    [
        "option off",
        "no grad",
        "no node of its own",
        "non-contiguous",
        "slice of a buffer",
        "empty",
        "saved-tensor hooks",
        "non-reentrant checkpoint",
    ],
)
def test_the_option_stands_aside_where_a_recipe_cannot_help(case):
    spec = SPECS["swiglu_clamp"]
    x, _, _, _, _ = _inputs(spec, torch.float32, False, False, 4, 8, "cpu")
    activation = _fused(recompute_output=case != "option off")
    fc1_out = x.clone().requires_grad_(case != "no node of its own") * 1
    if case == "empty":
        fc1_out = fc1_out[:0]
    contexts = []

    def block(fc1_out):
        y = activation(fc1_out)
        if case == "non-contiguous":
            y = y.t().contiguous().t()
        if case == "slice of a buffer":
            y = torch.cat([y, y])[:4]
        contexts.append(activation.fc2_saves_recipe(y, fc1_out))
        return y

    if case == "no grad":
        with torch.no_grad():
            block(fc1_out)
    elif case == "saved-tensor hooks":
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            block(fc1_out)
    elif case == "non-reentrant checkpoint":
        torch.utils.checkpoint.checkpoint(block, fc1_out, use_reentrant=False)
    else:
        block(fc1_out)
    assert contexts and all(isinstance(c, contextlib.nullcontext) for c in contexts)


@pytest.mark.parametrize("path", ["unfused", "fp8 input store"])
def test_only_the_fused_path_saves_a_recipe(path):
    spec = SPECS["swiglu"]
    if path == "unfused":
        activation = LayerActivation(spec, UNFUSED_PATH, F.silu, recompute_output=True)
    else:
        activation = _fused(spec, fp8_input_store=True, recompute_output=True)
    x, _, _, _, _ = _inputs(spec, torch.float32, False, False, 4, 8, "cpu")
    fc1_out = x.clone().requires_grad_() * 1
    y = activation(fc1_out)
    assert isinstance(activation.fc2_saves_recipe(y, fc1_out), contextlib.nullcontext)
    assert not activation.recomputes_fused_output()


def test_compiled_region_computes_the_same():
    spec = SPECS["swiglu_clamp"]
    activation = _fused(spec, recompute_output=True)
    x, _, _, weight, grad = _inputs(spec, torch.float32, False, False, 4, 8, "cpu")

    def block(fc1_out, w):
        y = activation(fc1_out)
        with activation.fc2_saves_recipe(y, fc1_out):
            return y @ w

    compiled = torch.compile(block, backend="eager", fullgraph=True)
    leaf, w = x.clone().requires_grad_(), weight.clone().requires_grad_()
    compiled(leaf * 1, w).backward(grad)
    leaf_ref, w_ref = x.clone().requires_grad_(), weight.clone().requires_grad_()
    (activation(leaf_ref * 1) @ w_ref).backward(grad)
    assert torch.equal(w.grad, w_ref.grad) and torch.equal(leaf.grad, leaf_ref.grad)


# ------------------------------------------------------------------------------ the layers
@pytest.fixture
def layer_builder():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tests.unit_tests.test_utilities import Utils
    from tests.unit_tests.transformer.moe.test_grouped_mlp import LocalGroupedLinear

    Utils.initialize_model_parallel(1, 1)
    pg = ProcessGroupCollection.use_mpu_process_groups(["tp", "ep", "expt_tp"])
    fields = dict(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=4,
        ffn_hidden_size=24,
        moe_ffn_hidden_size=24,
        num_moe_experts=2,
        activation_func=F.silu,
        gated_linear_unit=True,
        bias_activation_fusion=True,
        add_bias_linear=True,
        activation_func_clamp_value=2.0,
    )

    def build(kind, **overrides):
        config = TransformerConfig(**(fields | overrides))
        if kind == "mlp":
            submodules = get_gpt_layer_local_submodules().mlp.submodules
            return MLP(config, submodules, ffn_hidden_size=24, tp_group=pg.tp, pg_collection=pg)
        submodules = GroupedMLPSubmodules(
            linear_fc1=LocalGroupedLinear, linear_fc2=LocalGroupedLinear
        )
        return TEGroupedMLP(2, config, submodules, pg_collection=pg)

    yield build
    Utils.destroy_model_parallel()


def _layer_step(layer, kind, hidden, per_token):
    layer.zero_grad()
    h = hidden.clone().requires_grad_()
    if kind == "mlp":
        out, bias = layer(h, per_token_scale=per_token)
        loss = out if bias is None else out + bias
    else:
        out, _ = layer(h, [3, 3], per_token)
        loss = out
    loss.square().sum().backward()
    return [h.grad] + [p.grad.clone() for p in layer.parameters()]


@contextlib.contextmanager
def _recipes_made():
    """The number of tensors fc2 saved as recipes in the block, one entry per layer call that
    asked for them."""
    made = []
    original = output_recompute.recompute_when_saved

    def spy(*args, **kwargs):
        context = original(*args, **kwargs)
        made.append(context)
        return context

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(output_recompute, "recompute_when_saved", spy)
        yield made
    made[:] = [getattr(c, "recipes", 0) for c in made]


@pytest.mark.parametrize("per_token", [False, True], ids=["", "token weights"])
@pytest.mark.parametrize("in_place", [False, True], ids=["", "in place"])
@pytest.mark.parametrize("kind", ["mlp", "grouped"])
def test_layers_drop_fc2_input_and_give_the_same_gradients(
    kind, in_place, per_token, layer_builder
):
    torch.manual_seed(3)
    layer = layer_builder(kind)
    hidden = torch.randn(6, 16) * 3 if kind == "grouped" else torch.randn(3, 2, 16) * 3
    per_token_scale = torch.rand(hidden.shape[:-1]) if per_token or kind == "grouped" else None
    got, made = [], []
    with use_in_place_backward(in_place):
        for enabled in (False, True):
            with use_recompute_output(enabled), _recipes_made() as recipes:
                got.append(_layer_step(layer, kind, hidden, per_token_scale))
            made.append(recipes)
    # Off: the option is not asked. On: fc2 saved its input as recipes (the grouped fc2 saves
    # one view of it per expert).
    assert made[0] == [] and len(made[1]) == 1 and made[1][0] == (2 if kind == "grouped" else 1)
    for a, b in zip(*got):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["mlp", "grouped"])
def test_layers_leave_no_reference_cycle_behind(kind, layer_builder):
    """A layer step with the option leaves Python's cycle collector nothing more to free than a
    step without it: what the recipe holds goes with the graph."""
    torch.manual_seed(3)
    layer = layer_builder(kind)
    hidden = torch.randn(6, 16) * 3 if kind == "grouped" else torch.randn(3, 2, 16) * 3
    per_token_scale = torch.rand(hidden.shape[:-1]) if kind == "grouped" else None
    left = {}
    for enabled in (False, True, False, True):
        with use_recompute_output(enabled):
            gc.collect()
            gc.disable()
            try:
                _layer_step(layer, kind, hidden, per_token_scale)
            finally:
                left[enabled] = gc.collect()
                gc.enable()
    assert left[True] == left[False], left


def test_a_forward_hook_reading_fc2_input_sees_it_and_trains_the_same(layer_builder):
    layer = layer_builder("mlp")
    hidden = torch.randn(3, 2, 16) * 3
    got = []
    kept = []
    layer.linear_fc2.register_forward_hook(lambda m, args, out: kept.append(args[0]))
    for enabled in (False, True):
        layer.zero_grad()
        h = hidden.clone().requires_grad_()
        with use_recompute_output(enabled):
            out, bias = layer(h)
        # The hook's reference reads the values of fc2's input whenever it likes.
        assert torch.equal(kept[-1], kept[0])
        ((out + bias).square().sum() + kept[-1].square().mean()).backward()
        got.append([h.grad] + [p.grad.clone() for p in layer.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*got))


def test_a_pre_hook_changing_fc2_input_in_place_trains_the_same(layer_builder):
    # fc2 then saves the changed values; a recomputation would give the activation's own.
    layer = layer_builder("mlp")
    hidden = torch.randn(3, 2, 16) * 3
    layer.linear_fc2.register_forward_pre_hook(lambda m, args: args[0].clamp_(-0.01, 0.01))
    got = []
    for enabled in (False, True):
        with use_recompute_output(enabled):
            got.append(_layer_step(layer, "mlp", hidden, None))
    assert all(torch.equal(a, b) for a, b in zip(*got))


MOE_ACT = dict(recompute_granularity="selective", recompute_modules=["moe_act"])


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("in_place", [False, True], ids=["", "in place"])
def test_grouped_experts_honour_upstreams_moe_act_recompute(in_place, fused, layer_builder):
    """'moe_act' (upstream's selective recompute of the MoE activation) makes the fork's
    TEGroupedMLP keep a recipe of fc2's input on the fused path whatever the process default,
    and run upstream's output-discarding checkpoint elsewhere; on the fused path, recomputing
    from fc1's output itself, it passes the in-place backward's config check that upstream's
    checkpoint fails."""
    from mcore_activations.fusions import in_place as in_place_mod

    if in_place and not fused:
        pytest.skip("the in-place backward is an option of the fused kernels")
    torch.manual_seed(3)
    with use_in_place_backward(in_place):
        plain = layer_builder("grouped", bias_activation_fusion=fused)
        recomputing = layer_builder("grouped", bias_activation_fusion=fused, **MOE_ACT)
    assert recomputing.activation_recompute and not plain.activation_recompute
    assert recomputing.layer_activation.recomputes_fused_output() is fused
    recomputing.load_state_dict(plain.state_dict())
    hidden, probs = torch.randn(6, 16) * 3, torch.rand(6)
    got, made = [], []
    with use_in_place_backward(in_place):
        for layer in (plain, recomputing):
            with _recipes_made() as recipes:
                got.append(_layer_step(layer, "grouped", hidden, probs))
            made.append(recipes)
    # Fused: the recomputing layer's fc2 saved a recipe (the plain one does not ask).
    # Unfused: nothing asks; upstream's checkpoint frees the output instead.
    assert made == ([[], [2]] if fused else [[], []]), made  # one view per expert
    for a, b in zip(*got):
        assert torch.equal(a, b)
    # Upstream's own TEGroupedMLP (patched) recomputes on a detached copy: still a conflict.
    assert in_place_mod.config_conflicts(recomputing.config)
    assert not in_place_mod.config_conflicts(recomputing.config, moe_act_on_graph=True)


# --------------------------------------------------------------------------- the option
@pytest.mark.parametrize("value", ["1", "true", "YES", " on "])
def test_environment_on(value):
    env = {output_recompute.ENV_VAR: value}
    assert output_recompute.recompute_output_from_env(env) is True


@pytest.mark.parametrize("value", ["0", "false", "No", "off", "", "  "])
def test_environment_off(value):
    env = {output_recompute.ENV_VAR: value}
    assert output_recompute.recompute_output_from_env(env) is False
    assert output_recompute.recompute_output_from_env({}) is False


@pytest.mark.parametrize("value", ["2", "enable", "ture"])
def test_environment_typo_is_refused(value):
    with pytest.raises(ValueError, match=f"{output_recompute.ENV_VAR}={value!r} is not understood"):
        output_recompute.recompute_output_from_env({output_recompute.ENV_VAR: value})


def test_environment_variable_sets_the_default_in_a_fresh_process():
    code = (
        "from mcore_activations.fusions import output_recompute\n"
        "print(output_recompute.recompute_output_enabled())"
    )
    env = dict(os.environ, **{output_recompute.ENV_VAR: "on"}, PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT
    )
    assert run.returncode == 0 and run.stdout.strip() == "True", run.stderr


@pytest.mark.parametrize("value", ["yes", 1, 0.0])
def test_layer_option_must_be_a_bool_or_none(value):
    with pytest.raises(TypeError, match="recompute_output must be True, False or None"):
        _fused(recompute_output=value)


def test_process_default_setters():
    assert output_recompute.recompute_output_enabled() is False
    with use_recompute_output(True):
        assert output_recompute.recompute_output_enabled() is True
        assert output_recompute.resolve(None) is True
        assert output_recompute.resolve(False) is False
    assert output_recompute.recompute_output_enabled() is False
    with pytest.raises(TypeError, match="set_recompute_output takes True or False"):
        output_recompute.set_recompute_output(None)


@pytest.mark.gpu
@pytest.mark.parametrize("in_place", [False, True], ids=["", "in place"])
@pytest.mark.parametrize("name", ["swiglu", "swiglu_clamp", "quick_geglu_gpt_oss"])
def test_recipe_lowers_the_memory_held_and_not_the_peak(name, in_place):
    """Between the passes one output less is held; the backward's peak does not grow (the
    recomputed output lives from fc2's backward until it releases it, as the kept one would)."""
    spec = SPECS[name]
    rows, ffn = 4096, 2048
    x, bias, probs, weight, grad = _inputs(spec, torch.bfloat16, True, True, rows, ffn, "cuda")
    held, peak = {}, {}
    # The first pass is a warm-up: cuBLAS's workspace and the kernels' first launches allocate.
    for enabled in (False, False, True):
        activation = _fused(spec, recompute_output=enabled, in_place_backward=in_place)
        leaf = x.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        fc1_out = leaf * 1
        y = activation(fc1_out, bias, probs)
        with activation.fc2_saves_recipe(y, fc1_out, bias, probs):
            out = y @ w
        del y, fc1_out
        held[enabled] = torch.cuda.memory_allocated() - before
        torch.cuda.reset_peak_memory_stats()
        out.backward(grad)
        peak[enabled] = torch.cuda.max_memory_allocated() - before
        del out
    # One [rows, ffn] bf16 output less, to the allocator's rounding.
    assert abs(held[False] - held[True] - rows * ffn * 2) <= 4096, held
    assert peak[True] <= peak[False], peak


def test_what_fc2_saves_as_it_is_keeps_autograds_version_check():
    """The hooks hand back the tensors they do not replace; autograd does not check those, so
    the hooks do: fc2's weight changed in place before the backward raises, as without them."""
    spec = SPECS["swiglu_clamp"]
    x, _, _, weight, grad = _inputs(spec, torch.float32, False, False, 6, 4, "cpu")
    activation = _fused(spec, recompute_output=True)
    w = weight.clone().requires_grad_()
    fc1_out = x.clone().requires_grad_() * 1
    y = activation(fc1_out)
    with activation.fc2_saves_recipe(y, fc1_out):
        out = y @ w
    with torch.no_grad():
        w.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(grad)
