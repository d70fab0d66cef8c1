"""The fc2-chunks option: the activation and fc2 run on row chunks of fc1's output.

With the in-place backward (``in_place``) and the output recompute (``output_recompute``) an
MLP keeps only fc1's output ``x`` between the passes, yet its backward still peaks inside fc2's
backward: fc2 needs the whole recomputed activation output ``y`` for its weight gradient and
makes the whole ``dy`` for the activation's backward, both ``[tokens, ffn]``, while ``x`` is
alive. With this option the layer splits ``x`` into ``chunks`` blocks of rows (fewer where a
block would be shorter than ``MIN_ROWS_PER_CHUNK``) and runs the activation and fc2 once per
block, so the backward goes block by block (fc2's backward for a
block, then the activation's, which writes the block's input gradient over the block of ``x``):
one block's ``y`` and ``dy`` exist at a time instead of the whole. The blocks are disjoint parts
of ``x``'s memory, so the input gradient of ``x`` is ``x``'s own buffer once every block has
written its part, and is handed to fc1 without a copy. Routed experts (``TEGroupedMLP``) split
the same way: their rows are sorted by expert, and each block's grouped fc2 gets the block's
share of every expert's rows (an expert cut by a block boundary runs in two GEMMs, one with no
row of a block runs none). docs/performance.md ("Low-memory backward") has the measured trade.

What changes for the caller: fc2 is called once per block (its hooks run once per block; a
tensor-parallel fc2 reduces each block's output), the outputs are concatenated, and the weight
gradient of fc2 and the bias gradient of fc1 are sums over the blocks, added in the gradient's
dtype (into the fp32 ``main_grad`` with ``gradient_accumulation_fusion``), as with gradient
accumulation over micro-batches. Values match the one-block layer to the dtype's rounding, not
bit for bit: a GEMM over fewer rows may sum in another order.

Refused at construction (the layer would compute something else, or the blocks would be
unsafe): a sequence-parallel fc2 (it scatters each block's rows over the ranks, and the
concatenation would interleave the shards), FP8 / FP4 (the quantization scales would come from
each block), ``tp_comm_overlap`` (its buffers are sized for the whole input), a delayed weight
gradient, and a layer without both memory options on and the fused kernels (the blocks would
save nothing). At a call where either option is off, no gradient is recorded, ``torch.compile``
is tracing or ``x`` is not contiguous, the layer runs in one piece, as without the option. A
layer built while the option was off keeps its config's conflicts and refuses blocks at the call
if the option is turned on later.

The option is off by default (1 block), as upstream behaves. Where it comes from, first match
wins: :func:`set_fc2_chunks` (or ``patch_megatron_core(fc2_chunks=...)``), then the environment
variable ``MCORE_ACTIVATIONS_FC2_CHUNKS`` (a positive integer; empty, 0 or 1 mean off), read
when this module is first imported.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from typing import Optional

import torch

from mcore_activations.fusions import in_place, output_recompute

ENV_VAR = "MCORE_ACTIVATIONS_FC2_CHUNKS"
OPTION = "fc2_chunks"

# A block shorter than this makes fc2's GEMMs small enough to slow the step more than the
# memory is worth; the layer uses fewer blocks rather than shorter ones.
MIN_ROWS_PER_CHUNK = 512


def fc2_chunks_from_env(environ: Optional[Mapping[str, str]] = None) -> int:
    """What ``MCORE_ACTIVATIONS_FC2_CHUNKS`` asks for: the number of blocks, 1 when unset.

    Args:
        environ: The environment to read; default ``os.environ``.

    Raises:
        ValueError: A value that is not empty or a non-negative integer: a typo must not decide
            silently how a layer runs.
    """
    raw = (os.environ if environ is None else environ).get(ENV_VAR)
    value = "" if raw is None else raw.strip()
    if value == "":
        return 1
    if value.isdigit():
        return max(int(value), 1)
    raise ValueError(
        f"{ENV_VAR}={raw!r} is not understood: set it to the number of row blocks the MLP's "
        "activation and fc2 run on (2 or more, with MCORE_ACTIVATIONS_IN_PLACE_BACKWARD=1 and "
        "MCORE_ACTIVATIONS_RECOMPUTE_OUTPUT=1), or to 1, 0 or empty (one block, as upstream)."
    )


def check_option(value, name: str = OPTION) -> Optional[int]:
    """``value`` if it is None (the process default) or a positive int.

    Raises:
        TypeError: not an int (a bool or a string included).
        ValueError: an int below 1.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{name} must be a positive int (the number of row blocks; 1: off) or None (the "
            f"process default, {ENV_VAR} unless set_fc2_chunks changed it); got {value!r} "
            f"({type(value).__name__})."
        )
    if value < 1:
        raise ValueError(f"{name} must be at least 1 (1: off, as upstream); got {value}.")
    return value


