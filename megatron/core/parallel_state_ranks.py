"""Sizes and ranks of this rank's parallel groups, pipeline stages, and the ``set_*`` overrides.

``megatron.core.parallel_state`` re-exports every name here (see ``__all__``); callers use them
from there, as upstream's code does. They read the tables of ``parallel_state_store`` only, so
``parallel_state_groups`` and ``utils`` can ask "which rank am I" without importing
``parallel_state`` (which builds the groups and imports them both).

Without ``torch.distributed`` a size is 1 and a rank 0; with it, the group must exist (an
``AssertionError`` names it otherwise) unless a ``set_*`` override fixes the value: overrides win
over the groups, for code that must run outside a distributed job (tests, conversion tools).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

from megatron.core.parallel_state_store import OVERRIDES, rank_in, ranks_of, size_of

__all__ = [
    "get_tensor_model_parallel_world_size",
    "get_tensor_model_parallel_rank",
    "get_pipeline_model_parallel_world_size",
    "get_pipeline_model_parallel_rank",
    "get_data_parallel_world_size",
    "get_data_parallel_rank",
    "get_context_parallel_world_size",
    "get_context_parallel_rank",
    "get_tensor_and_context_parallel_world_size",
    "get_tensor_and_context_parallel_rank",
    "get_expert_model_parallel_world_size",
    "get_expert_model_parallel_rank",
    "get_expert_tensor_parallel_world_size",
    "get_expert_tensor_parallel_rank",
    "get_expert_tensor_and_model_parallel_world_size",
    "get_expert_tensor_and_model_parallel_rank",
    "get_expert_data_parallel_world_size",
    "get_expert_data_parallel_rank",
    "get_virtual_pipeline_model_parallel_world_size",
    "get_virtual_pipeline_model_parallel_rank",
    "get_tensor_model_parallel_src_rank",
    "get_data_parallel_src_rank",
    "get_pipeline_model_parallel_first_rank",
    "get_pipeline_model_parallel_last_rank",
    "get_pipeline_model_parallel_next_rank",
    "get_pipeline_model_parallel_prev_rank",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "set_tensor_model_parallel_world_size",
    "set_tensor_model_parallel_rank",
    "set_pipeline_model_parallel_world_size",
    "set_pipeline_model_parallel_rank",
    "set_data_parallel_rank",
    "set_expert_model_parallel_world_size",
    "set_expert_model_parallel_rank",
    "set_expert_tensor_parallel_world_size",
    "set_expert_tensor_parallel_rank",
    "set_virtual_pipeline_model_parallel_world_size",
    "set_virtual_pipeline_model_parallel_rank",
]


# ------------------------------------------------------------------------ sizes and ranks


def get_tensor_model_parallel_world_size() -> int:
    """Returns the tensor-parallel size (the override, if set)."""
    return size_of("tp", "tp")


def get_tensor_model_parallel_rank() -> int:
    """Returns this rank's index in its tensor-parallel group (the override, if set)."""
    return rank_in("tp", "tp")


def get_pipeline_model_parallel_world_size() -> int:
    """Returns the number of pipeline stages (the override, if set)."""
    return size_of("pp", "pp")


def get_pipeline_model_parallel_rank() -> int:
    """Returns this rank's pipeline stage (the override, if set)."""
    return rank_in("pp", "pp")


def get_data_parallel_world_size(
    with_context_parallel: bool = False,
    with_gtp_remat: bool = True,
    partial_data_parallel: bool = False,
) -> int:
    """Returns the data-parallel size (the override, if set)."""
    return size_of("dp-cp" if with_context_parallel else "dp", "dp")


def get_data_parallel_rank(
    with_context_parallel: bool = False,
    with_gtp_remat: bool = True,
    partial_data_parallel: bool = False,
) -> int:
    """Returns this rank's index in its data-parallel group (the override, if set)."""
    return rank_in("dp-cp" if with_context_parallel else "dp", "dp")


def get_context_parallel_world_size() -> int:
    """Returns the context-parallel size."""
    return size_of("cp", "cp")


def get_context_parallel_rank() -> int:
    """Returns this rank's index in its context-parallel group."""
    return rank_in("cp", "cp")


def get_tensor_and_context_parallel_world_size() -> int:
    """Returns the tensor x context-parallel size."""
    return size_of("tp-cp", "tp-cp")


def get_tensor_and_context_parallel_rank() -> int:
    """Returns this rank's index in its tensor x context-parallel group."""
    return rank_in("tp-cp", "tp-cp")


def get_expert_model_parallel_world_size() -> int:
    """Returns the expert-model-parallel size (the override, if set)."""
    return size_of("ep", "ep")


def get_expert_model_parallel_rank() -> int:
    """Returns this rank's index in its expert-model-parallel group (the override, if set)."""
    return rank_in("ep", "ep")


def get_expert_tensor_parallel_world_size() -> int:
    """Returns the expert-tensor-parallel size (the override, if set)."""
    return size_of("expt-tp", "expt-tp")


def get_expert_tensor_parallel_rank() -> int:
    """Returns this rank's index in its expert-tensor-parallel group (the override, if set)."""
    return rank_in("expt-tp", "expt-tp")


