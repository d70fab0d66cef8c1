"""Transformer enums (upstream's ``megatron.core.transformer.enums``).

Member names and values are upstream's, so configs, specs and checkpoints that store these
members read the same here. The fork builds the MLP / MoE-expert parts of a layer only; the
attention and CUDA-graph enums exist so that configs and layer specs naming them construct.
"""

import enum

from megatron.core.enums import ModelType

__all__ = [
    "ModelType",
    "LayerType",
    "AttnType",
    "AttnMaskType",
    "AttnBackend",
    "CudaGraphModule",
    "CudaGraphScope",
    "InferenceCudaGraphScope",
]


class LayerType(enum.Enum):
    """Role of a layer in a model: embedding, loss, encoder, decoder or multi-token prediction."""

    embedding = 1
    loss = 2
    encoder = 3
    decoder = 4
    mtp = 5


class AttnType(enum.Enum):
    """Self-attention or cross-attention."""

    self_attn = 1
    cross_attn = 2


class AttnMaskType(enum.Enum):
    """Attention mask kinds (``no_mask`` and ``causal_bottom_right`` are TE-only upstream)."""

    padding = 1
    causal = 2
    no_mask = 3
    padding_causal = 4
    arbitrary = 5
    causal_bottom_right = 6


class AttnBackend(enum.Enum):
    """Attention kernel backend; ``auto`` lets the attention module choose."""

    flash = 1
    fused = 2
    unfused = 3
    local = 4
    auto = 5


class CudaGraphModule(enum.Enum):
    """Per-layer parts a CUDA graph may capture (an empty scope means the whole layer)."""

    attn = 1
    mlp = 2
    moe = 3
    moe_router = 4
    moe_preprocess = 5
    mamba = 6


class CudaGraphScope(enum.Enum):
    """Legacy CUDA-graph scopes, kept so configs and checkpoints that stored them still load.

    The ordinals differ from ``CudaGraphModule`` (``full_iteration`` is 1 here), so this is a
    separate class rather than an alias: an alias would map stored members to the wrong ones.
    """

    full_iteration = 1
    attn = 2
    mlp = 3
    moe = 4
    moe_router = 5
    moe_preprocess = 6
    mamba = 7
    full_iteration_inference = 8


class InferenceCudaGraphScope(enum.Enum):
    """Which module owns inference CUDA graphs: none (eager), each layer, or the whole block."""

    none = 1
    layer = 2
    block = 3
