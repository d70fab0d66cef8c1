"""The fc2-chunks option: the MLP's activation and fc2 on row blocks of fc1's output.

The layer (the fork's ``MLP`` with local linears, every catalogue activation, biases and token
weights) gives the one-block layer's output and gradients to the dtype's tolerance; fc1 gets
its output's own buffer back as the gradient (no concatenation); a node that saved fc1's output
and runs after the blocks refuses to read it; a second backward is refused; what cannot run on
blocks is refused at construction, naming the setting; the option's variable and setters are
parsed strictly. The fork's ``TEGroupedMLP`` (a CPU grouped linear) gives its one-block
layer's values too, each block's fc2 called with the block's share of every expert's rows.
Under ``-m gpu``: the blocks lower the layer's backward peak, and on Transformer Engine's
grouped linears (experts without a row in a block, ``main_grad`` accumulation) the grouped layer
gives its one-block values.
"""

from __future__ import annotations

import pytest
import torch

from mcore_activations.fusions import fc2_chunks
from mcore_activations.fusions.in_place import use_in_place_backward
from mcore_activations.fusions.output_recompute import use_recompute_output
from tests.unit_tests.activation_catalog import NEEDS_MOE
from tests.unit_tests.tolerances import assert_close_to_reference

ACTIVATIONS = ["swiglu", "swiglu_clamp", "quick_geglu_gpt_oss", "situ_glu", "gelu"]


@pytest.fixture
def chunks(monkeypatch):
    """Sets the option for the test (and lets a block be one row long); restored after."""

    def set_chunks(n):
        monkeypatch.setattr(fc2_chunks, "MIN_ROWS_PER_CHUNK", 1)
        monkeypatch.setattr(fc2_chunks, "_default", n)

    return set_chunks


@pytest.fixture
def build_mlp():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.mlp import MLP
    from tests.unit_tests.test_utilities import Utils
    from tests.unit_tests.transformer.mlp_test_utils import FUSED, make_config

    Utils.initialize_model_parallel(1, 1)
    pg = ProcessGroupCollection.use_mpu_process_groups(["tp", "ep", "expt_tp"])

    def build(name="swiglu_clamp", dtype=torch.float32, **overrides):
        fields = dict(num_layers=1, hidden_size=16, ffn_hidden_size=24)
        if name in NEEDS_MOE:
            fields |= dict(num_moe_experts=2, moe_ffn_hidden_size=24)
        config = make_config(name, dtype, FUSED, **(fields | overrides))
        torch.manual_seed(0)
        submodules = get_gpt_layer_local_submodules().mlp.submodules
        return MLP(
            config,
            submodules,
            ffn_hidden_size=config.ffn_hidden_size,
            tp_group=pg.tp,
            pg_collection=pg,
        )

    yield build
    Utils.destroy_model_parallel()


def _step(layer, hidden, scale=None):
    layer.zero_grad()
    h = hidden.clone().requires_grad_()
    s = scale.clone().requires_grad_() if scale is not None else None
    out, bias = layer(h, per_token_scale=s)
    loss = out if bias is None else out + bias
    loss.square().sum().backward()
    grads = [h.grad] + ([s.grad] if s is not None else [])
    return [out.detach()] + grads + [p.grad.clone() for p in layer.parameters()]


class _Options:
    """Both memory options on inside the block."""

    def __enter__(self):
        self._in_place, self._recompute = use_in_place_backward(True), use_recompute_output(True)
        self._in_place.__enter__(), self._recompute.__enter__()

    def __exit__(self, *exc):
        self._recompute.__exit__(*exc), self._in_place.__exit__(*exc)


