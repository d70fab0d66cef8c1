"""``TESpecProvider`` at upstream's import path.

The class lives in ``megatron.core.models.backends`` next to the other backend providers; this
module re-exports it so ``from megatron.core.extensions.transformer_engine_spec_provider import
TESpecProvider`` keeps working. As upstream's module, it imports without Transformer Engine: the
provider imports TE classes only when a method that returns one is called.
"""

from megatron.core.models.backends import TESpecProvider

__all__ = ["TESpecProvider"]
