"""Placeholders that stand in for an optional submodule of a spec."""

from __future__ import annotations

import torch


class IdentityOp(torch.nn.Module):
    """A module that returns its first input unchanged.

    It accepts and ignores any constructor arguments, so a spec can put it wherever a real module
    (a norm, an attention block) would be built with the usual arguments.
    """

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, x, *args, **kwargs):
        """Returns ``x``; other arguments are ignored."""
        return x


class IdentityFuncOp(IdentityOp):
    """A module whose call returns the identity function.

    It replaces factories such as ``get_bias_dropout_add``, which are called first to obtain a
    function and only then applied to tensors: ``IdentityFuncOp()(...)(x, ...)`` returns ``x``.
    """

    def forward(self, *args, **kwargs):
        """Returns a function that returns its first argument."""
        return super().forward
