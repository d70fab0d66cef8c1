"""Broadcast a batch (a dict of tensors) from tensor-parallel rank 0 to the rest of its group.

Only rank 0 of each tensor-parallel group reads the data; the other ranks need the same batch.
Two broadcasts move it: a header of int64 (a status word, then every key's rank and sizes), so
the receivers can allocate, then all tensors flattened into one buffer of ``datatype``. The
receivers' ``data`` is never read.

Rank 0 checks its data before anything is sent (every key present, every tensor of
``datatype`` and of fewer than ``_MAX_DATA_DIM`` dimensions, as upstream asserts). Upstream checks
after the size broadcast, so a refusal there leaves the other ranks waiting in the second
broadcast forever; here the header's status word tells them, and every rank raises instead.

Device: the buffers live on the current CUDA device, as upstream's, or on the CPU where there
is no CUDA (gloo on CPU-only machines). The returned tensors are views of the one buffer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch

from megatron.core.utils import (
    get_pg_rank,
    get_pg_src_rank,
    get_tensor_model_parallel_group_if_none,
)

__all__ = ["broadcast_data"]

# Upstream's limit: a tensor may have at most _MAX_DATA_DIM - 1 dimensions.
_MAX_DATA_DIM = 5

# Header layout: [status, then per key: ndim, size_0 .. size_{_MAX_DATA_DIM - 1} (0-padded)].
# The rank is sent explicitly, so a dimension of size 0 survives (upstream ends a shape at the
# first 0 and cannot send one).
_STATUS_OK, _STATUS_REFUSED = 0, 1
_SLOTS_PER_KEY = 1 + _MAX_DATA_DIM


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_data_types(keys: Sequence, data: Mapping, target_dtype: torch.dtype) -> None:
    """Raises AssertionError (upstream's type) unless every ``data[key]`` has ``target_dtype``."""
    for key in keys:
        dtype = data[key].dtype
        if dtype != target_dtype:
            raise AssertionError(
                f"broadcast_data: {key!r} has data type {dtype} which is different than "
                f"{target_dtype} (the datatype argument); cast it with .to({target_dtype}) or "
                "broadcast it in a call of its own."
            )


def _check_keys_and_dims(keys: Sequence, data: Any) -> None:
    if not isinstance(data, Mapping):
        raise TypeError(
            f"broadcast_data: data on tensor-parallel rank 0 is a {type(data).__name__}; pass a "
            "dict of key -> tensor there."
        )
    for key in keys:
        if key not in data:
            raise KeyError(
                f"broadcast_data: key {key!r} is not in the data of tensor-parallel rank 0 (it "
                f"has {', '.join(map(repr, data)) or 'no keys'}); pass only keys the batch holds."
            )
        value = data[key]
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"broadcast_data: data[{key!r}] is a {type(value).__name__}, not a tensor; "
                "broadcast only tensors (wrap numbers with torch.tensor)."
            )
        if value.dim() >= _MAX_DATA_DIM:
            raise AssertionError(
                f"broadcast_data: data[{key!r}] has {value.dim()} dimensions, at most "
                f"{_MAX_DATA_DIM - 1} are supported (you should increase MAX_DATA_DIM); reshape "
                "it before broadcasting and back after."
            )


def _source_header(keys: Sequence, data: Mapping, datatype: Optional[torch.dtype]):
    """Rank 0's header and the exception it refuses its data with (None when it is valid)."""
    header = torch.zeros(1 + len(keys) * _SLOTS_PER_KEY, dtype=torch.long)
    try:
        _check_keys_and_dims(keys, data)
        if datatype is not None:
            _check_data_types(keys, data, datatype)
    except Exception as error:  # noqa: BLE001 - sent to the other ranks, then raised here
        header[0] = _STATUS_REFUSED
        return header, error
    for index, key in enumerate(keys):
        start = 1 + index * _SLOTS_PER_KEY
        shape = data[key].shape
        header[start] = len(shape)
        header[start + 1 : start + 1 + len(shape)] = torch.tensor(shape, dtype=torch.long)
    return header, None


def _exchange_header(keys: Sequence, data: Any, datatype: Optional[torch.dtype], group):
    """Broadcasts rank 0's header; returns ``(key_size, key_numel, total_numel)`` on every rank.

    Raises rank 0's refusal there, and RuntimeError on the other ranks of a refused batch.
    """
    is_source = get_pg_rank(group) == 0
    if is_source:
        header, refusal = _source_header(keys, data, datatype)
    else:
        header, refusal = torch.empty(1 + len(keys) * _SLOTS_PER_KEY, dtype=torch.long), None
    if group is not None:
        on_device = header.to(_device())
        torch.distributed.broadcast(on_device, get_pg_src_rank(group), group=group)
        header = on_device.cpu()
    if refusal is not None:
        raise refusal
    if header[0].item() != _STATUS_OK:
        raise RuntimeError(
            f"broadcast_data: tensor-parallel rank 0 (global rank {get_pg_src_rank(group)}) "
            "refused its data, and nothing was broadcast; its error names the key at fault."
        )

    key_size, key_numel, total_numel = {}, {}, 0
    values = header.tolist()
    for index, key in enumerate(keys):
        start = 1 + index * _SLOTS_PER_KEY
        ndim = values[start]
        size = values[start + 1 : start + 1 + ndim]
        key_size[key] = size
        key_numel[key] = torch.Size(size).numel()
        total_numel += key_numel[key]
    return key_size, key_numel, total_numel


def _build_key_size_numel_dictionaries(keys: Sequence, data: Any, tp_group=None):
    """Rank 0's shape and element count of every key, on every rank of the group.

    Returns:
        ``(key_size, key_numel, total_numel)``: key -> list of sizes, key -> element count,
        and the sum of the counts.
    """
    group = get_tensor_model_parallel_group_if_none(tp_group)
    return _exchange_header(keys, data, None, group)


def broadcast_data(keys: Sequence, data: Any, datatype: torch.dtype, tp_group=None) -> dict:
    """Sends ``data[key]`` for every key from tensor-parallel rank 0 to every rank of its group.

    Args:
        keys: The keys to send, the same list in the same order on every rank.
        data: On rank 0, a dict holding a tensor (CPU or GPU) of ``datatype`` for every key;
            ignored on the other ranks (pass None or anything).
        datatype: The dtype of every tensor sent.
        tp_group: The group; parallel_state's tensor-parallel group when None (deprecated).

    Returns:
        ``key -> tensor`` with rank 0's values and shapes, on the current CUDA device (the CPU
        without CUDA), on every rank including rank 0.

    Raises:
        KeyError: A key is missing from rank 0's data (raised on rank 0).
        AssertionError: A tensor of rank 0 has another dtype than ``datatype``, or
            ``_MAX_DATA_DIM`` or more dimensions (raised on rank 0, upstream's type).
        RuntimeError: On the other ranks, when rank 0 refused its data.
    """
    group = get_tensor_model_parallel_group_if_none(tp_group)
    key_size, key_numel, total_numel = _exchange_header(keys, data, datatype, group)

    device = _device()
    if get_pg_rank(group) == 0:
        parts = [data[key].to(device).reshape(-1) for key in keys]
        flat = torch.cat(parts) if parts else torch.empty(0, dtype=datatype, device=device)
    else:
        flat = torch.empty(total_numel, dtype=datatype, device=device)
    if group is not None and total_numel > 0:
        torch.distributed.broadcast(flat, get_pg_src_rank(group), group=group)

    output, offset = {}, 0
    for key in keys:
        output[key] = flat.narrow(0, offset, key_numel[key]).view(key_size[key])
        offset += key_numel[key]
    return output
