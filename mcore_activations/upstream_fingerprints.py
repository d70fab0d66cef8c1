"""Fingerprints of the upstream megatron-core objects that ``megatron_patch`` replaces or checks.

Each value is the first 16 hex digits of the SHA-256 of the object's source text (as
:func:`mcore_activations.upstream_patch.upstream.source_fingerprint` computes it from the module
file, so classes that upstream defines only when Transformer Engine imports are fingerprinted
without TE).
A target whose fingerprint differs is not the code the patch was written against, and the patch
refuses to run. Regenerate with ``python tools/fingerprint_upstream.py PATH/TO/megatron/core``.

Beside them, :data:`CAPABILITIES` records, per version, what that upstream's own code does where
the patch must act differently; the patch's logic reads these facts, never a version number.
"""

from __future__ import annotations

import dataclasses

# The release a user installs from the package index (named in the patch's error messages).
RELEASE = "0.19.2"


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What one known upstream's own code does, where the patch must act differently.

    Attributes:
        te_activation_op_method: ``TEFusedMLP`` builds its activation op in its method
            ``_make_activation_op``; otherwise in the module-level ``_make_te_ops_activation``,
            which takes no layer (the patch hands the layer over while ``_make_fused_impl`` runs).
        grouped_ops_clamped_swiglu: ``TEGroupedMLP``'s op-fuser builder passes a SwiGLU clamp
            to Transformer Engine (a clamped quick-GEGLU op with ``alpha=1`` and no offset).
        shared_expert_ops_clamped_swiglu: ``FusedSharedExpertMLP`` builds a clamped SwiGLU op
            for a clamped config, besides plain SwiGLU.
        grouped_fused_swiglu_drops_clamp: ``TEGroupedMLP``'s fused-bias branch calls
            ``weighted_bias_swiglu_impl`` without the clamp; the patch hands the running layer's
            spec to that call.
    """

    te_activation_op_method: bool
    grouped_ops_clamped_swiglu: bool
    shared_expert_ops_clamped_swiglu: bool
    grouped_fused_swiglu_drops_clamp: bool


CAPABILITIES = {
    "0.19.2": Capabilities(
        te_activation_op_method=True,
        grouped_ops_clamped_swiglu=False,
        shared_expert_ops_clamped_swiglu=False,
        grouped_fused_swiglu_drops_clamp=True,
    ),
    "0.20.0": Capabilities(
        te_activation_op_method=False,
        grouped_ops_clamped_swiglu=True,
        shared_expert_ops_clamped_swiglu=True,
        grouped_fused_swiglu_drops_clamp=False,
    ),
}


# fmt: off
KNOWN_UPSTREAMS = {'0.19.2': {'label': 'release 0.19.2',
            'targets': {'megatron.core.fusions.fused_bias_swiglu:swiglu': '1c27e53907483609',
                        'megatron.core.fusions.fused_bias_swiglu:bias_swiglu': '11357668ef614349',
                        'megatron.core.fusions.fused_bias_swiglu:weighted_swiglu': '2819b0982a0734cb',
                        'megatron.core.fusions.fused_bias_swiglu:swiglu_back': '4ae401ceed60b37c',
                        'megatron.core.fusions.fused_bias_swiglu:bias_swiglu_back': '7a855a2b14967fb4',
                        'megatron.core.fusions.fused_bias_swiglu:weighted_swiglu_back': '0313a50ff69ce281',
                        'megatron.core.fusions.fused_bias_swiglu:BiasSwiGLUFunction': '74f41e2ec89fa698',
                        'megatron.core.fusions.fused_bias_swiglu:SwiGLUFunction': 'e2a0c26f1c4ff606',
                        'megatron.core.fusions.fused_bias_swiglu:WeightedSwiGLUFunction': '1209eda2fbe657cd',
                        'megatron.core.fusions.fused_bias_swiglu:bias_swiglu_impl': 'd355f0c5db2d054f',
                        'megatron.core.fusions.fused_bias_swiglu:weighted_bias_swiglu_impl': 'a343caece99e01d5',
                        'megatron.core.fusions.fused_bias_geglu:geglu': 'cdf96387d3790cd7',
                        'megatron.core.fusions.fused_bias_geglu:bias_geglu': '3bdc732158dc1edc',
                        'megatron.core.fusions.fused_bias_geglu:geglu_back': '8b9992cb9f729baf',
                        'megatron.core.fusions.fused_bias_geglu:bias_geglu_back': '3926eba56db64273',
                        'megatron.core.fusions.fused_bias_geglu:BiasGeGLUFunction': 'ab4fcee959c3be0b',
                        'megatron.core.fusions.fused_bias_geglu:GeGLUFunction': '022f60e7a46f3cae',
                        'megatron.core.fusions.fused_bias_geglu:bias_geglu_impl': 'af7549355cf04bb9',
                        'megatron.core.fusions.fused_bias_geglu:quick_geglu': 'd251c6bec543993c',
                        'megatron.core.fusions.fused_bias_geglu:weighted_quick_geglu': '5c513b8b9e41b7e4',
                        'megatron.core.fusions.fused_bias_geglu:quick_geglu_back': 'd8d8b420ebe9b194',
                        'megatron.core.fusions.fused_bias_geglu:weighted_quick_geglu_back': 'e6b033178da00e77',
                        'megatron.core.fusions.fused_bias_geglu:weighted_bias_quick_geglu': 'cd8e0bdc00b71cf9',
                        'megatron.core.fusions.fused_bias_geglu:weighted_bias_quick_geglu_back': '35c45eb2bcb7b40a',
                        'megatron.core.fusions.fused_bias_geglu:WeightedQuickGeGLUFunction': 'b3423fea5cf1eb28',
                        'megatron.core.fusions.fused_bias_geglu:WeightedBiasQuickGeGLUFunction': '05fd11b46967f796',
                        'megatron.core.fusions.fused_bias_geglu:weighted_bias_quick_geglu_impl': 'c61b684856dfb96f',
                        'megatron.core.fusions.fused_bias_gelu:bias_gelu': '5d042d4da208e765',
                        'megatron.core.fusions.fused_bias_gelu:bias_gelu_back': '64640ff41efc1047',
                        'megatron.core.fusions.fused_bias_gelu:GeLUFunction': '3307daa0492d13f7',
                        'megatron.core.fusions.fused_bias_gelu:bias_gelu_impl': '09326c928ed97aa5',
                        'megatron.core.fusions.fused_weighted_squared_relu:weighted_squared_relu': 'fb138137a19a17f4',
                        'megatron.core.fusions.fused_weighted_squared_relu:weighted_squared_relu_back': 'f968fd84fbe95449',
                        'megatron.core.fusions.fused_weighted_squared_relu:WeightedSquaredReLUFunction': 'b54c50fe7fb21a95',
                        'megatron.core.fusions.fused_weighted_squared_relu:weighted_squared_relu_impl': '32c1bc5d9cef66c5',
                        'megatron.core.transformer.mlp:MLP.__init__': '6f3237e368745fc3',
                        'megatron.core.transformer.mlp:MLP.forward': '8c800e9d5a5ea47e',
                        'megatron.core.transformer.moe.shared_experts:SharedExpertMLP.linear_fc1_forward_and_act': '3bcfae7cc7d272de',
                        'megatron.core.transformer.moe.shared_experts:FusedSharedExpertMLP._validate_fused_grouped_swiglu': '7fb01b62164bb83f',
                        'megatron.core.transformer.moe.shared_experts:FusedSharedExpertMLP._make_fused_grouped_swiglu_ops': 'f4b2949ee74fe034',
                        'megatron.core.transformer.moe.experts:TEGroupedMLP.__init__': 'ac2fd35ecfcff439',
                        'megatron.core.transformer.moe.experts:TEGroupedMLP._make_fused_ops': '3f1b545e89ab7b7a',
                        'megatron.core.transformer.moe.experts:TEGroupedMLP.forward': '41522cc1e990b427',
                        'megatron.core.transformer.moe.experts:SequentialMLP.forward': 'e3c2c755c758f9d3',
                        'megatron.core.transformer.moe.experts:InferenceGroupedMLP._resolve_flashinfer_activation_type': '9490eea0a07ade08',
                        'megatron.core.transformer.moe.experts:InferenceGroupedMLP._resolve_mcore_activation_type': 'cdef8038f3abdd0f',
                        'megatron.core.extensions.transformer_engine:TEActivationOp.__new__': '9ef8cb837a45b357',
                        'megatron.core.extensions.transformer_engine:TEFusedMLP._make_activation_op': '3c56fcd2fec04781',
                        'megatron.core.extensions.transformer_engine:TEFusedMLP._make_fused_impl': '5f1557312fc9a2e6',
                        'megatron.core.extensions.transformer_engine:TEFusedMLP.forward': 'b6c85004d2dfb747',
                        'megatron.core.extensions.transformer_engine:TEFusedMLPWithGroupedLinear._make_fused_impl': '9cf5154633c39fb6'}},
 '0.20.0': {'label': 'main d98e8a64',
            'targets': {'megatron.core.fusions.fused_bias_swiglu:swiglu': '1c27e53907483609',
                        'megatron.core.fusions.fused_bias_swiglu:bias_swiglu': '11357668ef614349',
                        'megatron.core.fusions.fused_bias_swiglu:weighted_swiglu': '2819b0982a0734cb',
                        'megatron.core.fusions.fused_bias_swiglu:clamped_swiglu': '36cc9c8c0bcfe7fb',
                        'megatron.core.fusions.fused_bias_swiglu:bias_clamped_swiglu': '2dcac117b42a46be',
                        'megatron.core.fusions.fused_bias_swiglu:clamped_weighted_swiglu': '80744054ad5401b0',
                        'megatron.core.fusions.fused_bias_swiglu:swiglu_back': '4ae401ceed60b37c',
                        'megatron.core.fusions.fused_bias_swiglu:bias_swiglu_back': '7a855a2b14967fb4',
                        'megatron.core.fusions.fused_bias_swiglu:weighted_swiglu_back': '0313a50ff69ce281',
                        'megatron.core.fusions.fused_bias_swiglu:clamped_swiglu_back': '4d84edd76f12b49b',
                        'megatron.core.fusions.fused_bias_swiglu:bias_clamped_swiglu_back': 'ec15d288e57aa562',
                        'megatron.core.fusions.fused_bias_swiglu:clamped_weighted_swiglu_back': '111eef3f039feb35',
                        'megatron.core.fusions.fused_bias_swiglu:BiasSwiGLUFunction': '4cad213600dd1448',
                        'megatron.core.fusions.fused_bias_swiglu:SwiGLUFunction': '30ea22119e4d6792',
                        'megatron.core.fusions.fused_bias_swiglu:WeightedSwiGLUFunction': '890400b5042b4167',
                        'megatron.core.fusions.fused_bias_swiglu:bias_swiglu_impl': 'dc09c30ff1621c93',
                        'megatron.core.fusions.fused_bias_swiglu:weighted_bias_swiglu_impl': '41b79a3308d5bb80',
                        'megatron.core.fusions.fused_bias_geglu:geglu': 'cdf96387d3790cd7',
                        'megatron.core.fusions.fused_bias_geglu:bias_geglu': '3bdc732158dc1edc',
                        'megatron.core.fusions.fused_bias_geglu:geglu_back': '8b9992cb9f729baf',
                        'megatron.core.fusions.fused_bias_geglu:bias_geglu_back': '3926eba56db64273',
                        'megatron.core.fusions.fused_bias_geglu:BiasGeGLUFunction': 'ab4fcee959c3be0b',
                        'megatron.core.fusions.fused_bias_geglu:GeGLUFunction': '022f60e7a46f3cae',
                        'megatron.core.fusions.fused_bias_geglu:bias_geglu_impl': 'af7549355cf04bb9',
                        'megatron.core.fusions.fused_bias_geglu:quick_geglu': 'd251c6bec543993c',
                        'megatron.core.fusions.fused_bias_geglu:weighted_quick_geglu': '5c513b8b9e41b7e4',
                        'megatron.core.fusions.fused_bias_geglu:quick_geglu_back': 'd8d8b420ebe9b194',
                        'megatron.core.fusions.fused_bias_geglu:weighted_quick_geglu_back': 'e6b033178da00e77',
                        'megatron.core.fusions.fused_bias_geglu:weighted_bias_quick_geglu': 'cd8e0bdc00b71cf9',
                        'megatron.core.fusions.fused_bias_geglu:weighted_bias_quick_geglu_back': '35c45eb2bcb7b40a',
                        'megatron.core.fusions.fused_bias_geglu:WeightedQuickGeGLUFunction': 'b3423fea5cf1eb28',
                        'megatron.core.fusions.fused_bias_geglu:WeightedBiasQuickGeGLUFunction': '05fd11b46967f796',
                        'megatron.core.fusions.fused_bias_geglu:weighted_bias_quick_geglu_impl': 'c61b684856dfb96f',
                        'megatron.core.fusions.fused_bias_gelu:bias_gelu': '5d042d4da208e765',
                        'megatron.core.fusions.fused_bias_gelu:bias_gelu_back': '64640ff41efc1047',
                        'megatron.core.fusions.fused_bias_gelu:GeLUFunction': '3307daa0492d13f7',
                        'megatron.core.fusions.fused_bias_gelu:bias_gelu_impl': '09326c928ed97aa5',
                        'megatron.core.fusions.fused_weighted_squared_relu:weighted_squared_relu': 'fb138137a19a17f4',
                        'megatron.core.fusions.fused_weighted_squared_relu:weighted_squared_relu_back': 'f968fd84fbe95449',
                        'megatron.core.fusions.fused_weighted_squared_relu:WeightedSquaredReLUFunction': 'b54c50fe7fb21a95',
                        'megatron.core.fusions.fused_weighted_squared_relu:weighted_squared_relu_impl': '32c1bc5d9cef66c5',
                        'megatron.core.transformer.mlp:MLP.__init__': 'bf0a01f753ea88aa',
                        'megatron.core.transformer.mlp:MLP.forward': 'd688101da62f0b2b',
                        'megatron.core.transformer.moe.shared_experts:SharedExpertMLP.linear_fc1_forward_and_act': 'f38561d55c6dbebf',
                        'megatron.core.transformer.moe.shared_experts:FusedSharedExpertMLP._validate_fused_grouped_swiglu': '2219f4a273144676',
                        'megatron.core.transformer.moe.shared_experts:FusedSharedExpertMLP._make_fused_grouped_swiglu_ops': 'd20fee7123a108b8',
                        'megatron.core.transformer.moe.experts:TEGroupedMLP.__init__': 'ed5cf9af0fa2eb62',
                        'megatron.core.transformer.moe.experts:TEGroupedMLP._make_fused_ops': '03472535b29c5e50',
                        'megatron.core.transformer.moe.experts:TEGroupedMLP.forward': '7102837c22916d33',
                        'megatron.core.transformer.moe.experts:SequentialMLP.forward': 'e3c2c755c758f9d3',
                        'megatron.core.transformer.moe.experts:InferenceGroupedMLP._resolve_flashinfer_activation_type': '9490eea0a07ade08',
                        'megatron.core.transformer.moe.experts:InferenceGroupedMLP._resolve_mcore_activation_type': 'a3299178a9f2abca',
                        'megatron.core.extensions.transformer_engine:TEActivationOp.__new__': '9ef8cb837a45b357',
                        'megatron.core.extensions.transformer_engine:TEFusedMLP._make_fused_impl': 'ae5a0fb74541de69',
                        'megatron.core.extensions.transformer_engine:TEFusedMLP.forward': '7ceec0eff9e440c4',
                        'megatron.core.extensions.transformer_engine:_make_te_ops_activation': '7a0086af0b3d8273',
                        'megatron.core.extensions.transformer_engine:TEFusedMLPWithGroupedLinear._make_fused_impl': '9cf5154633c39fb6'}}}
# fmt: on
