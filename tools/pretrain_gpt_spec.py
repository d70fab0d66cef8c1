"""A user layer spec for upstream's ``pretrain_gpt.py --spec``: dense MLPs as ``TEFusedMLP``.

Upstream's block spec builds every dense MLP as ``MLP`` with Transformer Engine linears; a user
who wants Transformer Engine's op fuser for them (``TEFusedMLP``) passes a spec of their own, as
this module does: ``--spec pretrain_gpt_spec te_fused_dense_mlp_block`` with this file's folder on
``PYTHONPATH`` (and ``--use-transformer-engine-op-fuser``). Upstream's ``import_module`` reads a
module attribute, not a function, so the spec is built from the parsed arguments at import time,
exactly as ``gpt_builders`` builds its own. The MoE layers keep upstream's spec.

Used by tools/upstream_pretrain.py (docs/using-with-megatron-lm.md, "Upstream's own training
loop"); needs upstream megatron-core with ``megatron.training`` and Transformer Engine.
"""

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.mlp import MLP
from megatron.training import get_args
from megatron.training.argument_utils import core_transformer_config_from_args


def _mlp_class(mlp_spec):
    """The class a layer spec's ``mlp`` entry builds.

    Upstream's specs name it three ways: a ``ModuleSpec`` (``.module``), a class, or a
    ``functools.partial`` of a class or of its ``as_mlp_submodule`` classmethod.
    """
    builder = getattr(mlp_spec, "module", mlp_spec)
    builder = getattr(builder, "func", builder)
    return getattr(builder, "__self__", builder)


def _block_with_te_fused_dense_mlps():
    args = get_args()
    # The spec is imported while upstream reads its arguments, before the parallel groups exist,
    # so the pipeline rank cannot be asked for: this spec serves one pipeline stage only.
    if args.pipeline_model_parallel_size != 1:
        raise ValueError(
            "pretrain_gpt_spec builds its block before the parallel groups exist and supports "
            f"--pipeline-model-parallel-size 1 only, not {args.pipeline_model_parallel_size}; "
            "build a pipelined spec inside a model provider instead"
        )
    config = core_transformer_config_from_args(args)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=True, pp_rank=0)
    dense = get_gpt_layer_with_transformer_engine_spec(
        num_experts=None, moe_grouped_gemm=False, use_te_op_fuser=True
    )
    # A dense layer's mlp spec builds MLP itself; an MoE layer's builds MoELayer.
    layers = [
        dense if _mlp_class(spec.submodules.mlp) is MLP else spec for spec in block.layer_specs
    ]
    if all(layer is not dense for layer in layers):
        raise ValueError(
            "pretrain_gpt_spec found no dense MLP layer to build as TEFusedMLP: the model has "
            "MoE layers only (--moe-layer-freq); drop --spec pretrain_gpt_spec"
        )
    return type(block)(layer_specs=layers, layer_norm=block.layer_norm)


te_fused_dense_mlp_block = _block_with_te_fused_dense_mlps()
