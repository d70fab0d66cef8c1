"""The pieces of :mod:`mcore_activations.megatron_patch`, one file per job.

- ``upstream``: which megatron-core is installed, its fingerprints and its capabilities;
- ``report``: the :class:`~mcore_activations.upstream_patch.report.PatchReport` a patch returns;
- ``patcher``: the undo log and report lines every target patcher writes through, and the
  helpers they share;
- one target patcher per upstream place: ``entry_points`` (the fused activation functions),
  ``mlp``, ``shared_experts``, ``grouped_experts`` and ``te_fused`` (Transformer Engine's fused
  MLP classes).

``megatron_patch`` runs the target patchers in order; nothing here imports it.
"""
