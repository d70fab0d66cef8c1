"""The compiled-scalar checker's parts; ``tools/check_compiled_scalars.py`` is its entry point.

The specification of what it reports and which guards it accepts is docs/compiled-scalar-checker.md.
"""
