"""megatron.core.utils helpers that upstream code imports: init methods, viewless tensors,
wrapped-model attributes, single-rank logging, NVTX ranges and the inference_params shim."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from megatron.core import utils


def test_init_methods_draw_with_the_promised_std():
    torch.manual_seed(0)
    weight = torch.empty(400, 400)
    utils.init_method_normal(0.02)(weight)
    assert abs(weight.mean().item()) < 1e-3 and weight.std().item() == pytest.approx(0.02, rel=0.02)
    utils.scaled_init_method_normal(0.02, num_layers=8)(weight)
    assert weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.02)
    utils.scaled_init_method_normal(0.02, num_layers=8, multiplier=1.0)(weight)
    assert weight.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.02)


@pytest.mark.parametrize("keep_graph", [False, True])
def test_make_viewless_tensor(keep_graph):
    base = torch.randn(4, 6, requires_grad=True)
    view = (base * 2).view(24)
    assert view._base is not None
    out = utils.make_viewless_tensor(view, requires_grad=True, keep_graph=keep_graph)
    assert out._base is None and torch.equal(out, view)
    assert out.data_ptr() == view.data_ptr()  # an alias, not a copy
    if keep_graph:
        out.sum().backward()
        torch.testing.assert_close(base.grad, torch.full_like(base, 2.0))
    plain = torch.randn(3)
    assert utils.make_viewless_tensor(plain, requires_grad=False, keep_graph=False) is plain


def test_safely_set_viewless_tensor_data_refuses_views():
    tensor = torch.zeros(3)
    utils.safely_set_viewless_tensor_data(tensor, torch.ones(3))
    assert torch.equal(tensor, torch.ones(3))
    with pytest.raises(ValueError, match="is a view of another tensor"):
        utils.safely_set_viewless_tensor_data(torch.zeros(6)[:3], torch.ones(3))


class _Wrapper(torch.nn.Module):
    def __init__(self, module, config=None):
        super().__init__()
        self.module = module
        self.config = config


def test_get_attr_wrapped_model_and_config():
    inner = torch.nn.Linear(2, 2)
    inner.config = "the config"
    wrapped = _Wrapper(_Wrapper(inner))  # the wrappers' own config is None
    assert utils.get_model_config(wrapped) == "the config"
    assert utils.get_attr_wrapped_model(wrapped, "config") is None  # the first level that has it
    assert utils.get_attr_wrapped_model(wrapped, "weight", return_model_obj=True) is inner
    with pytest.raises(RuntimeError, match="no wrapper level has attribute 'missing'"):
        utils.get_attr_wrapped_model(wrapped, "missing")
    with pytest.raises(RuntimeError, match="got a list"):
        utils.get_attr_wrapped_model([wrapped], "config")


def test_log_single_rank_logs_without_distributed(caplog):
    logger = logging.getLogger("test_core_utils")
    with caplog.at_level(logging.INFO, logger="test_core_utils"):
        utils.log_single_rank(logger, logging.INFO, "hello %s", "there")
    assert caplog.messages == ["hello there"]


def test_nvtx_ranges_are_off_by_default_and_checked_when_on(monkeypatch):
    pushed = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", pushed.append)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: pushed.append("pop"))
    utils.nvtx_range_push("off")
    assert pushed == []
    utils.configure_nvtx_profiling(True)
    try:
        utils.nvtx_range_push(suffix="fwd")
        utils.nvtx_range_pop(suffix="fwd")
        name = f"{__name__}.test_nvtx_ranges_are_off_by_default_and_checked_when_on.fwd"
        assert pushed == [name, "pop"]
        with pytest.raises(RuntimeError, match="no NVTX range is open"):
            utils.nvtx_range_pop("x")
        utils.nvtx_range_push("a")
        with pytest.raises(ValueError, match="innermost open range is 'a'"):
            utils.nvtx_range_pop("b")
    finally:
        utils.configure_nvtx_profiling(False)
        utils._nvtx_open_ranges.clear()


def test_deprecate_inference_params():
    assert utils.deprecate_inference_params("ctx", None) == "ctx"
    with pytest.warns(DeprecationWarning, match="inference_params"):
        assert utils.deprecate_inference_params(None, "params") == "params"


def test_pg_size_and_rank_ask_the_group_itself(monkeypatch):
    # As upstream: the group's own size() / rank(), so any object with those methods (a wrapper,
    # a test double) serves as a group; no group or no torch.distributed means one rank.
    class Group:
        def size(self):
            return 4

        def rank(self):
            return 3

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    assert utils.get_pg_size(Group()) == 4 and utils.get_pg_rank(Group()) == 3
    assert utils.get_pg_size(None) == 1 and utils.get_pg_rank(None) == 0
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    assert utils.get_pg_size(Group()) == 1 and utils.get_pg_rank(Group()) == 0
