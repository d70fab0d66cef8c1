"""Base class of every megatron.core module."""

from __future__ import annotations

import torch

from megatron.core.model_parallel_config import ModelParallelConfig


class MegatronModule(torch.nn.Module):
    """A ``torch.nn.Module`` that keeps the config it was built from.

    Subclasses read their settings from ``self.config`` instead of copying fields, so a module and
    its config never disagree.

    Args:
        config: The configuration the module was built from, usually a ``TransformerConfig``.
    """

    def __init__(self, config: ModelParallelConfig):
        super().__init__()
        self.config = config

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        """Returns the state dict to save in a checkpoint (the plain ``state_dict`` here).

        Args:
            prefix: Prefix prepended to every key.
            keep_vars: Keep tensors attached to autograd instead of detaching them.
        """
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)
