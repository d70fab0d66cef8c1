"""A fake ``transformer_engine`` for CPU tests: recording op classes with pure-torch math.

Every fake op records its constructor arguments (``op.args`` / ``op.kwargs``) and computes the
formula that shared/spec/te-ops.md gives for the TE op of the same name, written here from that
table and independently of ``ActivationSpec.reference``. A test can therefore check both *which*
op a path builds and that the arguments it passes compute the configured activation.

``install_fake_te(monkeypatch, version=...)`` sets ``te`` and ``HAVE_TE`` of the TE import seam
(``mcore_activations.te_import``), the one place every TE path and version check reads them.
"""

from __future__ import annotations

import importlib.util
import math
from types import ModuleType, SimpleNamespace

import torch
import torch.nn.functional as F

import megatron.core.extensions.te_fused_mlp as te_fused_mlp
import megatron.core.extensions.transformer_engine as te_ext
from mcore_activations import te_import

QUICK_GELU_ALPHA = 1.702


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """TE's GELU: the tanh approximation."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def split_glu(x: torch.Tensor, interleave) -> tuple[torch.Tensor, torch.Tensor]:
    """TE's GLU input: first half ``a`` (activated), second half ``b``; or blocks of ``k``."""
    if not interleave:
        n = x.shape[-1] // 2
        return x[..., :n], x[..., n:]
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // (2 * interleave), 2, interleave)
    return blocks[..., 0, :].flatten(-2), blocks[..., 1, :].flatten(-2)


# Op name -> y = f(op, x) for unscaled ops. ``op`` carries the constructor arguments.
def _glu(fn):
    def apply(op, x):
        a, b = split_glu(x, op.kwargs.get("glu_interleave_size"))
        return fn(op, a, b)

    return apply


def _clamped_swiglu(op, a, b):
    limit = op.kwargs.get("limit", 7.0)
    alpha = op.kwargs.get("alpha", 1.702)
    offset = op.kwargs.get("glu_linear_offset", 1.0)
    a_c = torch.clamp(a, max=limit)
    return a_c * torch.sigmoid(alpha * a_c) * (torch.clamp(b, -limit, limit) + offset)


def _situ_glu(op, a, b):
    beta1 = op.kwargs.get("beta1", 4.0)
    beta2 = op.kwargs.get("beta2", 25.0)
    return beta1 * torch.tanh(a / beta1) * torch.sigmoid(a) * beta2 * torch.tanh(b / beta2)


_UNSCALED = {
    "GELU": lambda op, x: gelu_tanh(x),
    "QGELU": lambda op, x: x * torch.sigmoid(QUICK_GELU_ALPHA * x),
    "ReLU": lambda op, x: F.relu(x),
    "SReLU": lambda op, x: F.relu(x) ** 2,
    "SiLU": lambda op, x: x * torch.sigmoid(x),
    "GLU": _glu(lambda op, a, b: torch.sigmoid(a) * b),
    "GEGLU": _glu(lambda op, a, b: gelu_tanh(a) * b),
    "QGEGLU": _glu(lambda op, a, b: a * torch.sigmoid(QUICK_GELU_ALPHA * a) * b),
    "ReGLU": _glu(lambda op, a, b: F.relu(a) * b),
    "SReGLU": _glu(lambda op, a, b: F.relu(a) ** 2 * b),
    "SwiGLU": _glu(lambda op, a, b: a * torch.sigmoid(a) * b),
    "SiTUGLU": _glu(_situ_glu),
    "ClampedSwiGLU": _glu(_clamped_swiglu),
}


def _scaled_tanh_srelu(op, x):
    c = op.kwargs["tanh_clamp_scale"]
    return (c * torch.tanh(F.relu(x) / c)) ** 2


_SCALED = {
    "ScaledSwiGLU": _UNSCALED["SwiGLU"],
    "ScaledSiTUGLU": _UNSCALED["SiTUGLU"],
    "ScaledClampedQGeGLU": _UNSCALED["ClampedSwiGLU"],
    "ScaledSReLU": _UNSCALED["SReLU"],
    "ScaledTanhSReLU": _scaled_tanh_srelu,
}

