"""Alias of ``mcore_activations.activations`` at upstream's module path.

The activation stack lives in the ``mcore_activations`` package so that it can also patch an
installed upstream megatron-core (docs/using-with-megatron-lm.md); this alias keeps upstream's
module path working in the standalone fork.
"""

import sys

import mcore_activations.activations as _canonical

sys.modules[__name__] = _canonical
