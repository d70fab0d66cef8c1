"""Rank layouts: which global ranks form each parallel group (no process groups created).

``parallel_state`` builds its groups from these layouts; the names are re-exported there.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

__all__ = ["RankGenerator", "generate_masked_orthogonal_rank_groups"]

# The parallel dimensions a layout order names.
_LAYOUT_TOKENS = ("tp", "cp", "ep", "dp", "pp")


def generate_masked_orthogonal_rank_groups(
    world_size: int, parallel_size: Sequence[int], mask: Sequence[bool]
) -> list[list[int]]:
    """Partitions ``range(world_size)`` into the groups that vary only along masked dimensions.

    Rank ``r`` has coordinates ``c_i = (r // prod(parallel_size[:i])) % parallel_size[i]``
    (dimension 0 varies fastest). Two ranks share a group exactly when their coordinates agree
    on every unmasked dimension. Inside a group, and across groups, the first dimension again
    varies fastest.

    Args:
        world_size: Number of ranks; must equal ``prod(parallel_size)``.
        parallel_size: Size of each dimension, fastest first.
        mask: Which dimensions a group spans.

    Returns:
        The groups, each a list of global ranks.

    Example:
        sizes ``[tp=2, dp=3]`` over 6 ranks: the mask ``[True, False]`` gives the tp groups
        ``[[0, 1], [2, 3], [4, 5]]``; ``[False, True]`` gives the dp groups ``[[0, 2, 4],
        [1, 3, 5]]``.
    """
    if len(parallel_size) != len(mask):
        raise ValueError(
            f"parallel_size {list(parallel_size)} and mask {list(mask)} differ in length"
        )
    if math.prod(parallel_size) != world_size:
        raise ValueError(
            f"the product of parallel_size {list(parallel_size)} must equal world_size "
            f"({world_size})"
        )
    strides = [math.prod(parallel_size[:i]) for i in range(len(parallel_size))]
    inner = [i for i, masked in enumerate(mask) if masked]
    outer = [i for i, masked in enumerate(mask) if not masked]

    def offsets(dims: list[int]) -> list[int]:
        # itertools.product varies its last factor fastest; feed the dimensions reversed so the
        # first one varies fastest, matching the rank numbering.
        ranges = [range(parallel_size[d]) for d in reversed(dims)]
        return [
            sum(c * strides[d] for c, d in zip(coords, reversed(dims)))
            for coords in itertools.product(*ranges)
        ]

    inner_offsets = offsets(inner)
    return [[base + off for off in inner_offsets] for base in offsets(outer)]


class RankGenerator:
    """Enumerates the rank groups of one layout (dense or expert).

    Args:
        tp: Tensor-parallel size (the expert-tensor size in the expert layout).
        ep: Expert-model-parallel size (1 in the dense layout).
        dp: Data-parallel size (the expert-data size in the expert layout).
        pp: Pipeline-parallel size.
        cp: Context-parallel size (1 in the expert layout).
        order: Dimension order, fastest first, e.g. ``"tp-cp-ep-dp-pp"``. A dimension missing
            from it must have size 1.
        rank_offset: Added to every rank (only 0 is supported by ``initialize_model_parallel``).
    """

    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, rank_offset=0):
        self.sizes = {"tp": tp, "ep": ep, "dp": dp, "pp": pp, "cp": cp}
        tokens = order.lower().split("-")
        unknown = [t for t in tokens if t not in _LAYOUT_TOKENS]
        if unknown or len(set(tokens)) != len(tokens):
            raise ValueError(
                f"order={order!r}: use each of {', '.join(_LAYOUT_TOKENS)} at most once, "
                "joined by '-', e.g. 'tp-cp-ep-dp-pp'."
            )
        for token in _LAYOUT_TOKENS:
            if token not in tokens:
                if self.sizes[token] != 1:
                    raise ValueError(
                        f"order={order!r} lacks {token!r} but its size is {self.sizes[token]}; "
                        f"add {token!r} to the order."
                    )
                tokens.append(token)
        self.order = tokens
        self.rank_offset = rank_offset
        self.world_size = math.prod(self.sizes.values())

    def get_ranks(self, token: str) -> list[list[int]]:
        """Returns every group spanning the dimensions named in ``token`` (e.g. ``"tp-cp"``)."""
        wanted = token.split("-")
        unknown = [t for t in wanted if t not in _LAYOUT_TOKENS]
        if unknown:
            raise ValueError(f"unknown parallel dimension(s) {unknown} in {token!r}")
        groups = generate_masked_orthogonal_rank_groups(
            self.world_size,
            [self.sizes[t] for t in self.order],
            [t in wanted for t in self.order],
        )
        return [[rank + self.rank_offset for rank in group] for group in groups]


# ----------------------------------------------------------------------------- initialization
