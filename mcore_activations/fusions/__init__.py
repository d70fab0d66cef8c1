"""Fused activation kernels and upstream megatron-core's fused entry points (same names)."""
