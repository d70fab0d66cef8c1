"""Layer specs of a GPT model: which classes build each part of a transformer layer.

This fork implements the MLP / MoE stack only. The layer specs here therefore fill the MLP with
real modules and every other part (norms, attention, bias-dropout-add) with identity
placeholders; code that reads ``spec.mlp`` works as upstream.

Modules that are not always importable (the MLP, MoE and Transformer Engine classes) are imported
inside the functions, so importing this module never fails.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Optional, Union

from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider, TESpecProvider
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec


@dataclass
class TransformerLayerSubmodules:
    """The parts of a transformer layer, each a class, function or ``ModuleSpec``.

    Field names follow upstream's ``TransformerLayerSubmodules``. Only ``mlp`` is built from real
    modules in this fork; the other parts default to identity placeholders.
    """

    input_layernorm: Union[ModuleSpec, type] = IdentityOp
    self_attention: Union[ModuleSpec, type] = IdentityOp
    self_attn_bda: Union[ModuleSpec, type] = IdentityFuncOp
    pre_cross_attn_layernorm: Union[ModuleSpec, type] = IdentityOp
    cross_attention: Union[ModuleSpec, type] = IdentityOp
    cross_attn_bda: Union[ModuleSpec, type] = IdentityFuncOp
    pre_mlp_layernorm: Union[ModuleSpec, type] = IdentityOp
    mlp: Union[ModuleSpec, type, Callable] = IdentityOp
    mlp_bda: Union[ModuleSpec, type] = IdentityFuncOp
    sharded_state_dict_keys_map: dict = field(default_factory=dict)


class _MlpSubmoduleBuilder(partial):
    """``partial(cls.as_mlp_submodule, submodules=MLPSubmodules(...))``: the dense-MLP spec
    upstream's builders return. A transformer layer calls it with ``config``, ``pg_collection``,
    ``is_mtp_layer`` and the optional sizes; ``spec.func.__self__`` is the MLP class.

    Code written for builders that returned a ``ModuleSpec`` reads ``spec.module``,
    ``spec.submodules`` and ``spec.params``; they read the same here (the class, the
    ``MLPSubmodules``, no params). Two builders are equal when they build the same class from
    the same submodules.
    """

    @property
    def module(self) -> type:
        """The MLP class (``func.__self__``)."""
        return self.func.__self__

    @property
    def submodules(self):
        """The ``MLPSubmodules`` the MLP is built from."""
        return self.keywords["submodules"]

    @property
    def params(self) -> dict:
        """No parameters beyond ``submodules`` (a ``ModuleSpec``'s ``params``)."""
        return {}

    def __eq__(self, other) -> bool:
        if not isinstance(other, partial):
            return NotImplemented
        return (self.func, self.args, self.keywords) == (other.func, other.args, other.keywords)

    def __hash__(self) -> int:
        return hash((self.func, self.args))


# Upstream binds the TE fused MLP classes as module attributes (None without TE), and users and
# tools patch them there; this module reads them from the extension lazily, so that importing it
# never fails, and a patched attribute takes precedence at each read.
_TE_FUSED_CLASSES = ("TEFusedMLP", "TEFusedMLPWithGroupedLinear")


def __getattr__(name: str):
    if name in _TE_FUSED_CLASSES:
        from megatron.core.extensions import transformer_engine as te_ext

        return getattr(te_ext, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _te_fused_class(name: str):
    """``name`` as patched into this module, else the extension's class (None without TE)."""
    namespace = globals()
    return namespace[name] if name in namespace else __getattr__(name)


def _refuse(name: str, value, supported) -> None:
    if value != supported:
        raise ValueError(
            f"{name}={value!r} is not supported: this fork builds the MLP part of a layer only. "
            f"Leave it at {supported!r}."
        )


def get_mlp_module_spec(
    use_te: Optional[bool] = True,
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    fp8: Optional[str] = None,
    moe_use_legacy_grouped_gemm: Optional[bool] = False,
    use_te_op_fuser: Optional[bool] = False,
) -> _MlpSubmoduleBuilder:
    """Returns the spec of a dense MLP or of an MoE layer.

    Args:
        use_te: Use Transformer Engine linears (``TELayerNormColumnParallelLinear`` /
            ``TERowParallelLinear``) instead of ``ColumnParallelLinear`` / ``RowParallelLinear``.
        num_experts: None for a dense MLP; the expert count for an MoE layer.
        moe_grouped_gemm: Run the experts as a grouped GEMM (MoE only).
        fp8: Deprecated and ignored (FP8 is configured through the config).
        moe_use_legacy_grouped_gemm: Deprecated upstream; must be False.
        use_te_op_fuser: Build ``TEFusedMLP`` (Transformer Engine fusible ops) for a dense MLP.

    Returns:
        ``_MlpSubmoduleBuilder(MLP.as_mlp_submodule, submodules=MLPSubmodules(linear_fc1=...,
        linear_fc2=...))`` for a dense MLP (``TEFusedMLP`` with ``use_te_op_fuser``), or the MoE
        layer spec.

    Raises:
        ValueError: ``use_te_op_fuser`` without ``use_te``, or with ``num_experts``.
    """
    if fp8 is not None:
        warnings.warn("get_mlp_module_spec: the fp8 argument is deprecated and ignored.")
    _refuse("moe_use_legacy_grouped_gemm", moe_use_legacy_grouped_gemm, False)
    if use_te_op_fuser:
        if not use_te:
            raise ValueError("use_te_op_fuser=True needs use_te=True (TEFusedMLP is a TE module).")
        if num_experts is not None:
            raise ValueError(
                "Transformer Engine operation-based API does not support mixture-of-experts: "
                "pass num_experts=None with use_te_op_fuser=True."
            )
    return get_mlp_module_spec_for_backend(
        backend=TESpecProvider() if use_te else LocalSpecProvider(),
        num_experts=num_experts,
        moe_grouped_gemm=moe_grouped_gemm,
        use_te_op_fuser=use_te_op_fuser,
    )


def get_mlp_module_spec_for_backend(
    backend: BackendSpecProvider,
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    use_te_op_fuser: Optional[bool] = False,
    use_te_activation_func: bool = False,
    use_grouped_gemm_for_dense_mlp: bool = False,
) -> _MlpSubmoduleBuilder:
    """Returns the MLP (or MoE layer) spec built from ``backend``'s modules.

    Args:
        backend: The provider of the linear classes (``LocalSpecProvider`` / ``TESpecProvider``).
        num_experts: None for a dense MLP; the expert count for an MoE layer.
        moe_grouped_gemm: Run the experts as a grouped GEMM (MoE only).
        use_te_op_fuser: Build ``TEFusedMLP`` (Transformer Engine fusible ops) for a dense MLP.
        use_te_activation_func: Apply the activation with the backend's TE activation op.
        use_grouped_gemm_for_dense_mlp: With ``use_te_op_fuser``, build
            ``TEFusedMLPWithGroupedLinear``.

    Returns:
        ``_MlpSubmoduleBuilder(cls.as_mlp_submodule, submodules=MLPSubmodules(...))`` with ``cls``
        ``MLP`` or the TE fused class, as upstream's ``partial``; fc1 is the backend's fused
        norm + linear where it has one. For MoE, the MoE layer spec.
    """
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    activation_func = backend.activation_func() if use_te_activation_func else None
    if num_experts is not None:
        try:
            from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
        except ModuleNotFoundError as error:
            raise NotImplementedError(
                "MoE layer specs (megatron.core.models.gpt.moe_module_specs) are not available in "
                "this build; pass num_experts=None for a dense MLP."
            ) from error
        return get_moe_module_spec_for_backend(
            backend=backend,
            num_experts=num_experts,
            moe_grouped_gemm=moe_grouped_gemm,
            use_te_activation_func=use_te_activation_func,
        )

    module = MLP
    if use_te_op_fuser:
        name = "TEFusedMLPWithGroupedLinear" if use_grouped_gemm_for_dense_mlp else "TEFusedMLP"
        module = _te_fused_class(name)
        if module is None:
            raise ValueError(
                f"use_te_op_fuser=True builds {name}, which needs Transformer Engine; install it "
                "(pip install -e '.[te]') or pass use_te_op_fuser=False."
            )
    if backend.fuse_layernorm_and_linear():
        linear_fc1 = backend.column_parallel_layer_norm_linear()
    else:
        linear_fc1 = backend.column_parallel_linear()
    return _MlpSubmoduleBuilder(
        module.as_mlp_submodule,
        submodules=MLPSubmodules(
            linear_fc1=linear_fc1,
            linear_fc2=backend.row_parallel_linear(),
            activation_func=activation_func,
        ),
    )


def get_gpt_layer_local_submodules(
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    qk_layernorm: Optional[bool] = False,
    multi_latent_attention: Optional[bool] = False,
    fp8: Optional[str] = None,
    normalization: Optional[str] = None,
    qk_l2_norm: Optional[bool] = False,
    use_kitchen: bool = False,
    use_kitchen_attention: bool = False,
    kitchen_attention_backend: str = "sdpa",
    enable_hyper_connection: bool = False,
) -> TransformerLayerSubmodules:
    """Returns the parts of a GPT layer built from megatron.core modules only (no TE).

    The MLP is ``MLP.as_mlp_submodule`` with ``MLPSubmodules(ColumnParallelLinear,
    RowParallelLinear)`` (see :class:`_MlpSubmoduleBuilder`), or the MoE spec when
    ``num_experts`` is set. The attention and norm options configure parts this fork does not
    build: they must keep their defaults (except ``normalization``, which only names the norm
    class of those parts and is accepted).

    Args:
        num_experts: None for a dense MLP; the expert count for an MoE layer.
        moe_grouped_gemm: Run the experts as a grouped GEMM (MoE only).
        qk_layernorm: Not supported; must be False.
        multi_latent_attention: Not supported; must be False.
        fp8: Deprecated and ignored.
        normalization: Name of the norm ("LayerNorm" / "RMSNorm"); the norms are placeholders.
        qk_l2_norm: Not supported; must be False.
        use_kitchen: Not supported; must be False.
        use_kitchen_attention: Not supported; must be False.
        kitchen_attention_backend: Ignored (kitchen attention is not supported).
        enable_hyper_connection: Not supported; must be False.
    """
    _refuse("qk_layernorm", qk_layernorm, False)
    _refuse("multi_latent_attention", multi_latent_attention, False)
    _refuse("qk_l2_norm", qk_l2_norm, False)
    _refuse("use_kitchen", use_kitchen, False)
    _refuse("use_kitchen_attention", use_kitchen_attention, False)
    _refuse("enable_hyper_connection", enable_hyper_connection, False)
    if normalization not in (None, "LayerNorm", "RMSNorm"):
        raise ValueError(f"normalization={normalization!r}: use 'LayerNorm' or 'RMSNorm'.")

    mlp = get_mlp_module_spec(
        use_te=False, num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, fp8=fp8
    )
    return TransformerLayerSubmodules(mlp=mlp)


# The layer class of upstream's layer specs, named by path: this fork does not build attention or
# a whole TransformerLayer, so building the layer from the spec raises ImportError naming the
# module, while everything a caller reads from the spec (``spec.submodules.mlp``) is real.
_TRANSFORMER_LAYER = ("megatron.core.transformer.transformer_layer", "TransformerLayer")


def get_gpt_layer_local_spec(*args, **kwargs) -> ModuleSpec:
    """Returns ``ModuleSpec(module=TransformerLayer, submodules=get_gpt_layer_local_submodules())``.

    Takes the arguments of :func:`get_gpt_layer_local_submodules`. ``TransformerLayer`` is named
    by its upstream module path; this fork does not ship it, so ``build_module`` on the returned
    spec raises ImportError. The MLP part (``spec.submodules.mlp``) builds.
    """
    return ModuleSpec(
        module=_TRANSFORMER_LAYER, submodules=get_gpt_layer_local_submodules(*args, **kwargs)
    )


def get_gpt_layer_with_transformer_engine_submodules(
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    qk_layernorm: Optional[bool] = False,
    multi_latent_attention: Optional[bool] = False,
    fp8: Optional[str] = None,
    qk_l2_norm: Optional[bool] = False,
    use_te_op_fuser: Optional[bool] = False,
    use_kitchen: bool = False,
    use_te_activation_func: bool = False,
    use_kitchen_attention: bool = False,
    kitchen_attention_backend: str = "sdpa",
    mla_down_proj_fusion: bool = False,
    use_grouped_gemm_for_dense_mlp: bool = False,
) -> TransformerLayerSubmodules:
    """Returns the parts of a GPT layer built from Transformer Engine modules.

    The MLP's fc1 is ``TELayerNormColumnParallelLinear`` (the pre-MLP norm fused in) and fc2
    ``TERowParallelLinear``; ``use_te_op_fuser`` builds ``TEFusedMLP`` (or
    ``TEFusedMLPWithGroupedLinear`` with ``use_grouped_gemm_for_dense_mlp``). The attention and
    norm options configure parts this fork does not build and must keep their defaults.

    Args:
        num_experts: None for a dense MLP; the expert count for an MoE layer.
        moe_grouped_gemm: Run the experts as a grouped GEMM (MoE only).
        qk_layernorm: Not supported; must be False.
        multi_latent_attention: Not supported; must be False.
        fp8: Deprecated and ignored.
        qk_l2_norm: Not supported; must be False.
        use_te_op_fuser: Build the dense MLP from Transformer Engine fusible ops.
        use_kitchen: Not supported; must be False.
        use_te_activation_func: Apply the activation with ``TEActivationOp``.
        use_kitchen_attention: Not supported; must be False.
        kitchen_attention_backend: Ignored (kitchen attention is not supported).
        mla_down_proj_fusion: Not supported; must be False.
        use_grouped_gemm_for_dense_mlp: With ``use_te_op_fuser``, use TE grouped linears.

    Raises:
        ValueError: An unsupported option is set, or ``use_te_op_fuser`` with ``num_experts``.
    """
    del kitchen_attention_backend
    for name, value in (
        ("qk_layernorm", qk_layernorm),
        ("multi_latent_attention", multi_latent_attention),
        ("qk_l2_norm", qk_l2_norm),
        ("use_kitchen", use_kitchen),
        ("use_kitchen_attention", use_kitchen_attention),
        ("mla_down_proj_fusion", mla_down_proj_fusion),
    ):
        _refuse(name, value, False)
    if fp8 is not None:
        warnings.warn("get_gpt_layer_with_transformer_engine_submodules: fp8 is deprecated.")
    if use_te_op_fuser and num_experts is not None:
        raise ValueError(
            "Transformer Engine operation-based API does not support mixture-of-experts: "
            "pass num_experts=None with use_te_op_fuser=True."
        )
    mlp = get_mlp_module_spec_for_backend(
        backend=TESpecProvider(),
        num_experts=num_experts,
        moe_grouped_gemm=moe_grouped_gemm,
        use_te_op_fuser=use_te_op_fuser,
        use_te_activation_func=use_te_activation_func,
        use_grouped_gemm_for_dense_mlp=use_grouped_gemm_for_dense_mlp,
    )
    return TransformerLayerSubmodules(mlp=mlp)


def get_gpt_layer_with_transformer_engine_spec(*args, **kwargs) -> ModuleSpec:
    """Returns ``ModuleSpec(module=TransformerLayer, submodules=...)`` of the TE submodules.

    Takes the arguments of :func:`get_gpt_layer_with_transformer_engine_submodules`; the layer
    class is named as in :func:`get_gpt_layer_local_spec`.
    """
    return ModuleSpec(
        module=_TRANSFORMER_LAYER,
        submodules=get_gpt_layer_with_transformer_engine_submodules(*args, **kwargs),
    )
