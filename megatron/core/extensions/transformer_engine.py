"""Transformer Engine backend at upstream's module path: its public names, from one file per job.

Transformer Engine (TE) is optional. When it cannot be imported this module still imports:
``HAVE_TE`` is False, ``te`` is a placeholder, the names upstream exports as None without TE
(``TEFusedMLP``, ``TEGroupedLinear``, ...; see ``TE_ONLY_CLASSES``) are None, and every other
TE-backed class raises ``ImportError`` naming itself and the install command when constructed.

Where each job lives (docs/te-paths.md):

- ``mcore_activations.te_import``: the import seam, the only module that imports TE; ``te``,
  ``HAVE_TE`` and the version checks that every TE path reads at call time, so a test replaces
  TE in that one place. ``te`` and ``HAVE_TE`` here read the seam too.
- ``mcore_activations.te_lowering``: the one activation lowering, ``ActivationSpec`` -> the
  ``te.pytorch.ops`` op that computes it, or :class:`UnsupportedActivationError`.
- ``te_linears``: the TE linear wrappers. ``te_norm``: ``TENorm`` and
  ``TEFusedResidualRMSNorm``. ``te_recipes``: the grouped paths' quantization recipes.
- ``te_rng``: the RNG tracker (``tensor_parallel.random`` imports only it).
- ``te_ops_adapters``: upstream's module-level builders of ``te.pytorch.ops`` operations that
  alias a module's parameters (``_make_te_ops_basic_linear_from_mcore_te_linear``, ...).
- ``te_fused_ops``: ``TEFusedOpsMixin``, the lifecycle of every fused class.
- ``te_fused_mlp``: ``TEFusedMLP`` and ``TEFusedMLPWithGroupedLinear``.
- ``te_gemm``: ``te_general_gemm`` (None where TE has no ``general_gemm``).

Patching this module reaches the classes, as upstream: ``is_te_min_version``,
``get_tensor_model_parallel_world_size`` and ``get_cuda_rng_tracker`` are bound here and the
``te_*`` modules call them through this module at each call (``te_public`` says why).
"""

from __future__ import annotations

from typing import Any

from mcore_activations import te_import
from mcore_activations.te_import import (  # noqa: F401 - upstream names re-exported here
    TE_CACHE_QUANTIZED_INPUT_MIN_VERSION,
    TE_CLAMPED_GLU_MIN_VERSION,
    TE_GROUPED_OPS_MIN_VERSION,
    TE_INSTALL_HINT,
    TE_OPS_MIN_VERSION,
    TE_SILU_MIN_VERSION,
    TE_SITU_GLU_MIN_VERSION,
)
from mcore_activations.te_import import TEPlaceholder as _TEPlaceholder  # noqa: F401
from mcore_activations.te_import import require_te as _require_te  # noqa: F401
from mcore_activations.te_lowering import (  # noqa: F401 - upstream names re-exported here
    TE_GLU_INTERLEAVE_MIN_VERSION,
    TEActivationLowering,
    TEActivationOp,
    TEVersionError,
    _make_te_ops_activation,
    lower_activation_to_te_op,
    plan_te_activation,
)
from megatron.core.extensions.te_fused_mlp import TEFusedMLP, TEFusedMLPWithGroupedLinear
from megatron.core.extensions.te_fused_ops import TEFusedOpsMixin
from megatron.core.extensions.te_gemm import te_general_gemm_or_none
from megatron.core.extensions.te_linears import (  # noqa: F401 - upstream names re-exported here
    TEColumnParallelGroupedLinear,
    TEColumnParallelLinear,
    TEGroupedLinear,
    TELayerNormColumnParallelLinear,
    TELinear,
    TERowParallelGroupedLinear,
    TERowParallelLinear,
    _set_expert_parameter_attributes,
    set_save_original_input,
)
from megatron.core.extensions.te_norm import TEFusedResidualRMSNorm, TENorm
from megatron.core.extensions.te_ops_adapters import (  # noqa: F401 - upstream names re-exported
    _get_te_ops_rng_state_tracker_function,
    _get_te_ops_tensor_parallel_context,
    _make_te_ops_basic_linear_from_mcore_te_linear,
    _make_te_ops_bias_from_tensor,
    _make_te_ops_grouped_linear_from_mcore_te_linear,
    _make_te_ops_norm_from_mcore_te_layernorm_linear,
    _make_te_ops_rmsnorm_from_te_rmsnorm,
    _te_ops_has_nested_attr,
    _te_ops_userbuffers_options,
    _validate_te_ops_adapter_module,
)
from megatron.core.extensions.te_recipes import (
    FUSED_RECIPES,
    TEFusedRecipeError,
    fused_recipe_autocast,
    fused_recipe_model_init,
    make_fused_recipe,
    resolve_fused_recipe,
)
from megatron.core.extensions.te_rng import TECudaRNGStatesTracker

# The names te_public.PATCHABLE_NAMES lists, bound here as in upstream's module: the te_* modules
# call them through this module, so a patch here reaches every TE class.
from megatron.core.parallel_state import get_tensor_model_parallel_world_size  # noqa: F401
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker  # noqa: F401
from megatron.core.utils import get_te_version, is_te_min_version  # noqa: F401

# Upstream's name is None where TE has no general_gemm; decided once, at import, as upstream.
te_general_gemm = te_general_gemm_or_none()

__all__ = [
    "HAVE_TE",  # noqa: F822 - resolved by __getattr__, from the seam
    "FUSED_RECIPES",
    "TEActivationLowering",
    "TEActivationOp",
    "TEColumnParallelGroupedLinear",
    "TEColumnParallelLinear",
    "TECudaRNGStatesTracker",
    "TEFusedMLP",
    "TEFusedMLPWithGroupedLinear",
    "TEFusedOpsMixin",
    "TEFusedRecipeError",
    "TEFusedResidualRMSNorm",
    "TEGroupedLinear",
    "TELayerNormColumnParallelLinear",
    "TELinear",
    "TENorm",
    "TERowParallelGroupedLinear",
    "TERowParallelLinear",
    "TEVersionError",
    "fused_recipe_autocast",
    "fused_recipe_model_init",
    "lower_activation_to_te_op",
    "make_fused_recipe",
    "plan_te_activation",
    "resolve_fused_recipe",
    "set_save_original_input",
    "te_general_gemm",
]


def __getattr__(name: str) -> Any:
    # ``te`` and ``HAVE_TE`` are the seam's, read on each access (a fake set there shows here).
    if name in ("te", "HAVE_TE"):
        return getattr(te_import, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Upstream exports these names as None when Transformer Engine is missing, and code guards on
# that (``if TEFusedMLP is None: ...``). The classes stay reachable through TE_ONLY_CLASSES, which
# is how tests running a fake TE on CPU put them back.
TE_ONLY_CLASSES = {
    "TEActivationOp": TEActivationOp,
    "TEGroupedLinear": TEGroupedLinear,
    "TEColumnParallelGroupedLinear": TEColumnParallelGroupedLinear,
    "TERowParallelGroupedLinear": TERowParallelGroupedLinear,
    "TEFusedMLP": TEFusedMLP,
    "TEFusedMLPWithGroupedLinear": TEFusedMLPWithGroupedLinear,
    "TEFusedResidualRMSNorm": TEFusedResidualRMSNorm,
}
if not te_import.have_te():
    globals().update(dict.fromkeys(TE_ONLY_CLASSES))
