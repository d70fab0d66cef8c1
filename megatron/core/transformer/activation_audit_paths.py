"""What the activation audit audits: its activations, the MLP paths, and each path's reference.

Each :class:`Path` builds one MLP code path from a ``TransformerConfig``, runs it, and models it
in float64 on the layer's own weights (``mcore_activations.reference_mlp``). The runner and the
command line are ``megatron.core.transformer.activation_audit``.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

from mcore_activations import activation_catalogue, activations
from mcore_activations.audit_runner import (
    AuditPath,
    AuditSettings,
    layer_config,
    max_relative,
    with_bias,
)
from mcore_activations.fusions.fused_bias_geglu import quick_gelu
from mcore_activations.reference_mlp import grouped_layer_reference, layer_reference

HIDDEN, FFN, EXPERTS, TOKENS = 64, 128, 4, 48

# Relative tolerance (max |got - ref| / max |ref|) per compute dtype.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# Rows of each expert; one expert gets none, which a grouped path must handle.
TOKENS_PER_EXPERT = (TOKENS // 2, 0, TOKENS // 4, TOKENS - TOKENS // 2 - TOKENS // 4)


def _scale_fc1(module, generator=None, std=8.0):
    """Scales fc1 weights so pre-activations have std ~``std``: clamps and tanh scales bite.

    Biases (zero after Megatron's init) get random values too, so a path that drops or misplaces
    a bias changes the output, not only a gradient. Draws from torch's global generator, which
    the runner seeds before every build; ``generator`` (the inputs') is left untouched.
    """
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "linear_fc1.weight" in name and param.dim() == 2:
                param.normal_(0.0, std / math.sqrt(param.shape[1]))
            elif ".bias" in name and "layer_norm" not in name:
                param.normal_(0.0, 1.0)


def _probs(generator, device):
    return torch.rand(TOKENS, 1, generator=generator).to(device=device, dtype=torch.float32)


# This audit's inputs and judgement; mcore_activations.upstream_audit.SETTINGS is the other.
SETTINGS = AuditSettings(
    tokens=TOKENS,
    hidden=HIDDEN,
    tokens_per_expert=TOKENS_PER_EXPERT,
    initialise=_scale_fc1,
    probs=_probs,
    # max |error| / max |reference|: one wrong element cannot hide in a norm; TOLERANCE was
    # set in this metric.
    metric=max_relative,
    tolerance=TOLERANCE,
)

FUNCTIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "fast_gelu": activations.fast_gelu,
    "quick_gelu": quick_gelu,
    "relu": F.relu,
    "squared_relu": activations.squared_relu,
}

# The columns: the catalogue's entries for this audit, labelled in the one vocabulary (the model
# family, then ActivationSpec.name), as mcore-activations-audit labels its own.
BUILT_IN = activation_catalogue.columns(activation_catalogue.FORK_AUDIT, FUNCTIONS)


# ----------------------------------------------------------------------------- references
def _layer_dtype(module) -> torch.dtype:
    return next(module.parameters()).dtype


def _mlp_reference(params, x, spec, config, prefix="", probs=None, dtype=torch.float64):
    return layer_reference(params, x, spec, config, prefix, probs, dtype)


def _grouped_reference(params, x, spec, config, tokens_per_expert, probs, dtype=torch.float64):
    return grouped_layer_reference(params, x, spec, tokens_per_expert, probs, dtype)


# ----------------------------------------------------------------------------- paths
Path = AuditPath


def _config(kwargs, **extra):
    # ``extra`` is the path's own setting (e.g. its fusion): it wins over the audited fields.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return layer_config(
            kwargs,
            hidden=HIDDEN,
            ffn=FFN,
            experts=EXPERTS,
            defaults=dict(use_cpu_initialization=True),
            forced=extra,
        )


def _local_submodules():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    return MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)


def _te_submodules(grouped=False):
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.transformer.mlp import MLPSubmodules

    if grouped:
        from megatron.core.transformer.moe.experts import GroupedMLPSubmodules

        return GroupedMLPSubmodules(
            linear_fc1=te_ext.TEColumnParallelGroupedLinear,
            linear_fc2=te_ext.TERowParallelGroupedLinear,
        )
    return MLPSubmodules(
        linear_fc1=te_ext.TELayerNormColumnParallelLinear, linear_fc2=te_ext.TERowParallelLinear
    )


def _mlp(cls_path, submodules, **extra):
    def build(kwargs, device, dtype):
        import importlib

        module_name, cls_name = cls_path.rsplit(".", 1)
        cls = getattr(importlib.import_module(module_name), cls_name)
        config = _config(kwargs, **extra)
        return cls(config, submodules(), ffn_hidden_size=FFN).to(device=device, dtype=dtype)

    return build


def _te_linear_submodules():
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.transformer.mlp import MLPSubmodules

    return MLPSubmodules(
        linear_fc1=te_ext.TEColumnParallelLinear, linear_fc2=te_ext.TERowParallelLinear
    )


def _shared(cls_name, te_linears=False, **extra):
    def build(kwargs, device, dtype):
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.moe import shared_experts

        config = _config(kwargs, moe_shared_expert_intermediate_size=FFN, **extra)
        pgs = ProcessGroupCollection.use_mpu_process_groups()
        cls = getattr(shared_experts, cls_name)
        submodules = _te_linear_submodules() if te_linears else _local_submodules()
        layer = cls(config, submodules, gate=True, pg_collection=pgs)
        return layer.to(device=device, dtype=dtype)

    return build


def _experts(cls_name, grouped, **extra):
    def build(kwargs, device, dtype):
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.moe import experts

        config = _config(kwargs, **extra)
        pgs = ProcessGroupCollection.use_mpu_process_groups()
        submodules = _te_submodules(grouped=True) if grouped else _local_submodules()
        layer = getattr(experts, cls_name)(EXPERTS, config, submodules, pg_collection=pgs)
        return layer.to(device=device, dtype=dtype)

    return build


def _run_mlp(module, x, probs, tpe):
    return with_bias(module(x))


def _run_shared(module, x, probs, tpe):
    return module(x)


def _run_experts(module, x, probs, tpe):
    return with_bias(module(x, torch.tensor(tpe), probs.reshape(-1)))


def _ref_mlp(params, x, module, probs, tpe):
    return _mlp_reference(
        params, x, module.activation_spec, module.config, dtype=_layer_dtype(module)
    )


def _ref_shared(params, x, module, probs, tpe):
    out = _mlp_reference(
        params, x, module.activation_spec, module.config, dtype=_layer_dtype(module)
    )
    return out * torch.sigmoid(x @ params["gate_weight"].T)


def _ref_sequential(params, x, module, probs, tpe):
    outs, start = [], 0
    for i, n in enumerate(tpe):
        rows = slice(start, start + n)
        start += n
        expert = module.local_experts[i]
        outs.append(
            _mlp_reference(
                params,
                x[rows],
                expert.activation_spec,
                expert.config,
                f"local_experts.{i}.",
                probs=probs[rows],
                dtype=_layer_dtype(module),
            )
        )
    return torch.cat(outs)


def _ref_grouped(params, x, module, probs, tpe):
    return _grouped_reference(
        params, x, module.activation_spec, module.config, tpe, probs, dtype=_layer_dtype(module)
    )


def all_paths() -> list[Path]:
    """Every path the audit knows, in table order.

    The TE grouped fused classes run with ``te_fused_recipe="none"``: the audit checks which
    function a path computes, and MXFP8 / NVFP4 change the numbers by design (they also need
    SM100).
    """
    mlp = "megatron.core.transformer.mlp.MLP"
    te = "megatron.core.extensions.transformer_engine."
    te_mlp_parent = _mlp(mlp, _te_submodules)
    grouped = dict(moe_grouped_gemm=True, moe_mlp_glu_interleave_size=32)
    return [
        Path("MLP (unfused)", _mlp(mlp, _local_submodules), _run_mlp, _ref_mlp),
        Path(
            "MLP (fused kernels)",
            _mlp(mlp, _local_submodules, bias_activation_fusion=True),
            _run_mlp,
            _ref_mlp,
        ),
        Path("SharedExpertMLP", _shared("SharedExpertMLP"), _run_shared, _ref_shared),
        Path(
            "SequentialMLP",
            _experts("SequentialMLP", False),
            _run_experts,
            _ref_sequential,
        ),
        Path(
            "TEFusedMLP",
            _mlp(te + "TEFusedMLP", _te_submodules, use_transformer_engine_op_fuser=True),
            _run_mlp,
            _ref_mlp,
            needs_te=True,
            parent=te_mlp_parent,
        ),
        Path(
            "TEFusedMLPWithGroupedLinear",
            _mlp(
                te + "TEFusedMLPWithGroupedLinear",
                _te_submodules,
                use_transformer_engine_op_fuser=True,
                use_grouped_gemm_for_dense_mlp=True,
                te_fused_recipe="none",
            ),
            _run_mlp,
            _ref_mlp,
            needs_te=True,
            parent=te_mlp_parent,
        ),
        Path(
            "FusedSharedExpertMLP",
            _shared(
                "FusedSharedExpertMLP",
                te_linears=True,
                use_grouped_gemm_for_shared_expert=True,
                moe_shared_expert_glu_interleave_size=32,
                te_fused_recipe="none",
            ),
            _run_shared,
            _ref_shared,
            needs_te=True,
            parent=_shared("SharedExpertMLP", te_linears=True),
        ),
        Path(
            "TEGroupedMLP (unfused)",
            _experts("TEGroupedMLP", True, **grouped),
            _run_experts,
            _ref_grouped,
            needs_te=True,
        ),
        Path(
            "TEGroupedMLP (TE ops)",
            _experts("TEGroupedMLP", True, use_transformer_engine_op_fuser=True, **grouped),
            _run_experts,
            _ref_grouped,
            needs_te=True,
            parent=_experts("TEGroupedMLP", True, **grouped),
        ),
    ]
