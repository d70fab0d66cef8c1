"""broadcast_data on one rank: values, shapes (0-d and zero-size included), copies, and rank 0's
refusals. Two ranks are in tests/unit_tests/parallel/test_cross_entropy_and_data.py."""

from __future__ import annotations

import pytest
import torch

import megatron.core.tensor_parallel as tp
from megatron.core import parallel_state
from megatron.core.tensor_parallel.data import _build_key_size_numel_dictionaries, broadcast_data

pytestmark = pytest.mark.usefixtures("single_rank_model_parallel")

SHAPES = {"tokens": (2, 3), "labels": (4,), "count": (), "empty": (2, 0, 3), "4d": (1, 2, 3, 4)}


def _batch(dtype=torch.long) -> dict:
    generator = torch.Generator().manual_seed(0)
    return {
        key: torch.randint(-50, 50, shape, generator=generator).to(dtype)
        for key, shape in SHAPES.items()
    }


def _group():
    return parallel_state.get_tensor_model_parallel_group()


@pytest.mark.parametrize("dtype", [torch.long, torch.float32], ids=str)
def test_returns_copies_of_every_tensor(dtype):
    batch = _batch(dtype)
    out = broadcast_data(list(SHAPES), batch, dtype, tp_group=_group())
    assert list(out) == list(SHAPES)
    for key, value in batch.items():
        assert out[key].dtype == dtype and out[key].shape == value.shape, key
        assert torch.equal(out[key], value), key
    out["tokens"].add_(1)  # one buffer of its own, not views of the input
    assert torch.equal(batch["tokens"], _batch(dtype)["tokens"])


def test_sizes_dictionaries():
    batch = _batch()
    key_size, key_numel, total = _build_key_size_numel_dictionaries(
        ["tokens", "empty", "count"], batch, tp_group=_group()
    )
    assert key_size == {"tokens": [2, 3], "empty": [2, 0, 3], "count": []}
    assert key_numel == {"tokens": 6, "empty": 0, "count": 1}
    assert total == 7


def test_only_the_keys_asked_for_are_sent():
    out = broadcast_data(["labels"], _batch(), torch.long, tp_group=_group())
    assert list(out) == ["labels"]


def test_missing_key_is_refused():
    with pytest.raises(KeyError, match="key 'mask' is not in the data"):
        broadcast_data(["tokens", "mask"], _batch(), torch.long, tp_group=_group())


def test_other_dtype_is_refused():
    batch = _batch()
    batch["labels"] = batch["labels"].float()
    with pytest.raises(
        AssertionError, match="'labels' has data type torch.float32 which is different than "
    ):
        broadcast_data(list(SHAPES), batch, torch.long, tp_group=_group())


def test_five_dimensions_are_refused():
    batch = {"x": torch.zeros(1, 1, 1, 1, 1, dtype=torch.long)}
    with pytest.raises(AssertionError, match="has 5 dimensions, at most 4"):
        broadcast_data(["x"], batch, torch.long, tp_group=_group())


def test_data_must_be_a_dict_of_tensors():
    with pytest.raises(TypeError, match=r"data\['x'\] is a list, not a tensor"):
        broadcast_data(["x"], {"x": [1, 2]}, torch.long, tp_group=_group())
    with pytest.raises(TypeError, match="is a NoneType; pass a dict"):
        broadcast_data(["x"], None, torch.long, tp_group=_group())


def test_parallel_state_group_when_none_is_given():
    # Upstream's fallback to the global group, deprecated there as here.
    with pytest.warns(DeprecationWarning, match="No tensor-parallel group was passed"):
        out = broadcast_data(["tokens"], _batch(), torch.long)
    assert torch.equal(out["tokens"], _batch()["tokens"])


def test_without_torch_distributed(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    out = broadcast_data(list(SHAPES), _batch(), torch.long)
    assert all(torch.equal(out[key], value) for key, value in _batch().items())


def test_exported_from_the_package():
    assert tp.broadcast_data is broadcast_data