ACTIVATION_OPS = tuple(_UNSCALED) + tuple(_SCALED)


class FakeOp(torch.nn.Module):
    """Base of every fake op: records its constructor arguments."""

    num_extra_inputs = 0
    num_extra_outputs = 0

    def __init__(self, *args, **kwargs):
        super().__init__()
        self.args = args
        self.kwargs = kwargs

    @property
    def name(self) -> str:
        return type(self).__name__


def _activation_class(name: str) -> type:
    scaled = name in _SCALED
    fn = _SCALED[name] if scaled else _UNSCALED[name]

    def __init__(self, *args, **kwargs):
        if scaled and args:
            # The Scaled* ops take glu_interleave_size positionally too.
            kwargs = {"glu_interleave_size": args[0], **kwargs}
            args = ()
        FakeOp.__init__(self, *args, **kwargs)

    def forward(self, x, *scales):
        y = fn(self, x)
        if scaled:
            (s,) = scales
            y = y * s.to(y.dtype)[..., None]
        return y

    return type(
        name,
        (FakeOp,),
        {"__init__": __init__, "forward": forward, "num_extra_inputs": 1 if scaled else 0},
    )


def _meta_param(*shape, dtype=None):
    return torch.nn.Parameter(torch.empty(*shape, device="meta", dtype=dtype))


class BasicLinear(FakeOp):
    """``y = x W^T``; the weight is a meta placeholder until a module's weight is aliased in."""

    def __init__(self, in_features, out_features, **kwargs):
        super().__init__(in_features, out_features, **kwargs)
        self.weight = _meta_param(out_features, in_features, dtype=kwargs.get("dtype"))

    def forward(self, x):
        return F.linear(x, self.weight)


class Bias(FakeOp):
    def __init__(self, size, **kwargs):
        super().__init__(size, **kwargs)
        self.bias = _meta_param(size, dtype=kwargs.get("dtype"))

    def forward(self, x):
        return x + self.bias


class LayerNorm(FakeOp):
    def __init__(self, normalized_shape, **kwargs):
        super().__init__(normalized_shape, **kwargs)
        self.weight = _meta_param(normalized_shape, dtype=kwargs.get("dtype"))
        self.bias = _meta_param(normalized_shape, dtype=kwargs.get("dtype"))

    def forward(self, x):
        weight = self.weight + 1 if self.kwargs.get("zero_centered_gamma") else self.weight
        return F.layer_norm(x, x.shape[-1:], weight, self.bias, self.kwargs.get("eps", 1e-5))


class RMSNorm(FakeOp):
    def __init__(self, normalized_shape, **kwargs):
        super().__init__(normalized_shape, **kwargs)
        self.weight = _meta_param(normalized_shape, dtype=kwargs.get("dtype"))

    def forward(self, x):
        weight = self.weight + 1 if self.kwargs.get("zero_centered_gamma") else self.weight
        eps = self.kwargs.get("eps", 1e-5)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class GroupedLinear(FakeOp):
    """One-group only: ``y = x W0^T``; takes ``split_sizes`` as its extra input."""

    num_extra_inputs = 1

    def __init__(self, num_groups, in_features, out_features, **kwargs):
        super().__init__(num_groups, in_features, out_features, **kwargs)
        assert num_groups == 1, "the fake GroupedLinear models one group"
        self.weight0 = _meta_param(out_features, in_features, dtype=kwargs.get("dtype"))

    def forward(self, x, split_sizes):
        assert split_sizes.dtype == torch.int64 and split_sizes.tolist() == [x.shape[0]]
        return F.linear(x, self.weight0)


class MakeExtraOutput(FakeOp):
    """Passes its input on, and the fuser also returns it as an extra output (as TE's op)."""

    num_extra_outputs = 1

    def forward(self, x):
        return x


class AllReduce(FakeOp):
    def forward(self, x):
        return x


class ReduceScatter(FakeOp):
    def forward(self, x):
        return x


