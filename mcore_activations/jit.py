"""The decorator megatron.core applies to its fusable elementwise functions.

``jit_fuser`` is ``torch.compile`` on torch >= 2.2 and ``torch.jit.script`` before. Consumers do
``from megatron.core.jit import jit_fuser`` at import time, so the decorator in force when a module
is first imported is the one it keeps; toggling later does not re-decorate.

Compile safety: a function decorated with ``jit_fuser`` must take tensors only. A Python float
argument is traced as a dynamic scalar, and torch's AOTAutograd cache can then serve code compiled
for an earlier value (see docs/compile-safety.md). ``tools/check_compiled_scalars.py`` enforces this
rule in CI.
"""

import torch

from mcore_activations.versions import is_torch_min_version


def noop_decorator(func):
    """Returns ``func`` unchanged (used when JIT fusion is disabled)."""
    return func


jit_fuser = torch.jit.script


def enable_jit_fuser():
    """Selects ``torch.compile`` (torch >= 2.2) or ``torch.jit.script`` as ``jit_fuser``."""
    global jit_fuser
    try:
        if is_torch_min_version("2.2.0a0"):
            jit_fuser = torch.compile
    except ImportError:
        # ``packaging`` missing: version unknown, do not fuse.
        jit_fuser = noop_decorator


def disable_jit_fuser():
    """Makes ``jit_fuser`` a no-op for modules imported afterwards."""
    global jit_fuser
    jit_fuser = noop_decorator


enable_jit_fuser()
