"""Megatron-core fork: the MLP / MoE-expert activation stack, compile-safe and path-consistent."""

from megatron.core.package_info import __version__

__all__ = ["__version__"]
