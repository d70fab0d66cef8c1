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


def _block_with_te_fused_dense_mlps():
    args = get_args()
    config = core_transformer_config_from_args(args)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=True)
    dense = get_gpt_layer_with_transformer_engine_spec(
        num_experts=None, moe_grouped_gemm=False, use_te_op_fuser=True
    )
    # A dense layer's mlp spec names MLP itself; an MoE layer's names MoELayer.
    layers = [dense if spec.submodules.mlp.module is MLP else spec for spec in block.layer_specs]
    return type(block)(layer_specs=layers, layer_norm=block.layer_norm)


te_fused_dense_mlp_block = _block_with_te_fused_dense_mlps()
