"""Backend spec providers: which linear / expert classes a layer spec uses for a backend.

Upstream's providers also name norms and attention modules. This fork builds the MLP and MoE
expert parts only, so its providers answer the MLP questions (``column_parallel_linear``,
``row_parallel_linear``, the fused layer-norm linear, the TE activation op and the expert
modules); the names and return values of those methods are upstream's.

Transformer Engine classes are imported when a TE provider method is called, so importing this
module never needs Transformer Engine.
"""

from __future__ import annotations

from functools import partial
from typing import Optional, Protocol

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

__all__ = ["BackendSpecProvider", "LocalSpecProvider", "TESpecProvider"]


class BackendSpecProvider(Protocol):
    """The questions a layer-spec builder asks a backend about the MLP and its experts."""

    def column_parallel_linear(self) -> type:
        """The column-parallel linear class (the MLP's fc1 without a fused norm)."""
        ...

    def row_parallel_linear(self) -> type:
        """The row-parallel linear class (the MLP's fc2)."""
        ...

    def fuse_layernorm_and_linear(self) -> bool:
        """Whether fc1 is one module that applies the pre-MLP norm and the linear."""
        ...

    def column_parallel_layer_norm_linear(self) -> Optional[type]:
        """The fused norm + column-parallel linear class, or None where there is none."""
        ...

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool) -> partial:
        """The routed experts' class with its submodules bound, as ``partial(cls, submodules=)``."""
        ...

    def activation_func(self) -> Optional[type]:
        """The Transformer Engine activation op class, or None for the built-in activation."""
        ...


class LocalSpecProvider:
    """megatron.core's own modules: ``ColumnParallelLinear`` / ``RowParallelLinear``."""

    def column_parallel_linear(self) -> type:
        """Returns ``ColumnParallelLinear``."""
        return ColumnParallelLinear

    def row_parallel_linear(self) -> type:
        """Returns ``RowParallelLinear``."""
        return RowParallelLinear

    def fuse_layernorm_and_linear(self) -> bool:
        """Returns False: the local backend has no fused norm + linear module."""
        return False

    def column_parallel_layer_norm_linear(self) -> Optional[type]:
        """Returns None (no fused norm + linear module)."""
        return None

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool) -> partial:
        """Returns ``SequentialMLP`` over the local linears (there is no local grouped GEMM).

        Args:
            moe_use_grouped_gemm: Ignored, as upstream: grouped GEMMs need Transformer Engine.
        """
        del moe_use_grouped_gemm
        from megatron.core.transformer.mlp import MLPSubmodules
        from megatron.core.transformer.moe.experts import SequentialMLP

        return partial(
            SequentialMLP,
            submodules=MLPSubmodules(
                linear_fc1=ColumnParallelLinear,
                linear_fc2=RowParallelLinear,
                activation_func=self.activation_func(),
            ),
        )

    def activation_func(self) -> Optional[type]:
        """Returns None: the MLP applies its own activation."""
        return None


class TESpecProvider:
    """Transformer Engine modules (``TELayerNormColumnParallelLinear``, ``TERowParallelLinear``...).

    Upstream keeps this class in ``megatron.core.extensions.transformer_engine_spec_provider``.
    """

    def column_parallel_linear(self) -> type:
        """Returns ``TEColumnParallelLinear``."""
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear

        return TEColumnParallelLinear

    def row_parallel_linear(self) -> type:
        """Returns ``TERowParallelLinear``."""
        from megatron.core.extensions.transformer_engine import TERowParallelLinear

        return TERowParallelLinear

    def fuse_layernorm_and_linear(self) -> bool:
        """Returns True: fc1 is ``TELayerNormColumnParallelLinear``."""
        return True

    def column_parallel_layer_norm_linear(self) -> Optional[type]:
        """Returns ``TELayerNormColumnParallelLinear``."""
        from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear

        return TELayerNormColumnParallelLinear

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool) -> partial:
        """Returns ``TEGroupedMLP`` over TE grouped linears, or ``SequentialMLP`` over TE linears.

        Args:
            moe_use_grouped_gemm: Run the experts as one grouped GEMM when TE provides it.
        """
        from megatron.core.extensions import transformer_engine as te_ext
        from megatron.core.transformer.mlp import MLPSubmodules
        from megatron.core.transformer.moe.experts import (
            GroupedMLPSubmodules,
            SequentialMLP,
            TEGroupedMLP,
        )

        grouped_fc1 = getattr(te_ext, "TEColumnParallelGroupedLinear", None)
        if moe_use_grouped_gemm and grouped_fc1 is not None:
            return partial(
                TEGroupedMLP,
                submodules=GroupedMLPSubmodules(
                    linear_fc1=grouped_fc1,
                    linear_fc2=te_ext.TERowParallelGroupedLinear,
                    activation_func=self.activation_func(),
                ),
            )
        return partial(
            SequentialMLP,
            submodules=MLPSubmodules(
                linear_fc1=self.column_parallel_linear(),
                linear_fc2=self.row_parallel_linear(),
                activation_func=self.activation_func(),
            ),
        )

    def activation_func(self) -> Optional[type]:
        """Returns ``TEActivationOp``, the TE activation op lowered from the config's spec."""
        from megatron.core.extensions.transformer_engine import TEActivationOp

        return TEActivationOp
