"""megatron.core.extensions.transformer_engine_spec_provider: upstream's path to TESpecProvider,
the same class as models.backends', importable and answering without Transformer Engine."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from megatron.core.extensions import transformer_engine as te_ext
from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
from megatron.core.models import backends


def test_it_is_the_backends_class_not_a_copy():
    assert TESpecProvider is backends.TESpecProvider


def test_the_provider_names_the_te_classes():
    provider = TESpecProvider()
    assert provider.column_parallel_linear() is te_ext.TEColumnParallelLinear
    assert provider.row_parallel_linear() is te_ext.TERowParallelLinear
    assert provider.column_parallel_layer_norm_linear() is te_ext.TELayerNormColumnParallelLinear
    assert provider.fuse_layernorm_and_linear() is True


def test_imports_and_answers_with_transformer_engine_blocked():
    # A fresh interpreter in which ``import transformer_engine`` fails, as on a machine without
    # TE: the module must import, and the provider answer as upstream's does there (the linear
    # classes exist and refuse construction; the TE-only activation op is None).
    script = textwrap.dedent(
        """
        import sys
        sys.modules["transformer_engine"] = None
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
        from megatron.core.extensions import transformer_engine as te_ext
        provider = TESpecProvider()
        assert provider.activation_func() is None, provider.activation_func()
        assert provider.column_parallel_linear() is te_ext.TEColumnParallelLinear
        experts = provider.grouped_mlp_modules(moe_use_grouped_gemm=True)
        # Without TE's grouped linear the experts fall back to SequentialMLP over TE linears.
        assert experts.func.__name__ == "SequentialMLP", experts.func
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
