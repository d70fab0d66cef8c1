"""What a cell of an activation audit says: one vocabulary for both audits and the docs.

``megatron.core.transformer.activation_audit`` (the fork) and ``mcore_activations.upstream_audit``
(an installed upstream megatron-core) print the same words for the same outcome, and the docs
use them too.
"""

from __future__ import annotations

MATCH = "match"  # forward and backward agree with the float64 reference
MISMATCH = "MISMATCH"  # a silent wrong result
REFUSED = "refused"  # this package refused the config at construction, naming why
UPSTREAM_RULE = "upstream config rule"  # upstream's own config / constructor rules reject it
UNAVAILABLE = "unavailable"  # this machine cannot run the path (no TE, no CUDA, GPU too old)
ERROR = "error"  # an exception while running the layer: a bug, reported, never hidden

LEGEND = (
    f"`{MATCH} (e)`: forward and backward agree with the float64 reference; e is the worst "
    f"relative error. `{MISMATCH}`: a silent wrong result. `{REFUSED}`: the layer refused the "
    "config when it was built (UnsupportedActivationError: why, and what to configure "
    f"instead). `{UPSTREAM_RULE}`: upstream megatron-core's own TransformerConfig or layer "
    f"rules reject the combination (this package keeps them). `{UNAVAILABLE}`: this machine "
    f"cannot run the path. `{ERROR}`: an exception while running the layer (a bug)."
)


def reason(text: str, limit: int = 160) -> str:
    """The first line of ``text``, at most ``limit`` characters, cut only between words."""
    lines = str(text).strip().splitlines()
    line = lines[0].strip() if lines else ""
    if len(line) <= limit:
        return line
    head = line[: limit - 2]  # room for "...", and the character after head decides the cut
    if " " not in head:  # one word longer than the limit: keep it whole
        return line.split(" ", 1)[0]
    return head.rsplit(" ", 1)[0].rstrip(" ,;:") + "..."
