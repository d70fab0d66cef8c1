"""The output-recompute option: fc2's saved input freed after its forward, refilled before its
backward, with bitwise the gradients of keeping it.

Numerics: for every catalogue activation (GLU interleave included), with and without bias and
token weights, with the in-place backward off and on, on the eager torch backend (and the
Triton kernels under ``-m gpu``): the activation's output storage is empty between the passes
and every gradient equals the option-off one bit for bit. The layers (the fork's ``MLP`` and
``TEGroupedMLP``) free it only on the fused path. Kept, not freed: no gradient to the consumer,
a non-contiguous output, storage shared with other values, the unfused path, FP8 input store,
``torch.compile``. The option's argument, process default and environment variable are checked
like the in-place one.
"""

from __future__ import annotations

import os
import subprocess
import sys
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


def _step(activation, x, bias, probs, weight, grad):
    """fc1 stand-in -> activation -> fc2 stand-in (a matmul, which saves the activation's output)
    and back; returns the gradients and the output storage's size between the passes."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, bias)]
    leaves += [probs.detach().clone().requires_grad_() if probs is not None else None]
    w = weight.detach().clone().requires_grad_()
    fc1_out = leaves[0] * 1
    y = activation(fc1_out, leaves[1], leaves[2])
    out = y @ w
    freed = activation.release_output(y, out, fc1_out, leaves[1], leaves[2])
    between = y.untyped_storage().nbytes()
    out.backward(grad)
    grads = [t.grad for t in leaves if t is not None] + [w.grad]
    return freed, between, y.detach(), grads


def check_recompute(spec, dtype, has_bias, has_probs, backend, device, rows=7, ffn=12):
    x, bias, probs, weight, grad = _inputs(spec, dtype, has_bias, has_probs, rows, ffn, device)
    what = f"{spec.name} {dtype} bias={has_bias} probs={has_probs} {backend}"
    with use_kernel_backend(backend):
        for in_place in (False, True):
            kept = LayerActivation(spec, FUSED_KERNEL_PATH, F.silu, in_place_backward=in_place)
            freed_layer = LayerActivation(
                spec, FUSED_KERNEL_PATH, F.silu, in_place_backward=in_place, recompute_output=True
            )
            freed_ref, _, y_ref, grads_ref = _step(kept, x, bias, probs, weight, grad)
            freed, between, y, grads = _step(freed_layer, x, bias, probs, weight, grad)
            assert not freed_ref and freed, what
            assert between == 0, f"{what}: the output was not freed between the passes"
            assert torch.equal(y, y_ref), f"{what}: the refilled output differs"
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


def _fused(spec=None, **kwargs):
    return LayerActivation(spec or SPECS["swiglu_clamp"], FUSED_KERNEL_PATH, F.silu, **kwargs)


def test_retained_graph_second_backward_reads_the_refilled_output():
    spec = SPECS["swiglu_clamp"]
    x, bias, probs, weight, grad = _inputs(spec, torch.float32, True, True, 4, 8, "cpu")
    w = weight.clone().requires_grad_()
    leaf = x.clone().requires_grad_()
    activation = _fused(recompute_output=True)
    y = activation(leaf * 1, bias, probs)
    out = y @ w
    assert activation.release_output(y, out, leaf * 1, bias, probs)
    out.backward(grad, retain_graph=True)
    first = w.grad.clone()
    w.grad = None
    out.backward(grad)
    assert torch.equal(w.grad, first)


@pytest.mark.parametrize(
    "case",
    [
        "option off",
        "no grad",
        "consumer without grad",
        "non-contiguous",
        "slice of a buffer",
        "empty",
    ],
)
def test_output_is_kept_where_freeing_cannot_help(case):
    spec = SPECS["swiglu_clamp"]
    x, _, _, weight, _ = _inputs(spec, torch.float32, False, False, 4, 8, "cpu")
    fc1_out = x.clone().requires_grad_() * 1
    activation = _fused(recompute_output=case != "option off")
    if case == "empty":
        fc1_out = fc1_out[:0]
    if case == "no grad":
        with torch.no_grad():
            y = activation(fc1_out)
            out = y @ weight
    else:
        y = activation(fc1_out)
        if case == "non-contiguous":
            y = y.t().contiguous().t()
        if case == "slice of a buffer":
            y = torch.cat([y, y])[:4]
        out = y.detach() @ weight if case == "consumer without grad" else y @ weight
    size = y.untyped_storage().nbytes()
    assert not activation.release_output(y, out, fc1_out)
    assert y.untyped_storage().nbytes() == size


@pytest.mark.parametrize("hooks", ["non-reentrant checkpoint", "saved-tensor hooks"])
def test_saved_tensor_hooks_keep_the_output_and_the_gradients(hooks):
    spec = SPECS["swiglu_clamp"]
    x, bias, probs, weight, grad = _inputs(spec, torch.float32, True, True, 4, 8, "cpu")
    freed = []

    def block(fc1_out, w, activation):
        y = activation(fc1_out, bias, probs)
        out = y @ w
        freed.append(activation.release_output(y, out, fc1_out, bias, probs))
        return out

    got = []
    for enabled in (False, True):
        activation = _fused(spec, recompute_output=enabled)
        leaf, w = x.clone().requires_grad_(), weight.clone().requires_grad_()
        if hooks == "non-reentrant checkpoint":
            out = torch.utils.checkpoint.checkpoint(
                block, leaf * 1, w, activation, use_reentrant=False
            )
        else:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
                out = block(leaf * 1, w, activation)
        out.backward(grad)
        got.append((leaf.grad, w.grad))
    assert not any(freed)
    assert all(torch.equal(a, b) for a, b in zip(*got))


@pytest.mark.parametrize("path", ["unfused", "fp8 input store"])
def test_only_the_fused_path_frees_its_output(path):
    spec = SPECS["swiglu"]
    if path == "unfused":
        activation = LayerActivation(spec, UNFUSED_PATH, F.silu, recompute_output=True)
    else:
        activation = _fused(spec, fp8_input_store=True, recompute_output=True)
    x, _, _, weight, _ = _inputs(spec, torch.float32, False, False, 4, 8, "cpu")
    fc1_out = x.clone().requires_grad_() * 1
    y = activation(fc1_out)
    assert not activation.release_output(y, y @ weight, fc1_out)


def test_compiled_region_keeps_the_output():
    spec = SPECS["swiglu_clamp"]
    activation = _fused(spec, recompute_output=True)
    x, _, _, weight, grad = _inputs(spec, torch.float32, False, False, 4, 8, "cpu")

    def block(fc1_out, w):
        y = activation(fc1_out)
        out = y @ w
        activation.release_output(y, out, fc1_out)
        return out

    compiled = torch.compile(block, backend="eager", fullgraph=True)
    leaf = x.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    compiled(leaf * 1, w).backward(grad)
    leaf_ref = x.clone().requires_grad_()
    w_ref = weight.clone().requires_grad_()
    block_out = activation(leaf_ref * 1) @ w_ref
    block_out.backward(grad)
    assert torch.equal(w.grad, w_ref.grad) and torch.equal(leaf.grad, leaf_ref.grad)


def test_recompute_fills_the_freed_storage_itself():
    x = torch.randn(4, 8, requires_grad=True)
    y = x * 2
    out = (y * y.detach()).sum()
    seen = []

    def recompute(target):
        seen.append((tuple(target.shape), target.dtype, target.untyped_storage()))
        target.copy_(x.detach() * 2)

    version = y._version
    assert output_recompute.discard_until_backward(y, out, recompute)
    out.backward()
    ((shape, dtype, storage),) = seen
    assert (shape, dtype) == ((4, 8), torch.float32)
    assert storage.data_ptr() == y.untyped_storage().data_ptr() != 0
    assert torch.equal(y, x.detach() * 2) and y._version == version


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


@pytest.mark.parametrize("per_token", [False, True], ids=["", "token weights"])
@pytest.mark.parametrize("in_place", [False, True], ids=["", "in place"])
@pytest.mark.parametrize("kind", ["mlp", "grouped"])
def test_layers_free_fc2_input_and_give_the_same_gradients(
    kind, in_place, per_token, layer_builder
):
    torch.manual_seed(3)
    layer = layer_builder(kind)
    hidden = torch.randn(6, 16) * 3 if kind == "grouped" else torch.randn(3, 2, 16) * 3
    per_token_scale = torch.rand(hidden.shape[:-1]) if per_token or kind == "grouped" else None
    freed = []
    discard = output_recompute.discard_until_backward

    def spy(output, consumer_output, recompute):
        result = discard(output, consumer_output, recompute)
        freed.append((result, output.untyped_storage().nbytes()))
        return result

    got = []
    with use_in_place_backward(in_place):
        for enabled in (False, True):
            with use_recompute_output(enabled), pytest.MonkeyPatch.context() as mp:
                mp.setattr(output_recompute, "discard_until_backward", spy)
                got.append(_layer_step(layer, kind, hidden, per_token_scale))
    assert freed == [(True, 0)], "the layer did not free fc2's input exactly once"
    for a, b in zip(*got):
        assert torch.equal(a, b)


MOE_ACT = dict(recompute_granularity="selective", recompute_modules=["moe_act"])


@pytest.mark.parametrize("in_place", [False, True], ids=["", "in place"])
def test_grouped_experts_honour_upstreams_moe_act_recompute(in_place, layer_builder):
    """'moe_act' (upstream's selective recompute of the MoE activation) turns the option on for
    the fork's TEGroupedMLP whatever the process default, and, recomputing from fc1's output
    itself, passes the in-place backward's config check that upstream's checkpoint fails."""
    from mcore_activations.fusions import in_place as in_place_mod

    torch.manual_seed(3)
    with use_in_place_backward(in_place):
        plain = layer_builder("grouped")
        recomputing = layer_builder("grouped", **MOE_ACT)
    assert recomputing.activation_recompute and not plain.activation_recompute
    recomputing.load_state_dict(plain.state_dict())
    hidden, probs = torch.randn(6, 16) * 3, torch.rand(6)
    freed = []
    discard = output_recompute.discard_until_backward

    def spy(output, consumer_output, recompute):
        freed.append(discard(output, consumer_output, recompute))
        return freed[-1]

    with use_in_place_backward(in_place), pytest.MonkeyPatch.context() as mp:
        mp.setattr(output_recompute, "discard_until_backward", spy)
        got = [_layer_step(layer, "grouped", hidden, probs) for layer in (plain, recomputing)]
    assert freed == [True]
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
def test_freed_output_lowers_the_memory_held_and_not_the_peak(name, in_place):
    """Between the passes one output less is held; the backward's peak does not grow (the
    output is recomputed into its own storage, and that storage is released with fc2's saved
    tensors, as without the option)."""
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
        out = y @ w
        activation.release_output(y, out, fc1_out, bias, probs)
        del y, fc1_out
        held[enabled] = torch.cuda.memory_allocated() - before
        torch.cuda.reset_peak_memory_stats()
        out.backward(grad)
        peak[enabled] = torch.cuda.max_memory_allocated() - before
        del out
    # One [rows, ffn] bf16 output less, to the allocator's rounding.
    assert abs(held[False] - held[True] - rows * ffn * 2) <= 4096, held
    assert peak[True] <= peak[False], peak
