"""Exact MLP activations for Megatron-core: one activation spec, its kernels and lowerings.

For an installed upstream megatron-core, one call at the top of a training script::

    import mcore_activations
    mcore_activations.patch_megatron_core().print()  # one line on rank 0

(or ``MCORE_ACTIVATIONS_PATCH=1`` in the environment; docs/using-with-megatron-lm.md). This
module stays light: it imports torch and megatron-core only when the patch is asked for, because
the autopatch .pth file imports it at interpreter start-up.
"""

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "patch_megatron_core",
    "patch_report",
    "unpatch_megatron_core",
]


if __import__("os").environ.get("MCORE_ACTIVATIONS_PATCH", "").strip():
    from mcore_activations import _startup

    _startup.run()


def __getattr__(name):
    if name in ("patch_megatron_core", "unpatch_megatron_core", "patch_report"):
        from mcore_activations import megatron_patch

        return getattr(megatron_patch, name)
    raise AttributeError(f"module 'mcore_activations' has no attribute {name!r}")
