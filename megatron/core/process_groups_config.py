"""A bundle of process groups passed to a module instead of read from global state."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

from megatron.core import parallel_state

# Field name -> getter of the group that parallel_state builds for it.
_MPU_GETTERS = {
    "tp": parallel_state.get_tensor_model_parallel_group,
    "pp": parallel_state.get_pipeline_model_parallel_group,
    "mp": parallel_state.get_model_parallel_group,
    "cp": parallel_state.get_context_parallel_group,
    "tp_cp": parallel_state.get_tensor_and_context_parallel_group,
    "ep": parallel_state.get_expert_model_parallel_group,
    "expt_tp": parallel_state.get_expert_tensor_parallel_group,
    "tp_ep": parallel_state.get_expert_tensor_and_model_parallel_group,
    "tp_ep_pp": parallel_state.get_expert_tensor_model_pipeline_parallel_group,
    "expt_dp": parallel_state.get_expert_data_parallel_group,
    "dp": parallel_state.get_data_parallel_group,
    "dp_cp": lambda: parallel_state.get_data_parallel_group(with_context_parallel=True),
    "tp_dp": lambda: parallel_state.get_tensor_and_data_parallel_group(),
    "tp_dp_cp": lambda: parallel_state.get_tensor_and_data_parallel_group(
        with_context_parallel=True
    ),
    # One distributed-optimizer instance: the "intra" groups are the whole data-parallel groups.
    "intra_dp_cp": lambda: parallel_state.get_data_parallel_group(with_context_parallel=True),
    "intra_expt_dp": parallel_state.get_expert_data_parallel_group,
}

_ProcessGroup = Optional[torch.distributed.ProcessGroup]


@dataclass(init=False, repr=False, eq=False)
class ProcessGroupCollection:
    """The process groups a module communicates over.

    A declared group that was not given reads as None (as upstream's); ``"tp" in
    vars(pg_collection)`` tells whether it was given. Reading a name that is not a declared group
    raises ``AttributeError``.
    Modules take ``tp_group`` / ``pg_collection`` arguments so that several models with
    different layouts can live in one process; ``use_mpu_process_groups`` fills a collection
    from the global ``parallel_state`` for the common single-model case.

    Attributes:
        tp: Tensor-model-parallel group.
        pp: Pipeline-model-parallel group.
        mp: Model-parallel (tensor x pipeline) group.
        embd: Embedding group (not built by this fork's parallel_state).
        pos_embd: Position-embedding group (not built by this fork's parallel_state).
        cp: Context-parallel group.
        tp_cp: Tensor x context-parallel group.
        hcp: Hierarchical context-parallel groups (not built by this fork's parallel_state).
        ep: Expert-model-parallel group.
        expt_tp: Expert-tensor-parallel group.
        tp_ep: Expert-tensor x expert-model-parallel group.
        tp_ep_pp: Expert-tensor x expert-model x pipeline-parallel group.
        tp_dp: Tensor x data-parallel group.
        tp_dp_cp: Tensor x data x context-parallel group.
        dp: Data-parallel group.
        dp_cp: Data x context-parallel group.
        expt_dp: Expert-data-parallel group.
        intra_dp_cp: Data x context-parallel group of one distributed-optimizer instance.
        intra_expt_dp: Expert-data-parallel group of one distributed-optimizer instance.
        inter_dist_opt: Group across distributed-optimizer instances (not built here).
    """

    tp: _ProcessGroup
    pp: _ProcessGroup
    mp: _ProcessGroup
    embd: _ProcessGroup
    pos_embd: _ProcessGroup
    cp: _ProcessGroup
    tp_cp: _ProcessGroup
    hcp: Optional[list[torch.distributed.ProcessGroup]]
    ep: _ProcessGroup
    expt_tp: _ProcessGroup
    tp_ep: _ProcessGroup
    tp_ep_pp: _ProcessGroup
    tp_dp: _ProcessGroup
    tp_dp_cp: _ProcessGroup
    dp: _ProcessGroup
    dp_cp: _ProcessGroup
    expt_dp: _ProcessGroup
    intra_dp_cp: _ProcessGroup
    intra_expt_dp: _ProcessGroup
    inter_dist_opt: _ProcessGroup

    def __init__(self, **groups):
        valid = {f.name for f in fields(self)}
        unknown = sorted(set(groups) - valid)
        if unknown:
            raise ValueError(
                f"unknown process group name(s) {unknown}; valid names: {sorted(valid)}"
            )
        for name, group in groups.items():
            setattr(self, name, group)

    def __getattr__(self, name: str):
        # Only called for names not set on the instance: a declared group left unset is None.
        if name in {f.name for f in fields(type(self))}:
            return None
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __repr__(self) -> str:
        """The groups that are set, each with its size, e.g. ``ProcessGroupCollection(tp(2))``."""
        shown = []
        for f in fields(self):
            group = self.__dict__.get(f.name)
            if group is None:
                continue
            if isinstance(group, list):
                shown.append(f"{f.name}({[g.size() for g in group]})")
            else:
                shown.append(f"{f.name}({group.size()})")
        return f"{type(self).__name__}({', '.join(shown) if shown else 'empty'})"

    @classmethod
    def use_mpu_process_groups(cls, required_pgs: Optional[list[str]] = None):
        """Collects groups from the global ``parallel_state``.

        Args:
            required_pgs: Names of the groups to collect; None collects every group that
                ``parallel_state`` builds.

        Returns:
            A ``ProcessGroupCollection`` holding the requested groups.

        Raises:
            ValueError: A requested name is unknown or not built by ``parallel_state``.
            AssertionError: ``parallel_state`` is not initialized.
        """
        names = list(_MPU_GETTERS) if required_pgs is None else list(required_pgs)
        valid = {f.name for f in fields(cls)}
        for name in names:
            if name not in valid:
                raise ValueError(f"unknown process group {name!r}; valid names: {sorted(valid)}")
            if name not in _MPU_GETTERS:
                raise ValueError(
                    f"process group {name!r} is not built by this fork's parallel_state; "
                    f"available: {sorted(_MPU_GETTERS)}"
                )
        return cls(**{name: _MPU_GETTERS[name]() for name in names})
