"""The typing contracts of an MLP's parts: how each part is built and what the built part offers.

``MLP`` builds its fc1 and fc2 linears, and (with ``use_te_activation_func``) a Transformer
Engine activation module, from the classes an :class:`~megatron.core.transformer.mlp.MLPSubmodules`
names. These Protocols state the call ``MLP`` makes to each class and the methods it then uses,
with upstream's names and signatures, so a type checker can check a custom submodule.

They are static contracts only (not ``runtime_checkable``, as upstream's): ``isinstance`` against
them raises ``TypeError``. ``mlp`` re-exports them under upstream's import path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = [
    "LinearFc1Builder",
    "LinearFc1Interface",
    "LinearFc2Builder",
    "LinearFc2Interface",
    "TEActivationFunctionBuilder",
    "TEActivationFunctionInterface",
]


class LinearFc1Interface(Protocol):
    """A built fc1: the column-parallel projection to the MLP's intermediate width."""

    def forward(self, hidden_states: torch.Tensor, /) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns ``(output, bias)``; ``bias`` is None unless the layer skips adding it."""
        ...

    def backward_dw(self) -> None:
        """Computes the weight gradient deferred from backward (delayed-wgrad schedules)."""
        ...


class LinearFc1Builder(Protocol):
    """What ``MLP`` calls to build its fc1 (a class, or any callable taking these arguments).

    ``MLP`` also passes ``pg_collection=``; upstream's contract leaves it out, and so does this.
    """

    def __call__(
        self,
        input_size: int,
        output_size: int,
        /,
        *,
        config: TransformerConfig,
        init_method: Callable[[torch.Tensor], None],
        gather_output: bool,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: str | None,
        tp_group: torch.distributed.ProcessGroup | None,
        stride: int = 1,
        name: str | None = None,
    ) -> LinearFc1Interface:
        """Builds fc1 mapping ``input_size`` to ``output_size`` features (split across TP)."""
        ...


class TEActivationFunctionInterface(Protocol):
    """A built Transformer Engine activation module."""

    def forward(self, input_: torch.Tensor, /) -> torch.Tensor:
        """Returns the activation of fc1's output."""
        ...


class TEActivationFunctionBuilder(Protocol):
    """What ``MLP`` calls to build its TE activation module (``use_te_activation_func``)."""

    def __call__(self, *, config: TransformerConfig) -> TEActivationFunctionInterface:
        """Builds the activation module for ``config``'s activation."""
        ...


class LinearFc2Interface(Protocol):
    """A built fc2: the row-parallel projection back to the hidden width."""

    def forward(self, hidden_states: torch.Tensor, /) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns ``(output, bias)``; ``bias`` is None unless the layer skips adding it."""
        ...

    def backward_dw(self) -> None:
        """Computes the weight gradient deferred from backward (delayed-wgrad schedules)."""
        ...


class LinearFc2Builder(Protocol):
    """What ``MLP`` calls to build its fc2 (a class, or any callable taking these arguments).

    ``MLP`` also passes ``pg_collection=``; upstream's contract leaves it out, and so does this.
    """

    def __call__(
        self,
        input_size: int,
        output_size: int,
        /,
        *,
        config: TransformerConfig,
        init_method: Callable[[torch.Tensor], None],
        bias: bool,
        input_is_parallel: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: str | None,
        tp_group: torch.distributed.ProcessGroup | None,
        name: str | None = None,
    ) -> LinearFc2Interface:
        """Builds fc2 mapping ``input_size`` (split across TP) to ``output_size`` features."""
        ...