class Sequential(torch.nn.Module):
    """Runs the ops in order, handing each its share of the extra inputs.

    As TE's fuser: the input of each op with an extra output (``MakeExtraOutput``) is returned
    too, after the main output (``(y, *extra_outputs)``); without one the result is ``y``.
    """

    def __init__(self, *ops):
        super().__init__()
        self.ops = torch.nn.ModuleList(ops)

    def append(self, op) -> None:
        self.ops.append(op)

    def __getitem__(self, index):
        return self.ops[index]

    def __len__(self) -> int:
        return len(self.ops)

    def forward(self, x, *extra_inputs):
        extra = list(extra_inputs)
        extra_outputs = []
        for op in self.ops:
            n = op.num_extra_inputs
            x = op(x, *extra[:n])
            extra = extra[n:]
            if op.num_extra_outputs:
                extra_outputs.append(x)
        assert not extra, f"{len(extra)} extra inputs left unused"
        return (x, *extra_outputs) if extra_outputs else x

    @property
    def op_names(self) -> list:
        return [type(op).__name__ for op in self.ops]


class Recipe(SimpleNamespace):
    pass


class RMSNormModule(torch.nn.Module):
    """``te.pytorch.RMSNorm``, the module: TE's keywords, a weight of ones (zeros when
    zero-centered) and the SM margins TE keeps; ``forward`` computes the RMSNorm."""

    def __init__(
        self,
        normalized_shape,
        eps=1e-5,
        sequence_parallel=None,
        params_dtype=None,
        zero_centered_gamma=False,
        device=None,
        dtype=None,
        sm_margin=0,
    ):
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape
        dtype = params_dtype if params_dtype is not None else dtype
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(tuple(shape), device=device, dtype=dtype))
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        self.sequence_parallel = sequence_parallel
        self._sm_margins = dict.fromkeys(("forward", "backward", "inference"), sm_margin)

    def forward(self, x):
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight


def make_fake_te(version: str = "2.20.2", missing=(), mxfp8=False, nvfp4=False):
    """A fake ``transformer_engine`` module namespace.

    Args:
        version: ``__version__``.
        missing: Op names to leave out of ``te.pytorch.ops``.
        mxfp8 / nvfp4: What ``te.pytorch.is_*_available`` report.
    """
    ops = {name: _activation_class(name) for name in ACTIVATION_OPS}
    ops.update(
        BasicLinear=BasicLinear,
        Bias=Bias,
        LayerNorm=LayerNorm,
        RMSNorm=RMSNorm,
        GroupedLinear=GroupedLinear,
        MakeExtraOutput=MakeExtraOutput,
        AllReduce=AllReduce,
        ReduceScatter=ReduceScatter,
        Sequential=Sequential,
    )
    for name in missing:
        ops.pop(name)
    records = SimpleNamespace(autocast=[], model_init=[])

    class _Context:
        def __init__(self, log, recipe):
            self.log, self.recipe = log, recipe

        def __enter__(self):
            self.log.append(self.recipe)

        def __exit__(self, *exc):
            return False

    pytorch = SimpleNamespace(
        ops=SimpleNamespace(**ops),
        RMSNorm=RMSNormModule,
        is_mxfp8_available=lambda return_reason=False: (mxfp8, "" if mxfp8 else "fake: no MXFP8"),
        is_nvfp4_available=lambda return_reason=False: (nvfp4, "" if nvfp4 else "fake: no NVFP4"),
        autocast=lambda enabled, recipe: _Context(records.autocast, recipe),
        quantized_model_init=lambda enabled, recipe: _Context(records.model_init, recipe),
    )
    recipe = SimpleNamespace(
        MXFP8BlockScaling=lambda: Recipe(kind="mxfp8"),
        NVFP4BlockScaling=lambda: Recipe(kind="nvfp4"),
    )
    return SimpleNamespace(
        __version__=version, pytorch=pytorch, common=SimpleNamespace(recipe=recipe), records=records
    )


def install_fake_te(monkeypatch, version: str = "2.20.2", **kwargs):
    """Patches the TE module globals with a fake of ``version``; returns the fake."""
    fake = make_fake_te(version, **kwargs)

    # The one place TE is replaced: the import seam. Its version checks read the fake's version.
    monkeypatch.setattr(te_import, "te", fake)
    monkeypatch.setattr(te_import, "HAVE_TE", True)
    # Without TE the module exports its TE-only classes as None, as upstream does; with the fake
    # they are what a TE installation would export.
    for name, cls in te_ext.TE_ONLY_CLASSES.items():
        monkeypatch.setattr(te_ext, name, cls)
    return fake