_default = fc2_chunks_from_env()


def fc2_chunks() -> int:
    """The process default: how many row blocks MLP layers split the activation and fc2 into."""
    return _default


def set_fc2_chunks(chunks: int) -> int:
    """Sets the process default; returns the previous one.

    Raises:
        TypeError, ValueError: ``chunks`` is not a positive int.
    """
    global _default
    check_option(chunks, "set_fc2_chunks's argument")
    previous, _default = _default, chunks
    return previous


# ------------------------------------------------------------------ configurations refused
def config_conflicts(config, *, is_expert: bool = False) -> list[str]:
    """The settings of ``config`` under which row blocks would change or break the layer."""
    found = []
    if getattr(config, "sequence_parallel", False) and not is_expert:
        found.append(
            "sequence_parallel=True (fc2 scatters each block's rows over the ranks, and the "
            "concatenated output would interleave the ranks' shards)"
        )
    for field in ("fp8", "fp4"):
        value = getattr(config, field, None)
        if value:
            found.append(f"{field}={value!r} (each block would get its own quantization scales)")
    if getattr(config, "tp_comm_overlap", False):
        found.append("tp_comm_overlap=True (its buffers are sized for the whole input)")
    for field in ("delay_wgrad_compute", "overlap_dispatch_backward_with_experts_wgrad"):
        # Either defers the weight gradient: fc2 would queue one per block, and the layer's
        # backward_dw computes one per layer.
        if getattr(config, field, False):
            found.append(f"{field}=True (fc2 keeps one deferred weight gradient per call)")
    return found


def check_layer(
    config, owner: str, activation, *, is_expert: bool = False, layer_conflicts=()
) -> tuple[str, ...]:
    """Refuses, at construction, a layer that cannot run on row blocks while the option is on.

    Args:
        config: The layer's config.
        owner: The layer's class name, for the message.
        activation: The layer's ``LayerActivation``; None for a layer whose forward does not
            call one (``layer_conflicts`` then says why it cannot run on blocks).
        is_expert: The layer is a routed expert (its fc2 never scatters over the sequence).
        layer_conflicts: What else of the layer stops it from running on row blocks, each a
            setting and the reason, as :func:`config_conflicts` words them.

    Returns:
        The config's conflicts (:func:`config_conflicts`) whatever the option is now: the layer
        keeps them and passes them to :func:`activation_and_fc2`, which refuses blocks at a call
        when the option was turned on after the layer was built.

    Raises:
        ValueError: the option is on (more than one block) and the config or the activation's
            path conflicts with it, or a memory option it needs is off; the message names them
            and what to change.
    """
    conflicts = tuple(config_conflicts(config, is_expert=is_expert)) + tuple(layer_conflicts)
    if _default <= 1:
        return conflicts
    found = list(conflicts)
    in_place_on = in_place.resolve(getattr(activation, "in_place_backward", None))
    recompute_on = output_recompute.resolve(getattr(activation, "recompute_output", None))
    if activation is not None and not activation.recomputes_fused_output():
        # Only the fused kernels, saving fc1's output as it is, write their input gradient over
        # it block by block.
        if activation.fp8_input_store:
            found.append("activation_func_fp8_input_store=True (the blocks' input is an FP8 copy)")
        elif activation.offload_input():
            found.append("CPU offloading of the activation's input (the offload handler owns it)")
        else:
            found.append(
                f"the activation on the {activation.path!r} path (only the fused kernels, "
                "bias_activation_fusion=True, write their input gradient over fc1's output)"
            )
    if not in_place_on:
        found.append(f"{in_place.OPTION} off ({in_place.ENV_VAR}=1 turns it on)")
    if not recompute_on:
        found.append(f"{output_recompute.OPTION} off ({output_recompute.ENV_VAR}=1 turns it on)")
    if found:
        raise ValueError(
            f"{owner}: {OPTION}={_default} ({ENV_VAR}) runs the activation and fc2 on row "
            f"blocks of fc1's output, which does not work here: {'; '.join(found)}. Set "
            f"{OPTION} to 1 ({ENV_VAR}=1 or set_fc2_chunks(1)), or change those settings."
        )
    return conflicts


