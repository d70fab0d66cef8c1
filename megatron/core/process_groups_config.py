"""A bundle of process groups passed to a module instead of read from global state."""

from __future__ import annotations

from collections.abc import Iterator
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
    "embd": lambda: parallel_state.get_embedding_group(check_initialized=False),
    "pos_embd": lambda: parallel_state.get_position_embedding_group(check_initialized=False),
    "hcp": lambda: parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False),
    "inter_dist_opt": lambda: parallel_state.get_inter_distributed_optimizer_instance_group(
        check_initialized=False
    ),
    "intra_dist_opt": parallel_state.get_intra_distributed_optimizer_instance_group,
    # GTP is off: the "with GTP" variants are the plain groups, the GTP groups single ranks.
    "tp_ep_pp_with_egtp_remat": parallel_state.get_expert_tensor_model_pipeline_parallel_group,
    "dp_cp_gtp_remat": lambda: parallel_state.get_data_parallel_group(with_context_parallel=True),
    "expt_dp_gtp_remat": parallel_state.get_expert_data_parallel_group,
    "gtp_remat": lambda: parallel_state.get_gtp_weight_remat_group(check_initialized=False),
    "expt_gtp_remat": lambda: parallel_state.get_expert_gtp_weight_remat_group(
        check_initialized=False
    ),
    # The all-gather communicators exist only after create_all_gather_groups(), which returns
    # them for the caller to put here; use_mpu_process_groups leaves them unset, as upstream.
    "dp_cp_ag": lambda: None,
    "expt_dp_ag": lambda: None,
}

_ProcessGroup = Optional[torch.distributed.ProcessGroup]


