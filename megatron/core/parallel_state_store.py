"""The tables behind ``parallel_state``: this rank's process groups, their ranks and the overrides.

The bottom rung of the parallel-state modules. ``parallel_state`` fills these tables,
``parallel_state_ranks``, ``parallel_state_groups`` and ``utils`` read them, and this module
imports none of those (only torch), so the four import one another in one direction only.

The tables are changed in place and never rebound: every module holding a reference to one sees
the current state, before and after ``initialize_model_parallel`` / ``destroy_model_parallel``.
Callers use ``megatron.core.parallel_state``; the names here are the parallel-state modules' own.
"""

from __future__ import annotations

from typing import Optional

import torch

# This rank's groups and their global ranks, keyed by the names in GROUP_DESCRIPTIONS. An empty
# table means "not initialized".
GROUPS: dict[str, torch.distributed.ProcessGroup] = {}
GROUP_RANKS: dict[str, list[int]] = {}
# Every group of each layout key (not only this rank's), for groups built from the same ranks.
LAYOUT_RANKS: dict[str, list[list[int]]] = {}

# Values set through set_*(); they win over the groups. Keys: "tp", "pp", "dp", "ep", "expt-tp",
# "vpp", each with "_size" or "_rank".
OVERRIDES: dict[str, Optional[int]] = {}

GROUP_DESCRIPTIONS = {
    # dense layout
    "tp": "tensor model parallel",
    "cp": "context parallel",
    "dp": "data parallel",
    "dp-cp": "data parallel (with context parallel)",
    "pp": "pipeline model parallel",
    "mp": "model parallel",
    "tp-cp": "tensor and context parallel",
    "tp-dp": "tensor and data parallel",
    "tp-dp-cp": "tensor, data and context parallel",
    # expert layout
    "ep": "expert model parallel",
    "expt-tp": "expert tensor parallel",
    "expt-dp": "expert data parallel",
    "tp-ep": "expert tensor and model parallel",
    "tp-ep-pp": "expert tensor, model and pipeline parallel",
    # further groups (parallel_state_groups)
    "embd": "embedding",
    "pos-embd": "position embedding",
    "dp-gloo": "data parallel (gloo)",
    "dp-cp-gloo": "data parallel with context parallel (gloo)",
    "expt-dp-gloo": "expert data parallel (gloo)",
    "gtp": "GTP weight rematerialisation",
    "expt-gtp": "expert GTP weight rematerialisation",
}
"""Every group key, with the words a "not initialized" error uses for it."""

# Upstream's module-level group variables of parallel_state, mapped to (table, group key):
# parallel_state.__getattr__ answers reads of them from the tables through legacy_value.
LEGACY_GROUP_NAMES = {
    "_TENSOR_MODEL_PARALLEL_GROUP": ("group", "tp"),
    "_PIPELINE_MODEL_PARALLEL_GROUP": ("group", "pp"),
    "_MODEL_PARALLEL_GROUP": ("group", "mp"),
    "_DATA_PARALLEL_GROUP": ("group", "dp"),
    "_DATA_PARALLEL_GROUP_WITH_CP": ("group", "dp-cp"),
    "_DATA_PARALLEL_GROUP_GLOO": ("group", "dp-gloo"),
    "_DATA_PARALLEL_GROUP_WITH_CP_GLOO": ("group", "dp-cp-gloo"),
    "_CONTEXT_PARALLEL_GROUP": ("group", "cp"),
    "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": ("group", "tp-cp"),
    "_TENSOR_AND_DATA_PARALLEL_GROUP": ("group", "tp-dp"),
    "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": ("group", "tp-dp-cp"),
    "_EMBEDDING_GROUP": ("group", "embd"),
    "_POSITION_EMBEDDING_GROUP": ("group", "pos-embd"),
    "_EXPERT_MODEL_PARALLEL_GROUP": ("group", "ep"),
    "_EXPERT_TENSOR_PARALLEL_GROUP": ("group", "expt-tp"),
    "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": ("group", "tp-ep"),
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": ("group", "tp-ep-pp"),
    "_EXPERT_DATA_PARALLEL_GROUP": ("group", "expt-dp"),
    "_EXPERT_DATA_PARALLEL_GROUP_GLOO": ("group", "expt-dp-gloo"),
    "_GTP_WEIGHT_REMAT_GROUP": ("group", "gtp"),
    "_EXPERT_GTP_WEIGHT_REMAT_GROUP": ("group", "expt-gtp"),
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": ("ranks", "tp"),
    "_PIPELINE_GLOBAL_RANKS": ("ranks", "pp"),
    "_MODEL_PARALLEL_GLOBAL_RANKS": ("ranks", "mp"),
    "_DATA_PARALLEL_GLOBAL_RANKS": ("ranks", "dp"),
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": ("ranks", "dp-cp"),
    "_CONTEXT_PARALLEL_GLOBAL_RANKS": ("ranks", "cp"),
    "_EMBEDDING_GLOBAL_RANKS": ("ranks", "embd"),
    "_POSITION_EMBEDDING_GLOBAL_RANKS": ("ranks", "pos-embd"),
    "_GTP_WEIGHT_REMAT_GLOBAL_RANKS": ("ranks", "gtp"),
    "_EXPERT_GTP_WEIGHT_REMAT_GLOBAL_RANKS": ("ranks", "expt-gtp"),
}


def clear_groups() -> None:
    """Forgets every group and its ranks (the overrides stay)."""
    GROUPS.clear()
    GROUP_RANKS.clear()
    LAYOUT_RANKS.clear()


def is_initialized() -> bool:
    """Whether ``initialize_model_parallel`` has run (the data-parallel group exists)."""
    return "dp" in GROUPS


def _not_initialized(key: str) -> AssertionError:
    return AssertionError(
        f"{GROUP_DESCRIPTIONS[key]} group is not initialized; call "
        "parallel_state.initialize_model_parallel() first."
    )


def group_of(key: str, check_initialized: bool = True):
    """This rank's group ``key``, or None when it does not exist and ``check_initialized`` is off.

    Raises:
        AssertionError: The group does not exist and ``check_initialized`` is on (upstream's
            getters assert).
    """
    group = GROUPS.get(key)
    if group is None and check_initialized:
        raise _not_initialized(key)
    return group


def ranks_of(key: str, check_initialized: bool = True) -> Optional[list[int]]:
    """The global ranks of this rank's group ``key`` (None, or AssertionError, as
    :func:`group_of`)."""
    ranks = GROUP_RANKS.get(key)
    if ranks is None and check_initialized:
        raise _not_initialized(key)
    return ranks


def size_of(key: str, override: str) -> int:
    """The size of group ``key``: the ``override`` size if one is set, else the group's size, or 1
    without ``torch.distributed``."""
    value = OVERRIDES.get(override + "_size")
    if value is not None:
        return value
    if not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group=group_of(key))


def rank_in(key: str, override: str) -> int:
    """This rank's index in group ``key``: the ``override`` rank if one is set, else its rank in
    the group, or 0 without ``torch.distributed``."""
    value = OVERRIDES.get(override + "_rank")
    if value is not None:
        return value
    if not torch.distributed.is_initialized():
        return 0
    return torch.distributed.get_rank(group=group_of(key))


def legacy_value(name: str):
    """The current value of upstream's module-level variable ``name``, one of
    ``LEGACY_GROUP_NAMES`` (None when its group does not exist)."""
    table, key = LEGACY_GROUP_NAMES[name]
    return (GROUPS if table == "group" else GROUP_RANKS).get(key)
