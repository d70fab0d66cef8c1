"""The launcher of the Triton kernels (``triton_kernels._Launcher``): direct launches of
cached kernels, the fallback to Triton's entry point, launch hooks, device checks and 64-bit
offsets.
"""

from __future__ import annotations

import pytest
import torch

from mcore_activations.fusions.activation_ops import use_kernel_backend
from megatron.core.fusions.fused_activation import fused_activation
from tests.unit_tests.activation_catalog import SPECS

pytest.importorskip("triton")


@pytest.mark.gpu
def test_cuda_direct_launch_respecialises_on_alignment():
    """The direct launcher keys compiled kernels on what Triton specialises on: an input that is
    not 16-byte aligned after an aligned one must get its own kernel, not the aligned one."""
    spec = SPECS["swiglu_clamp"]
    aligned = torch.randn(33, 64, device="cuda", dtype=torch.bfloat16) * 4
    storage = torch.empty(33 * 64 + 1, device="cuda", dtype=torch.bfloat16)
    shifted = storage[1:].view(33, 64)
    shifted.copy_(aligned)
    assert shifted.data_ptr() % 16 != 0
    with use_kernel_backend("triton"):
        first = fused_activation(aligned, spec)
        again = fused_activation(aligned, spec)  # direct launch of the cached kernel
        moved = fused_activation(shifted, spec)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    torch.testing.assert_close(moved, first, rtol=0, atol=0)


class _FakeCompiled:
    """Stands in for Triton's CompiledKernel: records how it was launched."""

    def __init__(self, refuse: bool = False):
        self.refuse = refuse
        self.launches = []
        self.function, self.packed_metadata = "function", "metadata"

    def run(self, *args):
        if self.refuse:
            raise TypeError("launcher takes other arguments")
        self.launches.append(("run", args))

    def __getitem__(self, grid):
        def launch(*args):
            if self.refuse:
                raise TypeError("launcher takes other arguments")
            self.launches.append(("grid", grid, args))

        return launch


class _FakeKernel:
    """Stands in for a ``@triton.jit`` function with pointers ``x`` and ``bias``, integers ``n``
    and ``m`` (``m`` unspecialised) and one compile-time value; each launch returns
    ``compiled``."""

    arg_names = ["x_ptr", "bias_ptr", "n", "m", "BLOCK"]
    do_not_specialize = ["m"]

    def __init__(self, compiled):
        self.compiled = compiled
        self.calls = 0

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls += 1
            return self.compiled

        return run


_FAKE_PLAN = (1, 1, {"BLOCK": 4, "num_warps": 1}, (4,))


def _fake_launcher(monkeypatch, compiled, hooks_off=True):
    from mcore_activations.fusions import triton_kernels as tk

    monkeypatch.setattr(tk.triton.compiler, "CompiledKernel", _FakeCompiled)
    monkeypatch.setattr(tk, "_DIRECT_LAUNCH", True)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    if hooks_off:
        monkeypatch.setattr(tk, "_no_launch_hooks", lambda: True)
    kernel = _FakeKernel(compiled)
    return tk, kernel, tk._Launcher(kernel)


def test_direct_launch_falls_back_to_triton_when_the_launcher_differs(monkeypatch):
    """Users run other Triton releases: if a cached kernel's launcher refuses the arguments,
    the call goes through Triton's own entry point instead, and so do all later calls."""
    tk, kernel, launcher = _fake_launcher(monkeypatch, _FakeCompiled(refuse=True))
    x = torch.zeros(4)
    for expected_calls in (1, 2, 3):
        launcher((1, 1, 1), (x, None), (4, 5), _FAKE_PLAN)
        assert kernel.calls == expected_calls
    assert tk._DIRECT_LAUNCH is False


def test_direct_launch_passes_raw_pointers_and_the_current_stream(monkeypatch):
    """A cached kernel is launched through its launcher with the stream, no launch metadata or
    hooks, pointers as integers (None where absent), the integers, then the compile-time values.
    Calls whose integers differ only where the kernel does not specialise (``m``) share it; a
    specialised integer of another value class, a pointer of another alignment or dtype each
    go through Triton again."""
    compiled = _FakeCompiled()
    tk, kernel, launcher = _fake_launcher(monkeypatch, compiled)
    x = torch.zeros(16)
    launcher((3, 1, 1), (x, None), (32, 5), _FAKE_PLAN)
    assert kernel.calls == 1 and not compiled.launches
    for m in (7, 16, 1):  # not specialised: 16 and 1 would be other classes for ``n``
        launcher((3, 1, 1), (x, None), (48, m), _FAKE_PLAN)  # 48: a multiple of 16, as 32 is
    head = (3, 1, 1, 1234, "function", "metadata", None, None, None, x.data_ptr(), None)
    assert compiled.launches == [("run", head + (48, m, 4)) for m in (7, 16, 1)]
    assert kernel.calls == 1
    for expected_calls, args in enumerate(
        [
            ((x, None), (33, 5)),  # 33 is not a multiple of 16
            ((x[1:], None), (32, 5)),  # 4 bytes past a 16-byte boundary
            ((x.double(), None), (32, 5)),  # another dtype
        ],
        start=2,
    ):
        launcher((3, 1, 1), *args, _FAKE_PLAN)
        assert kernel.calls == expected_calls
    assert len(compiled.launches) == 3


