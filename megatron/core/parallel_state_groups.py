"""The further process groups of ``parallel_state``: embedding, gloo, GTP, helpers and NCCL options.

``megatron.core.parallel_state`` re-exports every public name here, so callers use them from
there as upstream's code does. Kept in its own module so that neither file grows past a
readable size. The groups live in the tables of ``parallel_state_store``; this module reads them
and the ranks of ``parallel_state_ranks``, and never imports ``parallel_state`` (which calls
:func:`build_further_groups` from ``initialize_model_parallel``).

What this fork builds, as upstream does:

- the **embedding** groups (first and last pipeline stage of each pipeline group, or the ranks a
  ``get_embedding_ranks`` callback returns) and **position-embedding** groups (first stage);
- **gloo** copies of the data-parallel, data x context-parallel and expert-data-parallel groups
  (``create_gloo_process_groups=True``), for CPU-side collectives such as checkpoint metadata;
- the GTP weight-rematerialisation groups, which are single ranks: this fork supports
  ``gtp_remat_size == expert_gtp_remat_size == 1`` only.

Hierarchical context parallelism, hybrid data x context groups and several distributed-optimizer
instances are refused by ``initialize_model_parallel``; their getters report "not initialized"
as upstream's do when those options are off.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Optional

import torch

from megatron.core.parallel_state_ranks import (
    get_context_parallel_rank,
    get_data_parallel_rank,
    get_data_parallel_world_size,
    get_expert_model_parallel_rank,
    get_pipeline_model_parallel_rank,
    get_tensor_model_parallel_rank,
    is_pipeline_first_stage,
    is_pipeline_last_stage,
)
from megatron.core.parallel_state_store import (
    GROUP_RANKS,
    GROUPS,
    LAYOUT_RANKS,
    group_of,
    is_initialized,
    ranks_of,
)

logger = logging.getLogger(__name__)

__all__ = [
    "get_all_ranks",
    "get_expert_model_parallel_src_rank",
    "get_intra_distributed_optimizer_instance_group",
    "get_model_parallel_src_rank",
    "create_all_gather_groups",
    "create_group",
    "create_hierarchical_groups",
    "create_hybrid_dp_cp_groups",
    "default_embedding_ranks",
    "default_position_embedding_ranks",
    "get_data_parallel_group_gloo",
    "get_embedding_group",
    "get_expert_data_parallel_group_gloo",
    "get_expert_gtp_weight_remat_global_ranks",
    "get_expert_gtp_weight_remat_group",
    "get_expert_gtp_weight_remat_rank",
    "get_expert_gtp_weight_remat_world_size",
    "get_gtp_weight_remat_global_ranks",
    "get_gtp_weight_remat_group",
    "get_gtp_weight_remat_rank",
    "get_gtp_weight_remat_world_size",
    "get_hierarchical_context_parallel_groups",
    "get_hybrid_data_context_parallel_groups",
    "get_inter_distributed_optimizer_instance_group",
    "get_nccl_options",
    "get_position_embedding_group",
    "is_rank_in_embedding_group",
    "is_rank_in_position_embedding_group",
    "logger",
    "overwrite_nccl_comm_cfgs",
    "update_pg_timeout",
]

# Every group created through create_group on this rank since the last destroy_model_parallel,
# for update_pg_timeout(pg=None).
_CREATED_GROUPS: list = []


def forget_created_groups() -> None:
    """Drops this module's references to the groups :func:`create_group` made.

    ``destroy_model_parallel`` calls it, as upstream clears its list of groups there: otherwise
    every initialize / destroy cycle would keep its groups (and a gloo group's threads) alive
    for the rest of the process, whatever the caller destroys.
    """
    _CREATED_GROUPS.clear()


# --------------------------------------------------------------------------- group helpers


def create_group(
    ranks: Optional[Sequence[int]] = None,
    timeout: Optional[timedelta] = None,
    backend: Optional[str] = None,
    pg_options=None,
    use_local_synchronization: bool = False,
    group_desc: Optional[str] = None,
):
    """``torch.distributed.new_group`` that remembers the group for :func:`update_pg_timeout`.

    Args:
        ranks: Global ranks of the group (None: every rank).
        timeout: Timeout of its collectives (None: the backend's default).
        backend: Its backend (None: the default group's).
        pg_options: Backend options, e.g. from :func:`get_nccl_options`.
        use_local_synchronization: Only the members take part in creating it.
        group_desc: A name for debugging output.

    Returns:
        The new process group (a non-member rank gets the non-member placeholder).
    """
    group = torch.distributed.new_group(
        ranks=None if ranks is None else list(ranks),
        timeout=timeout,
        backend=backend,
        pg_options=pg_options,
        use_local_synchronization=use_local_synchronization,
        group_desc=group_desc,
    )
    if ranks is None or torch.distributed.get_rank() in ranks:
        _CREATED_GROUPS.append(group)
    return group


def update_pg_timeout(timeout: timedelta, pg=None) -> None:
    """Sets the collective timeout of ``pg``, or of every group this rank created and the default.

    The group(s) are synchronized first (a barrier), so no collective is in flight.

    Args:
        timeout: The new timeout.
        pg: One process group; None updates the default group and every group created by
            ``initialize_model_parallel`` / :func:`create_group` that this rank belongs to.
    """
    set_timeout = getattr(torch.distributed.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:
        logger.warning("update_pg_timeout: this torch cannot change a process group's timeout.")
        return
    torch.distributed.barrier(pg)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if pg is not None:
        set_timeout(timeout, pg)
        return
    groups = [None, *GROUPS.values(), *_CREATED_GROUPS]
    seen = set()
    for group in groups:
        if id(group) in seen:
            continue
        seen.add(id(group))
        set_timeout(timeout, group)


def get_nccl_options(pg_name: str, nccl_comm_cfgs: dict):
    """NCCL communicator options of the group named ``pg_name``, or None for NCCL's defaults.

    Args:
        pg_name: The group's name in the config (e.g. ``"dp"``, ``"tp"``, ``"embd"``).
        nccl_comm_cfgs: ``{group name: {option: value}}``; the options read are
            ``is_high_priority_stream``, ``cga_cluster_size``, ``max_ctas``, ``min_ctas`` and
            ``net_name`` ("IB" or "socket").

    Raises:
        RuntimeError: ``net_name`` is neither "IB" nor "socket".
    """
    if pg_name not in nccl_comm_cfgs:
        return None
    cfg = nccl_comm_cfgs[pg_name]
    options = torch.distributed.ProcessGroupNCCL.Options(
        is_high_priority_stream=cfg.get("is_high_priority_stream", False)
    )
    for key in ("cga_cluster_size", "max_ctas", "min_ctas", "net_name"):
        if key in cfg:
            setattr(options.config, key, cfg[key])
    if "net_name" in cfg and str(cfg["net_name"]).lower() not in ("ib", "socket"):
        raise RuntimeError(
            f"net_name ({cfg['net_name']}) is not supported. Accepted values: 'IB' or 'socket'."
        )
    return options


def overwrite_nccl_comm_cfgs(nccl_comm_cfgs: dict, pg_name: str, key_value_pair) -> None:
    """Sets ``nccl_comm_cfgs[pg_name][key] = value`` for ``key_value_pair = (key, value)``."""
    key, value = key_value_pair
    nccl_comm_cfgs.setdefault(pg_name, {})[key] = value


def default_embedding_ranks(pp_ranks: Sequence[int]) -> list[int]:
    """The ranks sharing word embeddings: the first and last pipeline stage (one with one stage)."""
    if len(pp_ranks) == 1:
        return [pp_ranks[0]]
    return [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(pp_ranks: Sequence[int]) -> list[int]:
    """The ranks holding position embeddings: the first pipeline stage."""
    return [pp_ranks[0]]


def create_hierarchical_groups(
    rank: int,
    ranks: Sequence[int],
    hierarchical_group_sizes: Sequence[int],
    create_gloo_process_groups: bool = False,
    pg_options=None,
    timeout: Optional[timedelta] = None,
    group_desc: Optional[str] = None,
):
    """Splits ``ranks`` into nested levels of sub-groups and returns this rank's group per level.

    Level ``i`` groups ``hierarchical_group_sizes[i]`` ranks that are
    ``prod(hierarchical_group_sizes[:i])`` apart. For 16 ranks and sizes ``[2, 2, 4]``: level 0
    is ``[0, 1], [2, 3], ...``, level 1 is ``[0, 2], [1, 3], [4, 6], ...``, level 2 is
    ``[0, 4, 8, 12], [1, 5, 9, 13], ...`` (positions in ``ranks``).

    Args:
        rank: This rank's global rank.
        ranks: The ranks to split; their count must be the product of the sizes.
        hierarchical_group_sizes: Group size of each level, innermost first.
        create_gloo_process_groups: Also create a gloo group per sub-group.
        pg_options: Options for every level, or a list with one entry per level.
        timeout: Collective timeout of the new groups.
        group_desc: A name for debugging output.

    Returns:
        ``(groups, gloo_groups)``: this rank's group at each level (gloo ones None unless asked).

    Raises:
        ValueError: The product of the sizes is not the number of ranks.
    """
    ranks = list(ranks)
    sizes = list(hierarchical_group_sizes)
    if math.prod(sizes) != len(ranks):
        raise ValueError(
            f"hierarchical_group_sizes {sizes} multiply to {math.prod(sizes)}, not the "
            f"{len(ranks)} ranks to split."
        )
    options = pg_options if isinstance(pg_options, list) else [pg_options] * len(sizes)
    groups, gloo_groups = [], []
    for level, size in enumerate(sizes):
        inner = math.prod(sizes[:level])  # distance between members of a level-`level` group
        block = inner * size  # one block holds `inner` groups of this level
        mine, mine_gloo = None, None
        for start in range(0, len(ranks), block):
            for offset in range(inner):
                members = [ranks[start + offset + k * inner] for k in range(size)]
                group = create_group(
                    members,
                    timeout=timeout,
                    pg_options=options[level],
                    group_desc=f"HIERARCHICAL_{group_desc}_L{level}",
                )
                gloo = None
                if create_gloo_process_groups:
                    gloo = create_group(
                        members,
                        timeout=timeout,
                        backend="gloo",
                        group_desc=f"HIERARCHICAL_{group_desc}_GLOO_L{level}",
                    )
                if rank in members:
                    mine, mine_gloo = group, gloo
        groups.append(mine)
        gloo_groups.append(mine_gloo)
    return groups, gloo_groups


def create_hybrid_dp_cp_groups(rank: int, ranks: Sequence[int], pg_options) -> dict:
    """Creates groups of consecutive ``ranks`` for every power-of-two size from 2 up to half.

    Args:
        rank: This rank's global rank.
        ranks: The data x context-parallel ranks.
        pg_options: Backend options of the new groups.

    Returns:
        ``{size: this rank's group of that size}``.
    """
    ranks = list(ranks)
    groups = {}
    size = 2
    while size < len(ranks):
        for start in range(0, len(ranks), size):
            members = ranks[start : start + size]
            group = create_group(
                members, pg_options=pg_options, group_desc=f"HYBRID_DP_CP_GROUP_{size}"
            )
            if rank in members:
                groups[size] = group
        size *= 2
    return groups


def create_all_gather_groups(
    for_expert_parallelism: bool = False, timeout: Optional[timedelta] = None, nccl_comm_cfgs=None
):
    """Creates second communicators over the data x context-parallel (and expert-data-parallel)
    ranks, so that all-gathers can overlap reduce-scatters on the original groups.

    Args:
        for_expert_parallelism: Also create one over the expert-data-parallel ranks.
        timeout: Collective timeout of the new groups.
        nccl_comm_cfgs: NCCL options by group name (``"dp_cp"``, ``"expt_dp"``).

    Returns:
        ``(dp_cp_ag_group, expt_dp_ag_group)``; the second is None unless asked for.

    Raises:
        RuntimeError: ``initialize_model_parallel`` has not run.
    """
    if not is_initialized():
        raise RuntimeError(
            "create_all_gather_groups() requires parallel state to be initialized. "
            "Call initialize_model_parallel() first."
        )
    cfgs = nccl_comm_cfgs or {}
    rank = torch.distributed.get_rank()

    def rebuild(key: str, cfg_name: str):
        # Every rank must create every group in the same order: walk all groups of the layout.
        mine = None
        for members in LAYOUT_RANKS[key]:
            group = create_group(
                members,
                timeout=timeout,
                pg_options=get_nccl_options(cfg_name, cfgs),
                group_desc=f"{cfg_name.upper()}_AG_GROUP",
            )
            if rank in members:
                mine = group
        return mine

    dp_cp_ag = rebuild("dp-cp", "dp_cp")
    expt_dp_ag = rebuild("expt-dp", "expt_dp") if for_expert_parallelism else None
    return dp_cp_ag, expt_dp_ag


# ---------------------------------------------------------------- building the further groups


def build_further_groups(
    rank: int,
    timeout: timedelta,
    create_gloo_process_groups: bool,
    get_embedding_ranks: Optional[Callable[[list[int]], list[int]]],
    get_position_embedding_ranks: Optional[Callable[[list[int]], list[int]]],
) -> None:
    """Creates the embedding, gloo and GTP groups (called by ``initialize_model_parallel``)."""
    embedding_ranks = get_embedding_ranks or default_embedding_ranks
    position_ranks = get_position_embedding_ranks or default_position_embedding_ranks

    def keep(key: str, members: list[int], group) -> None:
        if rank in members:
            GROUPS[key] = group
            GROUP_RANKS[key] = members

    for pp_ranks in LAYOUT_RANKS["pp"]:
        for key, choose, name in (
            ("embd", embedding_ranks, "EMBEDDING_GROUP"),
            ("pos-embd", position_ranks, "POSITION_EMBEDDING_GROUP"),
        ):
            members = list(choose(list(pp_ranks)))
            keep(key, members, create_group(members, timeout=timeout, group_desc=name))

    if create_gloo_process_groups:
        for key, source in (
            ("dp-gloo", "dp"),
            ("dp-cp-gloo", "dp-cp"),
            ("expt-dp-gloo", "expt-dp"),
        ):
            for members in LAYOUT_RANKS[source]:
                group = create_group(
                    members, timeout=timeout, backend="gloo", group_desc=key.upper()
                )
                keep(key, list(members), group)

    # GTP is off (size 1): each rank is its own rematerialisation group. Only the member takes
    # part in creating a one-rank group, so this costs no collective across the world.
    for key in ("gtp", "expt-gtp"):
        group = create_group(
            [rank], timeout=timeout, use_local_synchronization=True, group_desc=key.upper()
        )
        keep(key, [rank], group)


# ---------------------------------------------------------------------------------- getters


def get_embedding_group(check_initialized: bool = True):
    """The group of ranks that share the word embeddings (first and last pipeline stage)."""
    return group_of("embd", check_initialized)


def get_position_embedding_group(check_initialized: bool = True):
    """The group of ranks that hold the position embeddings (first pipeline stage)."""
    return group_of("pos-embd", check_initialized)


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    """Whether this rank holds a copy of the word embeddings.

    With ``ignore_virtual=False`` a rank at both ends of the pipeline counts only for the
    virtual stage that holds the embedding (the first or last).
    """
    ranks = GROUP_RANKS.get("embd")
    rank = torch.distributed.get_rank()
    if ranks is None or rank not in ranks:
        return False
    if ignore_virtual:
        return True
    if rank == ranks[0]:
        return is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if rank == ranks[-1]:
        return is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return True


def is_rank_in_position_embedding_group() -> bool:
    """Whether this rank holds the position embeddings."""
    ranks = GROUP_RANKS.get("pos-embd")
    return ranks is not None and torch.distributed.get_rank() in ranks


def get_data_parallel_group_gloo(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
):
    """The gloo copy of the data-parallel (or data x context-parallel) group.

    Args:
        with_context_parallel: The copy of the data x context-parallel group.
        partial_data_parallel: One distributed-optimizer instance's group; with the single
            instance this fork builds, the whole group. Needs ``with_context_parallel``.

    Raises:
        AssertionError: The gloo groups were not created, or ``partial_data_parallel`` without
            ``with_context_parallel`` (as upstream).
    """
    if not with_context_parallel:
        assert not partial_data_parallel, "Partial DP for Optimizer needs to include CP"
    return group_of("dp-cp-gloo" if with_context_parallel else "dp-gloo")


def get_expert_data_parallel_group_gloo(partial_expert_data_parallel: bool = False):
    """The gloo copy of the expert-data-parallel group (one optimizer instance: the whole one)."""
    del partial_expert_data_parallel
    return group_of("expt-dp-gloo")


def _world_size_of(key: str) -> int:
    # Upstream reports 0 outside a distributed job or before the groups exist.
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 0
    group = GROUPS.get(key)
    return group.size() if group is not None else 0


def _rank_in(key: str) -> int:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 0
    group = GROUPS.get(key)
    return group.rank() if group is not None else 0


def get_gtp_weight_remat_group(check_initialized: bool = True):
    """This rank's GTP weight-rematerialisation group (a single rank: GTP is not supported)."""
    return group_of("gtp", check_initialized)


def get_gtp_weight_remat_world_size() -> int:
    """Size of the GTP group: 1 after ``initialize_model_parallel``, 0 before (as upstream)."""
    return _world_size_of("gtp")


def get_gtp_weight_remat_rank() -> int:
    """This rank's index in its GTP group (always 0)."""
    return _rank_in("gtp")


def get_gtp_weight_remat_global_ranks(check_initialized: bool = True) -> Optional[list[int]]:
    """Global ranks of this rank's GTP group (``[rank]``)."""
    return ranks_of("gtp", check_initialized)


def get_expert_gtp_weight_remat_group(check_initialized: bool = True):
    """This rank's expert GTP weight-rematerialisation group (a single rank)."""
    return group_of("expt-gtp", check_initialized)


def get_expert_gtp_weight_remat_world_size() -> int:
    """Size of the expert GTP group: 1 after ``initialize_model_parallel``, 0 before."""
    return _world_size_of("expt-gtp")


def get_expert_gtp_weight_remat_rank() -> int:
    """This rank's index in its expert GTP group (always 0)."""
    return _rank_in("expt-gtp")


def get_expert_gtp_weight_remat_global_ranks(
    check_initialized: bool = True,
) -> Optional[list[int]]:
    """Global ranks of this rank's expert GTP group (``[rank]``)."""
    return ranks_of("expt-gtp", check_initialized)


def get_hierarchical_context_parallel_groups(check_initialized: bool = True):
    """Hierarchical context-parallel groups: never built here (the option is refused).

    Raises:
        AssertionError: With ``check_initialized`` (upstream's answer when they are off).
    """
    assert not check_initialized, (
        "hierarchical context-parallel groups are not initialized: this fork refuses "
        "hierarchical_context_parallel_sizes."
    )
    return None


def get_hybrid_data_context_parallel_groups(
    check_initialized: bool = True, group_size: Optional[int] = None
):
    """The data x context-parallel group when ``group_size`` is its whole size.

    Smaller hybrid groups are never built here (``hybrid_context_parallel`` is refused).

    Raises:
        AssertionError: ``group_size`` asks for a smaller hybrid group.
    """
    if get_data_parallel_world_size(with_context_parallel=True) == group_size:
        return group_of("dp-cp", check_initialized)
    assert not check_initialized, (
        f"hybrid data x context-parallel groups of size {group_size} are not initialized: this "
        "fork refuses hybrid_context_parallel."
    )
    return None


def get_inter_distributed_optimizer_instance_group(check_initialized: bool = True):
    """The group across distributed-optimizer instances: none with the single instance here.

    Raises:
        AssertionError: With ``check_initialized`` (as upstream with one instance).
    """
    assert not check_initialized, (
        "the inter distributed-optimizer instance group is not initialized "
        "(num_distributed_optimizer_instances is 1)."
    )
    return None


def get_model_parallel_src_rank() -> int:
    """The global rank of the first rank of this rank's model-parallel (tensor x pipeline) group."""
    return ranks_of("mp")[0]


def get_expert_model_parallel_src_rank() -> int:
    """The global rank of the first rank of this rank's expert-model-parallel group."""
    return ranks_of("ep")[0]


def get_intra_distributed_optimizer_instance_group(check_initialized: bool = True):
    """The ranks of one distributed-optimizer instance: here the data x context-parallel group,
    since this fork builds a single instance."""
    return group_of("dp-cp", check_initialized)


def get_all_ranks() -> str:
    """This rank's index in its tensor, weight-rematerialization (always 0 here), data, context,
    pipeline and expert-model-parallel groups, joined by ``_`` (e.g. ``"1_0_0_0_0_1"``)."""
    ranks = [
        get_tensor_model_parallel_rank(),
        get_gtp_weight_remat_rank(),
        get_data_parallel_rank(),
        get_context_parallel_rank(),
        get_pipeline_model_parallel_rank(),
        get_expert_model_parallel_rank(),
    ]
    return "_".join(str(rank or 0) for rank in ranks)
