"""tensor_parallel.utils: vocabulary ranges, and 1-D split / gather across a two-rank group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.utils import (
    VocabUtility,
    gather_split_1d_tensor,
    split_tensor_into_1d_equal_chunks,
)
from tests.unit_tests.test_utilities import run_distributed


def test_vocab_ranges():
    assert VocabUtility.vocab_range_from_per_partition_vocab_size(250, 2, 4) == (500, 750)
    assert VocabUtility.vocab_range_from_global_vocab_size(1000, 3, 4) == (750, 1000)
    with pytest.raises(ValueError, match="not divisible"):
        VocabUtility.vocab_range_from_global_vocab_size(1001, 0, 4)


def _split_gather_worker(rank, world_size):
    group = dist.new_group(list(range(world_size)))
    full = torch.arange(12.0).reshape(3, 4)
    view = split_tensor_into_1d_equal_chunks(full, tp_group=group)
    assert torch.equal(view, torch.arange(12.0)[rank * 6 : (rank + 1) * 6])
    assert view.data_ptr() == full.view(-1)[rank * 6 :].data_ptr()  # a view by default
    copy = split_tensor_into_1d_equal_chunks(full, new_buffer=True, tp_group=group)
    assert torch.equal(copy, view) and copy.data_ptr() != view.data_ptr()
    assert torch.equal(gather_split_1d_tensor(view, tp_group=group), full.view(-1))
    with pytest.raises(ValueError, match="not divisible"):
        split_tensor_into_1d_equal_chunks(torch.zeros(5), tp_group=group)


def test_split_and_gather_across_two_ranks():
    run_distributed(_split_gather_worker, world_size=2, timeout_s=120)
