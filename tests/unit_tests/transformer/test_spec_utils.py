"""ModuleSpec / build_module, the identity placeholders and MegatronModule."""

import sys
from dataclasses import dataclass

import pytest
import torch

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import (
    ModuleSpec,
    build_module,
    get_submodules,
    import_module,
)


@dataclass
class _Parts:
    inner: type = IdentityOp


class _Block(torch.nn.Module):
    def __init__(self, width, *, scale=1.0, submodules=None, name=None):
        super().__init__()
        self.width, self.scale, self.submodules, self.name = width, scale, submodules, name


def _factory():
    return "made"


def test_build_module_from_spec_merges_params_submodules_and_kwargs():
    spec = ModuleSpec(module=_Block, params={"scale": 2.0}, submodules=_Parts())
    block = build_module(spec, 4, name="b")
    assert (block.width, block.scale, block.name) == (4, 2.0, "b")
    assert block.submodules is spec.submodules
    assert get_submodules(spec) is spec.submodules
    with pytest.raises(ValueError, match="carries no submodules"):
        get_submodules(_Block)


def test_spec_is_callable_and_submodules_come_from_partials_too():
    import functools

    spec = ModuleSpec(module=_Block, params={"scale": 2.0}, metainfo={"origin": "test"})
    block = spec(4)  # as build_module(spec, 4)
    assert (block.width, block.scale) == (4, 2.0) and spec.metainfo == {"origin": "test"}
    parts = _Parts()
    assert get_submodules(functools.partial(_Block, submodules=parts)) is parts
    with pytest.raises(ValueError, match="binds no 'submodules' keyword"):
        get_submodules(functools.partial(_Block, scale=1.0))


def test_partial_without_submodules_raises_upstreams_key_error_too():
    import functools

    from megatron.core.transformer.spec_utils import MissingSubmodulesKeywordError

    # Upstream raises KeyError for this case (its keyword lookup), ValueError for other specs;
    # the fork's error is both, so callers catching either keep working.
    with pytest.raises(KeyError) as raised:
        get_submodules(functools.partial(_Block, scale=1.0))
    assert isinstance(raised.value, ValueError)
    assert isinstance(raised.value, MissingSubmodulesKeywordError)
    assert str(raised.value).startswith("functools.partial(")  # not KeyError's quoted form
    with pytest.raises(ValueError) as raised:
        get_submodules(_Block)
    assert not isinstance(raised.value, KeyError)


def test_build_module_without_submodules_passes_none_of_them():
    block = build_module(ModuleSpec(module=_Block), 3)
    assert block.submodules is None and block.scale == 1.0
    assert build_module(_Block, 5, scale=3.0).scale == 3.0


def test_build_module_returns_functions_uncalled():
    assert build_module(_factory) is _factory
    assert build_module(ModuleSpec(module=_factory)) is _factory


def test_build_module_imports_paths():
    linear = build_module(ModuleSpec(module=("torch.nn", "Linear")), 2, 3)
    assert isinstance(linear, torch.nn.Linear)
    assert import_module("torch.nn.Linear") is torch.nn.Linear
    with pytest.raises(ValueError, match="must name a module and an attribute"):
        import_module("Linear")
    with pytest.raises(ImportError, match="Could not import module 'no_such_pkg.sub' for spec"):
        import_module(("no_such_pkg.sub", "X"))
    with pytest.raises(ImportError, match="Could not find spec 'NoSuchLayer' in module 'torch.nn'"):
        build_module(ModuleSpec(module=("torch.nn", "NoSuchLayer")))


def test_build_module_refuses_an_argument_set_twice():
    spec = ModuleSpec(module=_Block, params={"scale": 2.0})
    with pytest.raises(TypeError, match=r"\['scale'\] are set both by the ModuleSpec"):
        build_module(spec, 4, scale=3.0)


needs_notes = pytest.mark.skipif(
    sys.version_info < (3, 11), reason="exception notes arrived in Python 3.11"
)


@needs_notes
def test_build_errors_name_the_module():
    with pytest.raises(TypeError) as info:
        build_module(ModuleSpec(module=_Block), 1, 2, 3)
    assert info.value.__notes__ == ["when instantiating _Block"]


@needs_notes
def test_nested_build_errors_name_every_level_and_keep_the_exception():
    root = KeyError("missing width")

    class Leaf:
        def __init__(self):
            raise LookupError("leaf failed") from root

    class Trunk:
        def __init__(self):
            build_module(ModuleSpec(module=Leaf))

    with pytest.raises(LookupError) as info:
        build_module(Trunk)
    # The leaf's own exception object, its cause intact, annotated innermost first.
    assert str(info.value) == "leaf failed" and info.value.__cause__ is root
    assert info.value.__notes__ == ["when instantiating Leaf", "when instantiating Trunk"]


def test_identity_ops():
    x = torch.randn(2)
    assert IdentityOp(1, 2, anything=3)(x, "ignored") is x
    func = IdentityFuncOp()(x)
    assert func(x, "ignored") is x


def test_megatron_module_keeps_its_config():
    config = ModelParallelConfig()
    module = MegatronModule(config)
    assert module.config is config
    assert module.state_dict_for_save_checkpoint() == {}


@pytest.mark.parametrize(
    "option", ["qk_layernorm", "multi_latent_attention", "qk_l2_norm", "use_kitchen"]
)
def test_local_layer_spec_refuses_parts_this_fork_does_not_build(option):
    with pytest.raises(ValueError, match=f"{option}=True is not supported"):
        get_gpt_layer_local_submodules(**{option: True})


def test_get_module_returns_or_imports_the_named_class():
    from megatron.core.transformer.spec_utils import ModuleSpec as Spec
    from megatron.core.transformer.spec_utils import get_module

    assert get_module(torch.nn.Linear) is torch.nn.Linear
    assert get_module(Spec(module=torch.nn.Linear)) is torch.nn.Linear
    assert get_module(Spec(module=("torch.nn", "ReLU"))) is torch.nn.ReLU
    with pytest.raises(ImportError, match="no_such_module"):
        get_module(Spec(module=("no_such_module", "X")))
