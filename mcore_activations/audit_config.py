"""``--config FILE`` of both activation audits: the user's own activations, as JSON.

The fork's audit (``megatron.core.transformer.activation_audit``) and the upstream audit
(``mcore-activations-audit``) read the same file format; each passes the activation functions of
the megatron-core it audits (upstream compares some by identity) and its own config check.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping

# activation_func by name: the names a --config file (and the activation catalogue) uses.
FUNCTION_NAMES = ("silu", "gelu", "fast_gelu", "quick_gelu", "relu", "squared_relu")

# The fields one activation is described by, besides activation_func.
ACTIVATION_OPTIONS = (
    "gated_linear_unit",
    "activation_func_clamp_value",
    "activation_func_tanh_clamp_scale",
    "activation_func_tanh_clamp_scale_linear",
    "glu_linear_offset",
)

# What a --config file may set: the activation fields, and the options that change what the
# activation path sees (fc1's bias, the saved-input precision, the experts' GLU layout).
CONFIG_FILE_FIELDS = (
    "activation_func",
    *ACTIVATION_OPTIONS,
    "activation_func_fp8_input_store",
    "add_bias_linear",
    "moe_mlp_glu_interleave_size",
)

EXAMPLE = (
    '{"name": "my-moe", "activation_func": "silu", "gated_linear_unit": true, '
    '"activation_func_clamp_value": 7}'
)


def load_config_file(
    path: str, functions: Mapping[str, Callable], check: Callable[[dict], str]
) -> dict:
    """``{column name: TransformerConfig kwargs}`` from a JSON file of one object or a list.

    Each object sets ``activation_func`` (a name in ``functions``) and any of
    :data:`CONFIG_FILE_FIELDS`, plus an optional ``"name"`` for its column, e.g. :data:`EXAMPLE`.

    Args:
        path: The JSON file.
        functions: Activation function names -> the callables of the audited megatron-core.
        check: Builds the config from kwargs and returns the activation's name; raises
            ``ValueError`` / ``TypeError`` for a configuration it refuses.

    Raises:
        ValueError: Unreadable JSON, an unknown field or function, or a configuration ``check``
            refuses; the message names the file, the entry and what to change.
    """
    try:
        with open(path) as fh:
            entries = json.load(fh)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {path}: {err}") from err
    entries = entries if isinstance(entries, list) else [entries]
    to_run = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: entry {i} is not a JSON object, e.g. {EXAMPLE}")
        entry = dict(entry)
        name = entry.pop("name", None)
        unknown = sorted(set(entry) - set(CONFIG_FILE_FIELDS))
        if unknown:
            raise ValueError(
                f"{path}: entry {i} sets {', '.join(unknown)}; the audit takes "
                f"{', '.join(CONFIG_FILE_FIELDS)}"
            )
        func = entry.get("activation_func")
        if func not in functions:
            raise ValueError(
                f"{path}: entry {i} needs activation_func, one of {', '.join(sorted(functions))}; "
                f"got {func!r}"
            )
        kwargs = {**entry, "activation_func": functions[func]}
        try:
            label = check(kwargs)
        except (ValueError, TypeError, AssertionError) as err:
            raise ValueError(f"{path}: entry {i} is not a valid configuration: {err}") from err
        to_run[name or label] = kwargs
    return to_run
