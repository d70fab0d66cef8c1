"""Quantization recipes of the grouped fused Transformer Engine paths: which one, and its contexts.

``TEFusedMLPWithGroupedLinear`` and ``FusedSharedExpertMLP`` run their op sequences under one
recipe policy, :func:`resolve_fused_recipe`, applied at construction; whether this machine can run
the recipe (:func:`check_fused_recipe_runs_here`) is asked at their first forward, because models
are often built on a CPU or the meta device and moved to the GPU later. TE is read from the import
seam at call time.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import Any, Optional

import torch

from mcore_activations import te_import

__all__ = [
    "FUSED_RECIPES",
    "TEFusedRecipeError",
    "check_fused_recipe_runs_here",
    "fused_recipe_autocast",
    "fused_recipe_model_init",
    "make_fused_recipe",
    "resolve_fused_recipe",
]


FUSED_RECIPES = ("mxfp8", "nvfp4", "none")
# Upstream always quantized the grouped fused paths: NVFP4 when FP4_RECIPE=nvfp4, else MXFP8.
_DEFAULT_FUSED_RECIPE = "mxfp8"
_RECIPE_ENV_VAR = "FP4_RECIPE"


class TEFusedRecipeError(ValueError):
    """The quantization recipe chosen for a grouped fused path is invalid or unavailable."""


def resolve_fused_recipe(
    config_or_env: Any = None,
    *,
    path: str = "TE grouped fused ops",
    check_available: bool = False,
) -> str:
    """Decides which quantization recipe a grouped fused path runs under.

    The grouped fused paths (``TEFusedMLPWithGroupedLinear``, ``FusedSharedExpertMLP``) run
    under an MXFP8 or NVFP4 recipe upstream, always. Here the choice is explicit, and includes
    unquantized execution:

    1. ``config.te_fused_recipe`` when the config has it and it is not None;
    2. else the environment variable ``FP4_RECIPE`` (upstream's switch) when set and non-empty;
    3. else ``"mxfp8"``, upstream's default.

    Values: ``"mxfp8"`` (``MXFP8BlockScaling``), ``"nvfp4"`` (``NVFP4BlockScaling``), ``"none"``
    (no quantization: the ops run in the parameters' dtype). An unknown value is an error on any
    machine. Whether the GPU can run a quantized recipe (MXFP8 and NVFP4 need SM100+; an
    H100/H200 has neither) is a property of the machine the model runs on, not of the config:
    the fused classes ask :func:`check_fused_recipe_runs_here` at their first forward, which
    refuses with a message asking for ``"none"``, never a silent switch to other math.

    Args:
        config_or_env: A config (read for ``te_fused_recipe``), or a mapping standing for the
            environment (tests); None reads ``os.environ`` only.
        path: The class asking, named in errors.
        check_available: Also check now that this machine's TE and GPU can run the recipe.

    Returns:
        One of :data:`FUSED_RECIPES`.

    Raises:
        TEFusedRecipeError: Unknown value; with ``check_available``, a recipe this machine
            cannot run.
    """
    if isinstance(config_or_env, Mapping):
        config, environ = None, config_or_env
    else:
        config, environ = config_or_env, os.environ
    value = getattr(config, "te_fused_recipe", None) if config is not None else None
    source = "config.te_fused_recipe"
    if value is None:
        env_value = environ.get(_RECIPE_ENV_VAR, "")
        if env_value.strip():
            value, source = env_value, f"environment variable {_RECIPE_ENV_VAR}"
        else:
            value, source = _DEFAULT_FUSED_RECIPE, "the default (upstream's MXFP8)"
    name = str(value).strip().lower()
    if name not in FUSED_RECIPES:
        raise TEFusedRecipeError(
            f"{path}: unknown quantization recipe {value!r} from {source}; choose one of "
            f"{', '.join(FUSED_RECIPES)}."
        )
    if check_available:
        check_fused_recipe_runs_here(name, path=path, source=source)
    return name


def check_fused_recipe_runs_here(name: str, *, path: str, source: Optional[str] = None) -> None:
    """Refuses a quantized recipe that this machine's Transformer Engine and GPU cannot run.

    Args:
        name: A :func:`resolve_fused_recipe` result; ``"none"`` runs anywhere.
        path: The class asking, named in the error.
        source: Where the recipe came from (config, environment, default), named in the error
            when known.

    Raises:
        TEFusedRecipeError: The recipe needs hardware (or a TE build) this machine lacks.
    """
    if name == "none":
        return
    available, reason = _recipe_available(name)
    if available:
        return
    origin = f" (from {source})" if source else ""
    raise TEFusedRecipeError(
        f"{path}: the {name!r} recipe{origin} cannot run on this machine ({reason}). Set "
        f"te_fused_recipe='none' in the config (or {_RECIPE_ENV_VAR}=none) to run the fused ops "
        "unquantized, which computes the same math as the unfused MLP."
    )


def _recipe_available(name: str) -> tuple[bool, str]:
    if not te_import.have_te():
        return False, "Transformer Engine cannot be imported"
    probe = getattr(te_import.te.pytorch, f"is_{name}_available", None)
    if callable(probe):
        result = probe(return_reason=True)
        if isinstance(result, tuple):
            return bool(result[0]), str(result[1] or "unsupported by this GPU")
        return bool(result), "unsupported by this GPU"
    # Older TE: both block-scaled recipes need a Blackwell-class GPU (SM 10.0+).
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if major < 10:
        return False, f"needs compute capability 10.0+, this GPU is {major}.{minor}"
    return True, ""


def make_fused_recipe(name: str):
    """The TE recipe object for a :func:`resolve_fused_recipe` name (None for ``"none"``)."""
    if name == "none":
        return None
    recipe_module = te_import.te.common.recipe
    if name == "mxfp8":
        return recipe_module.MXFP8BlockScaling()
    if name == "nvfp4":
        return recipe_module.NVFP4BlockScaling()
    raise TEFusedRecipeError(f"unknown fused recipe {name!r}; choose one of {FUSED_RECIPES}.")


def fused_recipe_model_init(recipe):
    """Context for building ops under ``recipe`` (a no-op for None)."""
    if recipe is None:
        return contextlib.nullcontext()
    init = getattr(te_import.te.pytorch, "quantized_model_init", None)
    if init is not None:
        return init(enabled=True, recipe=recipe)
    return te_import.te.pytorch.fp8_model_init(enabled=True, recipe=recipe)


def fused_recipe_autocast(recipe):
    """Context for running ops under ``recipe`` (a no-op for None)."""
    if recipe is None:
        return contextlib.nullcontext()
    autocast = getattr(te_import.te.pytorch, "autocast", None)
    if autocast is not None:
        return autocast(enabled=True, recipe=recipe)
    return te_import.te.pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe)