def get_expert_tensor_and_model_parallel_world_size() -> int:
    """Returns the expert-tensor x expert-model-parallel size."""
    return size_of("tp-ep", "tp-ep")


def get_expert_tensor_and_model_parallel_rank() -> int:
    """Returns this rank's index in its expert-tensor x expert-model-parallel group."""
    return rank_in("tp-ep", "tp-ep")


def get_expert_data_parallel_world_size(
    with_gtp_remat: bool = True, partial_expert_data_parallel: bool = False
) -> int:
    """Returns the expert-data-parallel size."""
    return size_of("expt-dp", "expt-dp")


def get_expert_data_parallel_rank(
    with_gtp_remat: bool = True, partial_expert_data_parallel: bool = False
) -> int:
    """Returns this rank's index in its expert-data-parallel group."""
    return rank_in("expt-dp", "expt-dp")


def get_virtual_pipeline_model_parallel_world_size() -> Optional[int]:
    """Returns the number of virtual pipeline chunks per stage, or None without interleaving."""
    return OVERRIDES.get("vpp_size")


def get_virtual_pipeline_model_parallel_rank() -> Optional[int]:
    """Returns the current virtual pipeline chunk, or None without interleaving."""
    return OVERRIDES.get("vpp_rank")


# ------------------------------------------------------------------------- source ranks


def get_tensor_model_parallel_src_rank() -> int:
    """Returns the global rank of the first rank of this rank's tensor-parallel group."""
    return ranks_of("tp")[0]


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    """Returns the global rank of the first rank of this rank's data-parallel group."""
    return ranks_of("dp-cp" if with_context_parallel else "dp")[0]


def get_pipeline_model_parallel_first_rank() -> int:
    """Returns the global rank of the first stage of this rank's pipeline."""
    return ranks_of("pp")[0]


def get_pipeline_model_parallel_last_rank() -> int:
    """Returns the global rank of the last stage of this rank's pipeline."""
    return ranks_of("pp")[-1]


def get_pipeline_model_parallel_next_rank() -> int:
    """Returns the global rank of the next stage (wrapping around)."""
    ranks = ranks_of("pp")
    return ranks[(get_pipeline_model_parallel_rank() + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    """Returns the global rank of the previous stage (wrapping around)."""
    ranks = ranks_of("pp")
    return ranks[(get_pipeline_model_parallel_rank() - 1) % len(ranks)]


def _virtual_stage(vp_stage: Optional[int]) -> Optional[int]:
    if get_virtual_pipeline_model_parallel_world_size() is None:
        return None
    return vp_stage if vp_stage is not None else get_virtual_pipeline_model_parallel_rank()


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    """Whether this rank runs the first pipeline stage (and, unless ``ignore_virtual``, the
    first virtual chunk: ``vp_stage``, or the current virtual rank)."""
    if not ignore_virtual and _virtual_stage(vp_stage) not in (None, 0):
        return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    """Whether this rank runs the last pipeline stage (and, unless ``ignore_virtual``, the last
    virtual chunk: ``vp_stage``, or the current virtual rank)."""
    if not ignore_virtual:
        stage = _virtual_stage(vp_stage)
        if stage is not None and stage != get_virtual_pipeline_model_parallel_world_size() - 1:
            return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


# ------------------------------------------------------------------------------ overrides


def _size_setter(key: str, what: str) -> Callable[[Optional[int]], None]:
    def setter(world_size: Optional[int]) -> None:
        OVERRIDES[key] = world_size

    setter.__doc__ = f"Overrides the {what} size reported by the getters (None removes it)."
    return setter


def _rank_setter(key: str, what: str) -> Callable[[Optional[int]], None]:
    def setter(rank: Optional[int]) -> None:
        OVERRIDES[key] = rank

    setter.__doc__ = f"Overrides the {what} rank reported by the getters (None removes it)."
    return setter


# Each setter only fixes a value in OVERRIDES; made by the two factories above because they
# differ in the key alone.
set_tensor_model_parallel_world_size = _size_setter("tp_size", "tensor-parallel")
set_tensor_model_parallel_rank = _rank_setter("tp_rank", "tensor-parallel")
set_pipeline_model_parallel_world_size = _size_setter("pp_size", "pipeline-parallel")
set_pipeline_model_parallel_rank = _rank_setter("pp_rank", "pipeline-parallel")
set_data_parallel_rank = _rank_setter("dp_rank", "data-parallel")
set_expert_model_parallel_world_size = _size_setter("ep_size", "expert-model-parallel")
set_expert_model_parallel_rank = _rank_setter("ep_rank", "expert-model-parallel")
set_expert_tensor_parallel_world_size = _size_setter("expt-tp_size", "expert-tensor-parallel")
set_expert_tensor_parallel_rank = _rank_setter("expt-tp_rank", "expert-tensor-parallel")
set_virtual_pipeline_model_parallel_world_size = _size_setter("vpp_size", "virtual pipeline")
set_virtual_pipeline_model_parallel_rank = _rank_setter("vpp_rank", "virtual pipeline")
