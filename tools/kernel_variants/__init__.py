"""The experiments of tools/benchmark_kernel_variants.py, one module per family."""