class ProcessGroupHelperMeta(type):
    """Metaclass that refuses assigning ``virtual_pipeline_model_parallel_size`` on the class.

    The virtual pipeline size has a setter with side effects; a plain class attribute
    assignment would bypass it.
    """

    def __setattr__(cls, name, value):
        if name == "virtual_pipeline_model_parallel_size":
            raise AttributeError(
                f"Cannot set '{name}' directly. Use set_virtual_pipeline_model_parallel_size() "
                "method instead."
            )
        super().__setattr__(name, value)


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
        embd: Embedding group (first and last pipeline stage).
        pos_embd: Position-embedding group (first pipeline stage).
        cp: Context-parallel group.
        tp_cp: Tensor x context-parallel group.
        hcp: Hierarchical context-parallel groups (not built by this fork's parallel_state).
        ep: Expert-model-parallel group.
        expt_tp: Expert-tensor-parallel group.
        tp_ep: Expert-tensor x expert-model-parallel group.
        tp_ep_pp: Expert-tensor x expert-model x pipeline-parallel group.
        tp_ep_pp_with_egtp_remat: The same with the expert GTP peers (the same group here).
        tp_dp: Tensor x data-parallel group.
        tp_dp_cp: Tensor x data x context-parallel group.
        dp: Data-parallel group.
        dp_cp: Data x context-parallel group.
        dp_cp_gtp_remat: The same with the GTP peers (the same group here).
        dp_cp_ag: A second data x context-parallel communicator for all-gathers
            (``parallel_state.create_all_gather_groups``).
        gtp_remat: GTP weight-rematerialisation group (a single rank here).
        expt_gtp_remat: Expert GTP weight-rematerialisation group (a single rank here).
        expt_dp: Expert-data-parallel group.
        expt_dp_gtp_remat: The same with the expert GTP peers (the same group here).
        expt_dp_ag: A second expert-data-parallel communicator for all-gathers.
        intra_dp_cp: Data x context-parallel group of one distributed-optimizer instance.
        intra_expt_dp: Expert-data-parallel group of one distributed-optimizer instance.
        inter_dist_opt: Group across distributed-optimizer instances (not built here).
        intra_dist_opt: Group of one distributed-optimizer instance.
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
    tp_ep_pp_with_egtp_remat: _ProcessGroup
    tp_dp: _ProcessGroup
    tp_dp_cp: _ProcessGroup
    dp: _ProcessGroup
    dp_cp: _ProcessGroup
    dp_cp_gtp_remat: _ProcessGroup
    dp_cp_ag: _ProcessGroup
    gtp_remat: _ProcessGroup
    expt_gtp_remat: _ProcessGroup
    expt_dp: _ProcessGroup
    expt_dp_gtp_remat: _ProcessGroup
    expt_dp_ag: _ProcessGroup
    intra_dp_cp: _ProcessGroup
    intra_expt_dp: _ProcessGroup
    inter_dist_opt: _ProcessGroup
    intra_dist_opt: _ProcessGroup

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
            ValueError: A requested name is unknown.
            AssertionError: ``parallel_state`` is not initialized.
        """
        names = list(_MPU_GETTERS) if required_pgs is None else list(required_pgs)
        valid = {f.name for f in fields(cls)}
        invalid = [name for name in names if name not in valid]
        if invalid:
            # Upstream's phrase first: callers match on it.
            raise ValueError(
                f"Invalid process groups requested: {invalid}; valid names: {sorted(valid)}"
            )
        return cls(**{name: _MPU_GETTERS[name]() for name in names})


def resolve_gtp_remat_group(
    pg_collection: Optional[ProcessGroupCollection], is_expert: bool
) -> _ProcessGroup:
    """The GTP weight-rematerialisation group a weight-owning module should use.

    A collection that carries the group (set on it, even to a custom group or None) decides;
    otherwise, and without a collection, the group comes from the global ``parallel_state``.

    Args:
        pg_collection: The caller's collection, or None.
        is_expert: Use the expert axis (``expt_gtp_remat``) instead of the dense one.
    """
    name = "expt_gtp_remat" if is_expert else "gtp_remat"
    # vars(), not hasattr(): unset declared groups read as None, so hasattr is always True.
    if pg_collection is not None and name in vars(pg_collection):
        return getattr(pg_collection, name)
    return _MPU_GETTERS[name]()


@dataclass
class MultiModuleProcessGroupCollection:
    """The process groups of each module a rank runs (e.g. a vision encoder next to an LLM).

    Behaves like a read-only mapping from module name to ``ProcessGroupCollection``.

    Attributes:
        module_pgs: ``{module name: ProcessGroupCollection}``; not empty.
        language_model_module_name: The key of the language model, or None when this rank
            runs none.

    Raises:
        ValueError: ``module_pgs`` is empty, or the language model name is not one of its keys.
    """

    module_pgs: dict[str, ProcessGroupCollection]
    language_model_module_name: Optional[str] = None

    def __post_init__(self):
        if not self.module_pgs:
            raise ValueError("module_pgs dict cannot be empty")
        name = self.language_model_module_name
        if name is not None and name not in self.module_pgs:
            raise ValueError(
                f"language_model_module_name '{name}' not found in module_pgs keys: "
                f"{list(self.module_pgs)}"
            )

    def get_language_model_collection(self) -> ProcessGroupCollection:
        """The language model's collection.

        Raises:
            ValueError: No language model is named.
        """
        if self.language_model_module_name is None:
            raise ValueError("No language model specified for this collection")
        return self.module_pgs[self.language_model_module_name]

    def get_language_model_cp_size(self) -> int:
        """The language model's context-parallel size (ValueError without a language model)."""
        return self.get_language_model_collection().cp.size()

    def has_language_model(self) -> bool:
        """Whether this rank runs a language model."""
        return self.language_model_module_name is not None

    def get_module_collection(self, module_name: str) -> ProcessGroupCollection:
        """The collection of ``module_name``.

        Raises:
            ValueError: No module of that name.
        """
        if module_name not in self.module_pgs:
            raise ValueError(
                f"Module '{module_name}' not found in collections. "
                f"Available: {list(self.module_pgs)}"
            )
        return self.module_pgs[module_name]

    def __len__(self) -> int:
        return len(self.module_pgs)

    def __getitem__(self, module_name: str) -> ProcessGroupCollection:
        return self.module_pgs[module_name]

    def __iter__(self) -> Iterator[ProcessGroupCollection]:
        # Iterates the collections (not the names), as upstream.
        return iter(self.module_pgs.values())

    def keys(self):
        """The module names."""
        return self.module_pgs.keys()

    def values(self):
        """The collections."""
        return self.module_pgs.values()

    def items(self):
        """``(module name, collection)`` pairs."""
        return self.module_pgs.items()

    def __repr__(self) -> str:
        modules = ", ".join(self.module_pgs)
        lm = self.language_model_module_name
        lm_part = f", language_model_module_name='{lm}'" if lm else ""
        return f"MultiModuleProcessGroupCollection(modules=[{modules}]{lm_part})"
