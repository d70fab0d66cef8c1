"""megatron.core.utils / megatron.core.config helpers added for upstream compatibility."""

import logging
import warnings

import pytest
import torch

from megatron.core import config, utils
from megatron.core import parallel_state as ps
from megatron.core.transformer.module import Float16Module, MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils


def test_arithmetic_helpers():
    utils.ensure_divisibility(12, 4)
    with pytest.raises(AssertionError, match="13 is not divisible by 4"):
        utils.ensure_divisibility(13, 4)
    assert [utils.round_up_to_nearest_multiple(v, 8) for v in (0, 1, 8, 9)] == [0, 8, 8, 16]


def test_null_decorator_bare_and_with_arguments():
    def f():
        return 3

    assert utils.null_decorator(f) is f
    assert utils.null_decorator("ignored", option=1)(f) is f


def test_accepts_parameter():
    assert utils.accepts_parameter(lambda x, y: 0, "y")
    assert not utils.accepts_parameter(lambda x: 0, "y")
    assert utils.accepts_parameter(lambda x, **kwargs: 0, "anything")


def test_submodules_and_unwrapping():
    outer = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert utils.is_submodule(outer[0], outer)
    assert not utils.is_submodule(outer, outer) and utils.is_submodule(outer, outer, strict=False)

    config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1, bf16=True)
    inner = MegatronModule(config)
    inner.model_type = "decoder"
    wrapped = Float16Module(config, inner)
    assert utils.unwrap_model(wrapped) is inner
    assert utils.unwrap_model([wrapped, inner]) == [inner, inner]
    assert utils.get_model_type(wrapped) == "decoder"
    assert utils.get_model_xattn(torch.nn.Linear(1, 1)) is False


def test_viewless_and_dtensor_helpers():
    base = torch.zeros(4)
    assert utils.assert_viewless_tensor([base, "not a tensor"])[0] is base
    with pytest.raises(AssertionError, match=r"memory leak\)\. extra"):
        utils.assert_viewless_tensor(base[1:], extra_msg="extra")
    assert utils.to_local_if_dtensor(base) is base
    assert utils.get_data_parallel_group_if_dtensor(base) is None
    assert utils.get_pg_src_rank(None) == 0


def test_asyncio_loop_is_reused():
    loop = utils.get_asyncio_loop()
    assert utils.get_asyncio_loop() is loop
    assert utils.get_asyncio_loop(loop) is loop


def test_version_probes_of_missing_packages():
    with pytest.raises(ImportError):
        utils.get_mamba_version()
    with pytest.raises(ImportError):
        utils.is_fa_min_version("2.0.0")


def test_experimental_markers(monkeypatch):
    @utils.experimental_fn(introduced_with_version="0.8.0")
    def fn():
        return "ran"

    @utils.experimental_cls(introduced_with_version="0.8.0")
    class Exp:
        def __init__(self, value):
            self.value = value

    monkeypatch.setattr(config, "ENABLE_EXPERIMENTAL", False)
    with pytest.raises(utils.ExperimentalNotEnabledError, match="set_experimental_flag"):
        fn()
    with pytest.raises(utils.ExperimentalNotEnabledError):
        Exp(1)
    config.set_experimental_flag(True)
    assert config.is_experimental_enabled() and fn() == "ran" and Exp(2).value == 2
    assert utils.internal_api(fn)._internal_api and utils.experimental_api(fn)._experimental_api


def test_deprecation_markers():
    @utils.deprecated(version="1.0", removal_version="2.0", alternative="g", reason="r")
    def f(x):
        return x

    with pytest.warns(DeprecationWarning, match="f is deprecated since version 1.0. Use g"):
        assert f(1) == 1

    @utils.deprecate_args("old")
    def h(**kwargs):
        return kwargs

    assert h(new=1) == {"new": 1}
    with pytest.raises(TypeError, match="Argument 'old' has been deprecated"):
        h(old=1)


def test_nvtx_decorator_balances_ranges(monkeypatch):
    ranges = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda msg: ranges.append(("push", msg)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: ranges.append(("pop",)))

    @utils.nvtx_decorator(message="work")
    def work():
        return 5

    with warnings.catch_warnings():
        utils.configure_nvtx_profiling(True)
        try:
            assert work() == 5
        finally:
            utils.configure_nvtx_profiling(False)
    assert ranges == [("push", "work"), ("pop",)]


def test_log_on_each_pipeline_stage_refuses_half_the_groups(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    with pytest.raises(ValueError, match="provided or not provided together"):
        utils.log_on_each_pipeline_stage(
            logging.getLogger("t"), logging.INFO, "m", tp_group=object()
        )


def test_parallel_state_fallbacks_follow_initialize_and_destroy():
    # utils reads the parallel-state tables without importing parallel_state (which imports
    # utils): its answers must still be parallel_state's, before and after a reset.
    Utils.initialize_model_parallel(1, 1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            tp = utils.get_tensor_model_parallel_group_if_none(None)
            expert_tp = utils.get_tensor_model_parallel_group_if_none(None, is_expert=True)
        assert tp is ps.get_tensor_model_parallel_group()
        assert expert_tp is ps.get_expert_tensor_parallel_group()
        explicit = object()
        assert utils.get_tensor_model_parallel_group_if_none(explicit) is explicit
        records = []
        logger = logging.getLogger("test_parallel_state_fallbacks")
        logger.setLevel(logging.INFO)
        handler = logging.Handler()
        handler.emit = records.append
        logger.addHandler(handler)
        try:
            utils.log_on_each_pipeline_stage(logger, logging.INFO, "stage")
        finally:
            logger.removeHandler(handler)
        assert [r.getMessage() for r in records] == ["stage"]
    finally:
        Utils.destroy_model_parallel()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert utils.get_tensor_model_parallel_group_if_none(None, check_initialized=False) is None
        # Before initialize_model_parallel there is no group to fall back to: None, as upstream
        # (a TE linear built then runs on its rank alone), not the getters' AssertionError.
        assert utils.get_tensor_model_parallel_group_if_none(None) is None