# ------------------------------------------------------------------------------ the layer
@pytest.mark.parametrize("per_token", [False, True], ids=["", "token weights"])
@pytest.mark.parametrize("n", [2, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_blocks_give_the_one_block_layer(name, dtype, n, per_token, build_mlp, chunks):
    layer = build_mlp(name, dtype)
    gen = torch.Generator().manual_seed(1)
    hidden = (torch.randn(7, 2, 16, generator=gen) * 3).to(dtype)
    scale = torch.rand(7, 2, generator=gen) if per_token else None
    # The reference: the same layer in float64, one block, no memory option.
    reference = _step(layer.double(), hidden.double(), scale)
    layer.to(dtype)
    chunks(n)
    with _Options():
        got = _step(layer, hidden, scale)
    for i, (g, r) in enumerate(zip(got, reference)):
        assert_close_to_reference(g, r, dtype, f"{name} tensor {i}")


def test_fc1_gets_its_own_output_buffer_as_the_gradient(build_mlp, chunks):
    layer = build_mlp()
    chunks(3)
    seen = {}

    def keep(module, args, output):
        fc1_output = output[0]
        seen["output"] = fc1_output.untyped_storage().data_ptr()
        fc1_output.register_hook(lambda g: seen.update(grad=g.untyped_storage().data_ptr()))

    layer.linear_fc1.register_forward_hook(keep)
    with _Options():
        out, _ = layer(torch.randn(7, 2, 16).requires_grad_())
        out.sum().backward()
    assert seen["grad"] == seen["output"]


def test_a_later_reader_of_fc1_output_refuses_the_overwritten_values(build_mlp, chunks):
    """A term computed from fc1's output before the blocks reads it in its backward after
    every block wrote its gradient there: it must raise, not use the gradient as the input."""
    layer = build_mlp()
    chunks(3)
    extra = []
    layer.linear_fc1.register_forward_hook(lambda m, a, out: extra.append(out[0].square().sum()))
    with _Options():
        out, _ = layer(torch.randn(7, 2, 16).requires_grad_())
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            (out.sum() + extra[0]).backward()


def test_a_reader_of_fc1_output_inside_the_blocks_refuses_the_overwritten_values(build_mlp, chunks):
    """A term fc2's forward hook computes from the whole of fc1's output, once per block, runs
    its backward after later blocks wrote their gradients over their rows: it must raise at the
    first such read, not compute with the gradient as its input."""
    layer = build_mlp()
    chunks(3)
    seen = {}
    layer.linear_fc1.register_forward_hook(lambda m, a, out: seen.update(x=out[0]))
    layer.linear_fc2.register_forward_hook(
        lambda m, a, out: (out[0] + seen["x"].square().mean(), out[1])
    )
    with _Options():
        out, _ = layer(torch.randn(7, 2, 16).requires_grad_())
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


def test_a_second_backward_is_refused(build_mlp, chunks):
    layer = build_mlp()
    chunks(2)
    with _Options():
        out, _ = layer(torch.randn(7, 2, 16).requires_grad_())
        out.sum().backward(retain_graph=True)
        # The recipe of the block whose input was overwritten refuses first, naming the cause.
        with pytest.raises(RuntimeError, match="through the graph once|second backward"):
            out.sum().backward()


def test_one_block_where_blocks_cannot_help(build_mlp, chunks):
    """No gradient, or a memory option off at the call: the layer runs in one piece, with the
    same values."""
    layer = build_mlp()
    hidden = torch.randn(7, 2, 16)
    with torch.no_grad():
        expected, _ = layer(hidden)
    with _Options():
        chunks(3)
    calls = []
    layer.linear_fc2.register_forward_hook(lambda *args: calls.append(1))
    with torch.no_grad(), _Options():
        out, _ = layer(hidden)
    assert torch.equal(out, expected) and len(calls) == 1
    with use_in_place_backward(False), use_recompute_output(True):
        layer(hidden.requires_grad_())[0].sum().backward()
    assert len(calls) == 2
    with _Options():
        layer(hidden.requires_grad_())[0].sum().backward()
    assert len(calls) == 5


@pytest.mark.parametrize(
    "overrides, named",
    [
        (
            dict(
                sequence_parallel=True,
                tensor_model_parallel_size=2,
                expert_tensor_parallel_size=1,
            ),
            "sequence_parallel=True",
        ),
        (dict(delay_wgrad_compute=True), "delay_wgrad_compute=True"),
        (dict(bias_activation_fusion=False), "'unfused' path"),
    ],
    ids=["sequence parallel", "delayed wgrad", "unfused path"],
)
def test_what_cannot_run_on_blocks_is_refused_when_built(overrides, named, build_mlp, chunks):
    chunks(4)
    with _Options(), pytest.raises(ValueError, match=f"fc2_chunks=4.*{named}"):
        build_mlp(**overrides)


def test_the_option_turned_on_after_construction_is_refused_at_the_call(build_mlp, chunks):
    with _Options():
        layer = build_mlp(delay_wgrad_compute=True)  # the option is off: built
        chunks(3)
        with pytest.raises(ValueError, match="set after this layer was built.*delay_wgrad"):
            layer(torch.randn(7, 2, 16).requires_grad_())


@pytest.mark.parametrize("off", ["in_place_backward", "recompute_output"])
def test_a_memory_option_off_is_refused_when_built(off, build_mlp, chunks):
    chunks(2)
    in_place, recompute = off != "in_place_backward", off != "recompute_output"
    with use_in_place_backward(in_place), use_recompute_output(recompute):
        with pytest.raises(ValueError, match=f"{off} off"):
            build_mlp()


def test_the_config_conflicts_name_each_setting():
    class Config:
        sequence_parallel = True
        fp8 = "hybrid"
        fp4 = None
        tp_comm_overlap = True
        delay_wgrad_compute = False
        overlap_dispatch_backward_with_experts_wgrad = True  # defers the experts' wgrad too

    found = fc2_chunks.config_conflicts(Config())
    assert [f.split(" ")[0] for f in found] == [
        "sequence_parallel=True",
        "fp8='hybrid'",
        "tp_comm_overlap=True",
        "overlap_dispatch_backward_with_experts_wgrad=True",
    ]
    # A routed expert's fc2 never scatters its rows over the sequence.
    assert len(fc2_chunks.config_conflicts(Config(), is_expert=True)) == 3


# ------------------------------------------------------------------------------ routed experts
# Rows sorted by expert: an expert with no token, and three blocks of 4 rows that cut experts.
TOKENS_PER_EXPERT = [5, 0, 4, 3]


@pytest.fixture
def build_grouped():
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP
    from tests.unit_tests.test_utilities import Utils
    from tests.unit_tests.transformer.mlp_test_utils import FUSED, make_config
    from tests.unit_tests.transformer.moe.test_grouped_mlp import LocalGroupedLinear

    Utils.initialize_model_parallel(1, 1)
    pg = ProcessGroupCollection.use_mpu_process_groups(["tp", "ep", "expt_tp"])
    experts = len(TOKENS_PER_EXPERT)

    def build(name="swiglu_clamp", dtype=torch.float32, **overrides):
        fields = dict(num_layers=1, hidden_size=16, ffn_hidden_size=24, add_bias_linear=True)
        fields |= dict(num_moe_experts=experts, moe_ffn_hidden_size=24)
        config = make_config(name, dtype, FUSED, **(fields | overrides))
        torch.manual_seed(0)
        linear = GroupedMLPSubmodules(linear_fc1=LocalGroupedLinear, linear_fc2=LocalGroupedLinear)
        layer = TEGroupedMLP(experts, config, linear, pg_collection=pg)
        with torch.no_grad():  # non-zero biases, so that each block's share of them matters
            for p in layer.parameters():
                if p.dim() == 1:
                    p.copy_(torch.randn(p.shape) * 0.5)
        return layer

    yield build
    Utils.destroy_model_parallel()


def _grouped_step(layer, hidden, probs):
    layer.zero_grad()
    h, q = hidden.clone().requires_grad_(), probs.clone().requires_grad_()
    out, _ = layer(h, torch.tensor(TOKENS_PER_EXPERT), q)
    out.square().sum().backward()
    return [out.detach(), h.grad, q.grad] + [p.grad.clone() for p in layer.parameters()]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["swiglu_clamp", "quick_geglu_gpt_oss"])
def test_grouped_experts_blocks_give_the_one_block_layer(name, dtype, n, build_grouped, chunks):
    layer = build_grouped(name, dtype)
    gen = torch.Generator().manual_seed(1)
    rows = sum(TOKENS_PER_EXPERT)
    hidden = (torch.randn(rows, 16, generator=gen) * 3).to(dtype)
    probs = torch.rand(rows, generator=gen)
    reference = _grouped_step(layer.double(), hidden.double(), probs.double())
    layer.to(dtype)
    chunks(n)
    splits = []
    layer.linear_fc2.register_forward_hook(lambda m, args, out: splits.append(list(args[1])))
    with _Options():
        got = _grouped_step(layer, hidden, probs.to(dtype))
    assert splits == fc2_chunks.expert_splits(TOKENS_PER_EXPERT, fc2_chunks.row_counts(rows, n))
    assert len(splits) == n
    for i, (g, r) in enumerate(zip(got, reference)):
        assert_close_to_reference(g, r, dtype, f"{name} tensor {i}")


def test_grouped_experts_refuse_blocks_with_a_memory_option_off(build_grouped, chunks):
    chunks(2)
    with use_in_place_backward(True), use_recompute_output(False):
        with pytest.raises(ValueError, match="TEGroupedMLP: fc2_chunks=2.*recompute_output off"):
            build_grouped()


def test_expert_splits():
    # Block b gets each expert's rows that fall inside its own rows; every list has one entry
    # per expert and sums to the block's rows.
    assert fc2_chunks.expert_splits([5, 0, 4, 3], [4, 4, 4]) == [
        [4, 0, 0, 0],
        [1, 0, 3, 0],
        [0, 0, 1, 3],
    ]
    assert fc2_chunks.expert_splits([3, 3], [6]) == [[3, 3]]
    assert fc2_chunks.expert_splits([0, 6, 0], [3, 3]) == [[0, 3, 0], [0, 3, 0]]
    # Counts as a tensor's elements: plain ints out, each expert's own end.
    assert fc2_chunks.expert_splits(list(torch.tensor([600, 424])), [512, 512]) == [
        [512, 0],
        [88, 424],
    ]


@pytest.mark.parametrize(
    "tokens", [[5, 0, 4, 4], [5, -1, 4, 4], torch.tensor([6, 0, 6, 1])], ids=["13", "-1", "tensor"]
)
def test_grouped_blocks_refuse_counts_that_do_not_match_the_rows(tokens, build_grouped, chunks):
    layer = build_grouped()
    chunks(3)
    x = torch.randn(12, 48, requires_grad=True).clone()
    with _Options(), pytest.raises(ValueError, match="must be non-negative and sum to the 12 rows"):
        fc2_chunks.activation_and_fc2(
            layer.layer_activation,
            layer.linear_fc2,
            x,
            None,
            torch.rand(12, 1),
            layer.activation_func,
            tokens_per_expert=tokens,
        )


# ------------------------------------------------------------------------------ the option
@pytest.mark.parametrize(
    "raw, expected", [(None, 1), ("", 1), (" 0 ", 1), ("1", 1), ("4", 4), (" 16", 16)]
)
def test_environment_variable(raw, expected):
    environ = {} if raw is None else {fc2_chunks.ENV_VAR: raw}
    assert fc2_chunks.fc2_chunks_from_env(environ) == expected


@pytest.mark.parametrize("raw", ["on", "-2", "4.0", "four"])
def test_environment_variable_refuses_what_it_does_not_understand(raw):
    with pytest.raises(ValueError, match=f"{fc2_chunks.ENV_VAR}={raw!r} is not understood"):
        fc2_chunks.fc2_chunks_from_env({fc2_chunks.ENV_VAR: raw})


def test_setters_and_argument_checks():
    previous = fc2_chunks.set_fc2_chunks(3)
    try:
        assert fc2_chunks.fc2_chunks() == 3
    finally:
        fc2_chunks.set_fc2_chunks(previous)
    for value in (True, "2", 2.0):
        with pytest.raises(TypeError, match="fc2_chunks must be a positive int"):
            fc2_chunks.check_option(value)
    with pytest.raises(ValueError, match="at least 1"):
        fc2_chunks.check_option(0)


def test_row_counts():
    assert fc2_chunks.row_counts(10_000, 4) == [2500] * 4
    assert sum(fc2_chunks.row_counts(4099, 8)) == 4099
    # No block shorter than the minimum, unless there is only one.
    assert fc2_chunks.row_counts(3 * fc2_chunks.MIN_ROWS_PER_CHUNK, 8) == [512] * 3
    assert fc2_chunks.row_counts(5, 8) == [5]


# ------------------------------------------------------------------------------ on the GPU
@pytest.mark.gpu
def test_blocks_lower_the_backward_peak(build_mlp, monkeypatch):
    """The layer's forward+backward peak drops by at least half the activation's output size
    (the whole output and its gradient become one block's)."""
    seq, hidden, ffn = 4096, 1024, 4096
    peaks = {}
    for n in (1, 1, 4):  # the first run warms up cuBLAS and the kernels
        monkeypatch.setattr(fc2_chunks, "_default", 1)
        layer = build_mlp(
            "swiglu",
            torch.bfloat16,
            hidden_size=hidden,
            ffn_hidden_size=ffn,
            add_bias_linear=False,
        ).cuda()
        monkeypatch.setattr(fc2_chunks, "_default", n)
        x = torch.randn(seq, 1, hidden, device="cuda", dtype=torch.bfloat16).requires_grad_()
        grad = torch.randn_like(x)
        with _Options():
            layer(x)[0].backward(grad)  # the weights' .grad exist before the measured step
            x.grad = None
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            layer(x)[0].backward(grad)
            peaks[n] = torch.cuda.max_memory_allocated() - before
    output_bytes = seq * ffn * 2
    assert peaks[4] <= peaks[1] - output_bytes // 2, peaks


@pytest.mark.gpu
def test_grouped_experts_on_te_grouped_linears_accumulate_the_same_main_grad(chunks):
    """Transformer Engine's grouped GEMMs with blocks that give some experts no row, the weight
    gradients fused into fp32 ``main_grad``: the output, the input gradient and every
    ``main_grad`` match the one-block layer's."""
    from megatron.core.extensions.te_linears import (
        TEColumnParallelGroupedLinear,
        TERowParallelGroupedLinear,
    )
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP
    from tests.unit_tests.test_utilities import Utils
    from tests.unit_tests.transformer.mlp_test_utils import FUSED, make_config

    tokens = [700, 0, 300, 1048]  # three blocks of 683 rows: experts cut, one never present
    Utils.initialize_model_parallel(1, 1)
    try:
        pg = ProcessGroupCollection.use_mpu_process_groups(["tp", "ep", "expt_tp"])
        fields = dict(num_layers=1, hidden_size=256, ffn_hidden_size=512, add_bias_linear=False)
        fields |= dict(num_moe_experts=len(tokens), moe_ffn_hidden_size=512)
        fields |= dict(gradient_accumulation_fusion=True, use_cpu_initialization=True)
        config = make_config("swiglu_clamp", torch.bfloat16, FUSED, **fields)
        linears = GroupedMLPSubmodules(
            linear_fc1=TEColumnParallelGroupedLinear, linear_fc2=TERowParallelGroupedLinear
        )
        torch.manual_seed(0)
        layer = TEGroupedMLP(len(tokens), config, linears, pg_collection=pg).cuda()
        for p in layer.parameters():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device="cuda")
        gen = torch.Generator().manual_seed(1)
        hidden = (torch.randn(sum(tokens), 256, generator=gen) * 3).cuda().bfloat16()
        probs = torch.rand(sum(tokens), generator=gen).cuda()
        results = {}
        for n in (1, 3):
            chunks(n)
            for p in layer.parameters():
                p.main_grad.zero_()
            h = hidden.clone().requires_grad_()
            with _Options():
                out, _ = layer(h, torch.tensor(tokens), probs)
                out.float().square().sum().backward()
            results[n] = [out.detach(), h.grad] + [p.main_grad.clone() for p in layer.parameters()]
        for i, (g, r) in enumerate(zip(results[3], results[1])):
            assert_close_to_reference(g, r.double(), torch.bfloat16, f"tensor {i}")
        assert results[1][-1].abs().max() > 0  # main_grad was written
    finally:
        Utils.destroy_model_parallel()