def test_direct_launch_calls_triton_launch_hooks_when_set(monkeypatch):
    """With a launch hook installed (a profiler's, which may also instrument what it compiles),
    every launch goes through Triton's own entry point, which compiles for the hooks and calls
    them; with the hook removed, the cached kernel launches directly again."""
    tk, kernel, launcher = _fake_launcher(monkeypatch, _FakeCompiled(), hooks_off=False)
    if tk._RUNTIME_KNOBS is None:
        pytest.skip("this Triton has no launch hook knobs")
    x = torch.zeros(8)
    launcher((1, 1, 1), (x, None), (8, 1), _FAKE_PLAN)
    assert tk._no_launch_hooks() and kernel.calls == 1

    def hook(metadata):
        pass

    tk._RUNTIME_KNOBS.launch_enter_hook.add(hook)
    try:
        assert not tk._no_launch_hooks()
        launcher((1, 1, 1), (x, None), (8, 1), _FAKE_PLAN)
        assert kernel.calls == 2 and not kernel.compiled.launches
    finally:
        tk._RUNTIME_KNOBS.launch_enter_hook.remove(hook)
    launcher((1, 1, 1), (x, None), (8, 1), _FAKE_PLAN)
    assert kernel.calls == 2 and len(kernel.compiled.launches) == 1


def test_launcher_refuses_tensors_on_another_device(monkeypatch):
    """A raw pointer is not checked downstream, so a tensor on another device than the first is
    refused, by name, before anything launches."""
    tk, kernel, launcher = _fake_launcher(monkeypatch, _FakeCompiled())
    x = torch.zeros(8)
    other = torch.zeros(8, device="meta")
    monkeypatch.setattr(torch.Tensor, "get_device", lambda t: 0 if t.is_meta else -1)
    with pytest.raises(RuntimeError, match="activation kernel's bias is on meta but its x is"):
        launcher((1, 1, 1), (x, other), (8, 1), (1, 1, {"num_warps": 1}, ()))
    assert kernel.calls == 0


def test_launchers_take_the_unspecialised_integers_from_the_kernels():
    """Only the backward's row split is unspecialised, as its decorator says, whether Triton
    compiles the kernels or the interpreter runs them."""
    from mcore_activations.fusions import triton_kernels as tk

    backward = tk._activation_bwd_kernel.arg_names.index("rows_per_program")
    assert tk._backward_launcher.unspecialised == {backward}
    for launcher in (tk._forward_launcher, tk._flat_launcher, tk._flat_backward_launcher):
        assert launcher.unspecialised == frozenset()


@pytest.mark.gpu
def test_cuda_launcher_knows_the_unspecialised_integers():
    """The direct launcher's cache key treats an integer as Triton does: by value class, or by
    width alone where the kernel says ``do_not_specialize``."""
    from mcore_activations.fusions import triton_kernels as tk

    for launcher in (
        tk._forward_launcher,
        tk._flat_launcher,
        tk._flat_backward_launcher,
        tk._backward_launcher,
    ):
        params = launcher.kernel.params
        assert launcher.unspecialised == {p.num for p in params if p.do_not_specialize}


@pytest.mark.gpu
def test_cuda_cpu_bias_is_refused():
    """A CPU bias beside a CUDA input is refused by name before any launch (as a raw pointer it
    would fault on the GPU)."""
    spec = SPECS["swiglu_clamp"]
    x = torch.randn(8, 64, device="cuda")
    with use_kernel_backend("triton"), pytest.raises(RuntimeError, match="bias is on cpu"):
        fused_activation(x, spec, bias=torch.zeros(64))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["squared_relu_tanh", "swiglu_clamp"])
def test_cuda_offsets_past_int32(name):
    """Inputs of more than 2**31 elements: the element offsets must be 64-bit. The first and last
    rows of one large call must equal, bit for bit, the same rows computed in a small call (the
    kernels are elementwise per row, so nothing but the offsets differs)."""
    spec = SPECS[name]
    ffn = 4096
    width = 2 * ffn if spec.gated else ffn
    rows = 2**31 // width + 3
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.empty(rows, width, device="cuda", dtype=torch.bfloat16)
    x[:4].normal_(0.0, 4.0, generator=gen)
    x[-4:].normal_(0.0, 4.0, generator=gen)
    probs = torch.rand(rows, 1, device="cuda", generator=gen)
    bias = torch.randn(width, device="cuda", dtype=torch.bfloat16, generator=gen)
    with use_kernel_backend("triton"):
        out = fused_activation(x, spec, bias=bias, probs=probs)
        for part in (slice(0, 4), slice(rows - 4, rows)):
            small = fused_activation(x[part].clone(), spec, bias=bias, probs=probs[part].clone())
            torch.testing.assert_close(out[part], small, rtol=0, atol=0)
    del out
    with use_kernel_backend("triton"):
        x.requires_grad_()
        grad = torch.zeros(rows, ffn, device="cuda", dtype=torch.bfloat16)
        grad[-4:].normal_(generator=gen)
        fused_activation(x, spec).backward(grad)
        tail = x[-4:].detach().clone().requires_grad_()
        fused_activation(tail, spec).backward(grad[-4:])
    torch.testing.assert_close(x.grad[-4:], tail.grad, rtol=0, atol=0)