def load_private_copy(module: ModuleType) -> ModuleType:
    """A fresh copy of ``module`` executed now, under its own name (``sys.modules`` untouched).

    Classes whose base is a TE class take it when their module is imported
    (``te_linears._te_base``); the shared modules were imported without TE. A copy loaded while
    the seam holds a fake TE has classes that derive from the fake's.
    """
    name = f"{module.__name__}_over_fake_te"
    spec = importlib.util.spec_from_file_location(name, module.__file__)
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    return copy


def remove_te(monkeypatch):
    """Patches the TE module globals as if Transformer Engine could not be imported."""
    monkeypatch.setattr(te_import, "HAVE_TE", False)


def run_op(op, x: torch.Tensor, scales=None) -> torch.Tensor:
    """Runs a fake activation op (scaled ops need ``scales``)."""
    return op(x, scales) if op.num_extra_inputs else op(x)


# --------------------------------------------------------------------- TE-free linear layers


def _bias_param(size, bias, dtype):
    # TE exposes an empty tensor, not None, as the bias of a bias-free layer.
    data = 0.1 * torch.randn(size, dtype=dtype) if bias else torch.empty(0, dtype=dtype)
    return torch.nn.Parameter(data)


class CpuLinear(torch.nn.Module):
    """What the fused classes read from a TE linear wrapper, without TE."""

    def __init__(self, input_size, output_size, *, config, init_method, bias, skip_bias_add, **kw):
        super().__init__()
        dtype = config.params_dtype
        self.config = config
        self.te_return_bias = bool(skip_bias_add and bias)
        self.fuse_wgrad_accumulation = False
        self.ub_name = None  # TE keeps the attribute, None without a Userbuffers buffer
        self.sequence_parallel = False
        self.tp_group = kw.get("tp_group")
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=dtype))
        init_method(self.weight)
        self.bias = _bias_param(output_size, bias, dtype)

    def _linear(self, x):
        out = F.linear(x, self.weight)
        bias = self.bias if self.bias.numel() else None
        if self.te_return_bias:
            return out, bias
        return (out + bias if bias is not None else out), None

    def forward(self, x):
        return self._linear(x)


class CpuLayerNormLinear(CpuLinear):
    """Stand-in for TELayerNormColumnParallelLinear: the norm, then the linear."""

    def __init__(self, input_size, output_size, *, config, **kw):
        super().__init__(input_size, output_size, config=config, **kw)
        dtype = config.params_dtype
        self.normalization = config.normalization
        self.eps = config.layernorm_epsilon
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        self.layer_norm_weight = torch.nn.Parameter(1 + 0.1 * torch.randn(input_size, dtype=dtype))
        if self.normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(0.1 * torch.randn(input_size, dtype=dtype))
        else:
            self.layer_norm_bias = None

    def forward(self, x):
        if self.normalization == "LayerNorm":
            h = F.layer_norm(
                x, x.shape[-1:], self.layer_norm_weight, self.layer_norm_bias, self.eps
            )
        else:
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.layer_norm_weight
        return self._linear(h)


class CpuColumnLinear(CpuLinear):
    pass


class CpuRowLinear(CpuLinear):
    pass


def install_fake_te_with_cpu_linears(monkeypatch, version: str = "2.20.2", **kwargs):
    """:func:`install_fake_te`, and the TE linear wrappers replaced by the CPU linears above, so
    the TE fused classes build and run end to end on a CPU."""
    linears = dict(
        TELayerNormColumnParallelLinear=CpuLayerNormLinear,
        TEColumnParallelLinear=CpuColumnLinear,
        TERowParallelLinear=CpuRowLinear,
    )
    # The fused classes check their linears against te_fused_mlp's names; te_ext re-exports them.
    for module in (te_ext, te_fused_mlp):
        for name, cls in linears.items():
            monkeypatch.setattr(module, name, cls)
    monkeypatch.delenv("FP4_RECIPE", raising=False)
    return install_fake_te(monkeypatch, version, **kwargs)
