"""One rule for every activation field: it is read when the layer is built, never again.

Editing ``config.activation_func`` (or a clamp, a tanh scale, the offset, the GLU flag, the
fp8-input-store flag) after a layer exists changes nothing about what that layer computes or
saves, on every path; the layer's ``activation_spec`` keeps naming what it computes. Upstream
re-read some fields per forward on some paths and not on others (#12 item 2).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer import activation_audit as audit
from tests.unit_tests.extensions.fake_te import install_fake_te_with_cpu_linears
from tests.unit_tests.test_utilities import needs_sm100

EDITS = {
    "activation_func": F.gelu,
    "activation_func_clamp_value": 0.5,
    "glu_linear_offset": 3.0,
    "activation_func_fp8_input_store": True,
}


def _edit_every_config(module) -> None:
    configs = {id(m.config): m.config for m in module.modules() if hasattr(m, "config")}
    for config in configs.values():
        for field, value in EDITS.items():
            object.__setattr__(config, field, value)  # past the dataclass's validation


def _run(path, module, device):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(audit.TOKENS, audit.HIDDEN, generator=gen).to(device).requires_grad_()
    probs = torch.rand(audit.TOKENS, 1, generator=gen).to(device)
    half, quarter = audit.TOKENS // 2, audit.TOKENS // 4
    tpe = [half, 0, quarter, audit.TOKENS - half - quarter]
    out = path.run(module, x, probs, tpe)
    out.backward(torch.ones_like(out))
    return out.detach(), x.grad


# CPU: the torch paths, and TE's dense fused classes with CPU stand-ins for TE (fake_te). The
# grouped TE classes need TE's grouped GEMMs, which have no CPU stand-in: with real TE on a GPU.
FAKE_TE = ("TEFusedMLP", "TEFusedMLPWithGroupedLinear")


def _cases():
    for path in audit.all_paths():
        if not path.needs_te:
            yield pytest.param(path, "cpu", id=path.name)
        elif path.name in FAKE_TE:
            yield pytest.param(path, "cpu", id=f"{path.name}-fake-te")
        else:
            marks = [pytest.mark.gpu, pytest.mark.te]
            if path.name == "TEGroupedMLP (TE ops)":
                marks.append(needs_sm100)
            yield pytest.param(path, "cuda", id=path.name, marks=marks)


@pytest.mark.parametrize("path,device", list(_cases()))
def test_editing_the_config_after_build_changes_nothing(path, device, monkeypatch):
    if path.needs_te and device == "cpu":
        install_fake_te_with_cpu_linears(monkeypatch)
    device = torch.device(device)
    audit._init_single_process_world(device)
    kwargs = audit.BUILT_IN["DeepSeek-V4 SwiGLU(clamp=7)"]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = path.build(kwargs, device, torch.float32)
        specs = _specs(module)
        before = _run(path, module, device)
        _edit_every_config(module)
        after = _run(path, module, device)
    for got, expected in zip(after, before):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert _specs(module) == specs and specs


def _specs(module) -> list:
    # SequentialMLP holds one spec per expert MLP; every other path holds its own.
    return [m.activation_spec for m in module.modules() if hasattr(m, "activation_spec")]