def refuse_late(owner: str, conflicts) -> None:
    """Raises for a layer built while the option was off whose ``conflicts`` (what
    :func:`check_layer` returned) keep it from running on the blocks now asked for.

    Raises:
        ValueError: always, naming the conflicts and what to do.
    """
    raise ValueError(
        f"{owner}: {OPTION}={_default} was set after this layer was built, and it cannot run "
        f"on row blocks: {'; '.join(conflicts)}. Set {OPTION} to 1 (or set_fc2_chunks(1)) "
        "while it runs, or change those settings."
    )


# ------------------------------------------------------------------ the blocks
def row_counts(rows: int, chunks: int) -> list[int]:
    """How many rows each block gets: at most ``chunks`` blocks, none shorter than
    ``MIN_ROWS_PER_CHUNK`` unless there is a single one, the first ones one row longer."""
    chunks = max(1, min(chunks, rows // MIN_ROWS_PER_CHUNK))
    share, rest = divmod(rows, chunks)
    return [share + (i < rest) for i in range(chunks)]


class _RowBlocks(torch.autograd.Function):
    """``x`` as disjoint blocks of rows along dim 0, each a tensor of its own on ``x``'s memory.

    The blocks are not autograd views of ``x``: each has its own version counter, so the in-place
    backward of one block (which bumps its counter) does not invalidate what the other blocks'
    nodes saved of theirs. Each block is marked a part of ``x`` (``in_place.mark_part_of``): its
    in-place backward bumps ``x``'s counter at the write, so a node that saved ``x`` itself and
    runs after that write (a forward hook's term, say) refuses to read the gradient as its input,
    as with the one-block in-place backward. ``x`` is kept on ``ctx``, not saved: its counter
    moves during the backward by design.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, counts: list[int]):
        ctx.x, ctx.counts = x, counts
        storage, stride = x.untyped_storage(), x.stride()
        blocks, offset = [], x.storage_offset()
        for rows in counts:
            block = x.new_empty(0).set_(storage, offset, (rows, *x.shape[1:]), stride)
            in_place.mark_part_of(block, x)
            blocks.append(block)
            offset += rows * stride[0]
        return tuple(blocks)

    @staticmethod
    def backward(ctx, *grads):
        x = ctx.x
        pointer, offset = x.untyped_storage().data_ptr(), x.storage_offset()
        written = True
        for grad, rows in zip(grads, ctx.counts):
            written = (
                written
                and grad is not None
                and grad.untyped_storage().data_ptr() == pointer
                and grad.storage_offset() == offset
                and grad.stride() == x.stride()
            )
            offset += rows * x.stride(0)
        if written:
            return x.detach(), None  # every block's gradient is in place: x's buffer is dx
        parts = [
            torch.zeros((rows, *x.shape[1:]), dtype=x.dtype, device=x.device) if g is None else g
            for g, rows in zip(grads, ctx.counts)
        ]
        return torch.cat(parts), None


def expert_splits(tokens_per_expert: list[int], counts: list[int]) -> list[list[int]]:
    """Each block's share of every expert's rows, for a grouped fc2 called once per block.

    Rows are sorted by expert (``tokens_per_expert[e]`` rows of expert ``e`` after those of the
    experts before it); block ``b`` holds ``counts[b]`` rows after the blocks before it. An
    expert whose rows straddle a block boundary gets a part in each of those blocks, and an
    expert with no row in a block gets 0 there (a grouped GEMM of zero rows adds nothing to its
    weight gradient), so each block's list sums to its row count and has one entry per expert.
    """
    ends, total = [], 0
    for tokens in tokens_per_expert:
        total = total + int(tokens)
        ends.append(total)
    out, start = [], 0
    for rows in counts:
        stop, begin, share = start + rows, 0, []
        for end in ends:
            share.append(max(0, min(end, stop) - max(begin, start)))
            begin = end
        out.append(share)
        start = stop
    return out


def _row_split(tokens_per_expert, x: torch.Tensor) -> list[int]:
    """``tokens_per_expert`` as ints, checked against ``x``'s rows (blocks would otherwise
    hand rows to the wrong experts)."""
    if isinstance(tokens_per_expert, torch.Tensor):
        tokens_per_expert = tokens_per_expert.tolist()
    split = [int(n) for n in tokens_per_expert]
    if any(n < 0 for n in split) or sum(split) != x.shape[0]:
        raise ValueError(
            f"tokens_per_expert {split} must be non-negative and sum to the {x.shape[0]} rows of "
            "fc1's output (each expert's rows, sorted by expert)."
        )
    return split


def _can_split(x: torch.Tensor, activation) -> bool:
    return (
        _default > 1
        and torch.is_grad_enabled()
        and x.requires_grad
        and x.dim() >= 2
        and x.is_contiguous()
        and not torch.compiler.is_compiling()
        and activation.recomputes_fused_output()
        and in_place.resolve(activation.in_place_backward)
        and output_recompute.resolve(activation.recompute_output)
    )


@contextlib.contextmanager
def _range(nvtx: Optional[Callable[[str, str], None]], name: str):
    if nvtx is not None:
        nvtx("push", name)
    yield
    if nvtx is not None:
        nvtx("pop", name)


def activation_and_fc2(
    activation,
    fc2,
    x,
    bias,
    probs,
    func,
    conflicts=(),
    owner="MLP",
    nvtx=None,
    tokens_per_expert=None,
):
    """fc2(activation(x)) with the option's row blocks, or in one piece when they cannot help.

    Args:
        activation: The layer's ``LayerActivation``.
        fc2: The layer's fc2 linear, returning ``(output, output_bias)``.
        x: fc1's output ``[rows, ..., 2 * ffn or ffn]``, split along dim 0.
        bias: fc1's unadded bias, or None.
        probs: Per-row weights shaped like ``x`` with a last dimension of 1, or None.
        func: The layer's ``activation_func``, passed on to ``activation``.
        conflicts: What :func:`check_layer` returned for the layer.
        owner: The layer's class name, for the message.
        nvtx: ``nvtx(what, name)``, ``what`` being "push" or "pop": called around each
            activation call ("activation") and each fc2 call ("linear_fc2"), upstream's NVTX
            ranges; None: no ranges.
        tokens_per_expert: For routed experts' grouped fc2, the rows of each expert in ``x``
            (sorted by expert); fc2 is then called ``fc2(y, splits)`` with each block's share
            of them (:func:`expert_splits`). None: a dense fc2, called ``fc2(y)``.

    Returns:
        ``(output, output_bias)`` as fc2 returns them, the blocks' outputs concatenated.

    Raises:
        ValueError: the option was turned on after a layer with ``conflicts`` was built.
    """
    counts = row_counts(x.shape[0], _default) if _can_split(x, activation) else [x.shape[0]]
    if len(counts) > 1 and conflicts:
        refuse_late(owner, conflicts)
    if len(counts) == 1:
        with _range(nvtx, "activation"):
            y = activation(x, bias, probs, func=func)
        # With the output-recompute option fc2 saves a recipe of its input, not the input.
        with _range(nvtx, "linear_fc2"), activation.fc2_saves_recipe(y, x, bias, probs):
            return fc2(y) if tokens_per_expert is None else fc2(y, tokens_per_expert)
    fc2_args = [()] * len(counts)
    if tokens_per_expert is not None:
        fc2_args = [(split,) for split in expert_splits(_row_split(tokens_per_expert, x), counts)]
    # The blocks' in-place backwards write over x: x itself must be safe to write over (not a
    # leaf, not held by saved-tensor hooks, not claimed by another in-place activation).
    in_place.check_forward(x, cpu_offload_input=False)
    blocks = _RowBlocks.apply(x, counts)
    prob_blocks = probs.split(counts) if probs is not None else [None] * len(counts)
    outputs, output_bias = [], None
    for block, block_probs, args in zip(blocks, prob_blocks, fc2_args):
        with _range(nvtx, "activation"):
            y = activation(block, bias, block_probs, func=func)
        with _range(nvtx, "linear_fc2"), activation.fc2_saves_recipe(y, block, bias, block_probs):
            out, output_bias = fc2(y, *args)
        del y  # freed now: the recipe stands in for it
        outputs.append(out)
    return torch.cat(outputs), output_bias
