"""Small helpers shared across megatron.core; version checks come from mcore_activations."""

from __future__ import annotations

import warnings

import torch

from mcore_activations.versions import (  # noqa: F401 - upstream names
    get_te_version,
    get_torch_version,
    is_te_min_version,
    is_torch_min_version,
)


def divide(numerator: int, denominator: int) -> int:
    """Integer division that raises ``ValueError`` unless ``denominator`` divides ``numerator``."""
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def get_pg_size(group=None) -> int:
    """Returns the size of ``group``; 1 without ``torch.distributed`` or without a group.

    ``group=None`` means "no group" (a single rank), not the default group: layers built outside
    a distributed job pass None and must behave as one rank.
    """
    if group is None or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group=group)


def get_pg_rank(group=None) -> int:
    """Returns this rank's index in ``group``; 0 without ``torch.distributed`` or a group."""
    if group is None or not torch.distributed.is_initialized():
        return 0
    return torch.distributed.get_rank(group=group)


def get_tensor_model_parallel_group_if_none(tp_group=None, is_expert=False, check_initialized=True):
    """Returns ``tp_group``, or the global (expert) tensor-parallel group when it is None.

    Passing the group explicitly is preferred; falling back to ``parallel_state`` is deprecated
    upstream and warns once. Without ``torch.distributed`` there is no group and None comes back.

    Args:
        tp_group: The group to use, if the caller has one.
        is_expert: Fall back to the expert-tensor-parallel group instead.
        check_initialized: Raise if ``parallel_state`` has no such group yet.
    """
    if not torch.distributed.is_initialized():
        return None
    if tp_group is not None:
        return tp_group

    from megatron.core import parallel_state

    if torch.distributed.get_rank() == 0:
        warnings.warn(
            "No tensor-parallel group was passed; using the global one from parallel_state. "
            "Pass tp_group= (or pg_collection=) explicitly.",
            DeprecationWarning,
            stacklevel=2,
        )
    if is_expert:
        return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
    return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)
