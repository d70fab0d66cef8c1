"""``TEFusedOpsMixin``: runs a Megatron module through one chain of Transformer Engine ops.

The mixin owns the lifecycle every fused TE class shares (``TEFusedMLP``,
``TEFusedMLPWithGroupedLinear``, ``TEFusedResidualRMSNorm``): the ops are built lazily, cached
outside the module tree, and made to replay the skipped submodules' hooks. The operations
themselves come from the builders in ``te_ops_adapters``, which the mixin's helper methods
delegate to.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Optional

from megatron.core.extensions import te_ops_adapters as adapters
from megatron.core.parallel_state import get_tensor_model_parallel_group

__all__ = ["TEFusedOpsMixin", "tensor_parallel_context"]


def _is_ddp_hook(hook: Callable) -> bool:
    # Megatron's DDP / distributed optimizer register forward pre-hooks that wait for parameter
    # all-gathers; those are expected on fused modules and replayed without a warning.
    func = getattr(hook, "func", hook)  # functools.partial
    module = getattr(func, "__module__", "") or ""
    return "distributed" in module


def tensor_parallel_context(group) -> tuple[int, Any]:
    """``(tp_size, group or None)`` for ``group``, or for parallel_state's group when None.

    parallel_state's size (``group`` None or parallel_state's own group) is asked at each call
    through the public module, as upstream asks it, so a patch of
    ``transformer_engine.get_tensor_model_parallel_world_size`` decides; a group of the module's
    own answers for itself.
    """
    if group is not None and group is not get_tensor_model_parallel_group(check_initialized=False):
        return adapters._get_te_ops_tensor_parallel_context(group)
    try:
        return adapters._get_te_ops_tensor_parallel_context(None)
    except AssertionError:
        # parallel_state has no tensor-parallel group (a model built before or without
        # initialize_model_parallel): the module runs on this rank alone.
        return 1, None


class TEFusedOpsMixin:
    """Runs a Megatron module through one ``te.pytorch.ops.Sequential`` built from its parts.

    Put it before the concrete class (``class X(TEFusedOpsMixin, MLP)``). The subclass defines
    :meth:`_make_fused_impl`; ops are built lazily on the first :meth:`_get_fused_impl` call and
    alias the module's own parameters, so the module's ``state_dict`` and ``parameters()`` are
    unchanged. The cache is a 1-tuple: an ``nn.Module`` stored in a tuple is not a submodule, so
    the ops never appear in ``state_dict``, ``parameters`` or ``named_modules``.

    The fused forward bypasses the submodules' ``forward``, so their forward hooks would not run.
    When the ops are built, the submodules' forward pre-hooks are replayed (with empty args) before
    each fused forward, and their forward post-hooks (captured at build time) after it, with a
    warning. Backward hooks on submodules cannot be honoured and are refused.

    The ``_make_te_ops_*`` helpers are the builders of ``te_ops_adapters`` (upstream's
    module-level functions of ``transformer_engine``), also reachable as methods here.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._fused_impl: Optional[tuple[Any]] = None

    def _make_fused_impl(self):
        """Builds the ``te.pytorch.ops.Sequential`` computing this module."""
        raise NotImplementedError(f"{type(self).__name__} must implement _make_fused_impl().")

    def _get_fused_impl(self):
        """The cached ops, built (and hooked) on first use."""
        if self._fused_impl is None:
            fused = self._make_fused_impl()
            self._register_hooks_on_fused_impl(fused)
            self._fused_impl = (fused,)
        return self._fused_impl[0]

    def _reset_fused_impl(self) -> None:
        """Drops the cached ops (e.g. after replacing a parameter); the next call rebuilds them."""
        self._fused_impl = None

    def _register_hooks_on_fused_impl(self, fused, *, pre_hook_target=None) -> None:
        """Makes ``fused`` run the submodules' hooks (see the class docstring).

        Args:
            fused: The ops; the replayed forward post-hooks run after it.
            pre_hook_target: The module that runs first, when it is not ``fused`` (e.g. a norm
                run separately); the replayed forward pre-hooks run before it.
        """
        descendants = [(name, m) for name, m in self.named_modules() if m is not self]
        for name, module in descendants:
            if module._backward_hooks or module._backward_pre_hooks:
                raise RuntimeError(
                    f"{type(self).__name__}: submodule {name!r} has backward hooks, which the "
                    "fused Transformer Engine ops cannot run (they bypass the submodule)."
                )
        post_hooks = [
            (name, module, hook)
            for name, module in descendants
            for hook in module._forward_hooks.values()
        ]
        if post_hooks:
            warnings.warn(
                f"{type(self).__name__}: the post-forward hooks of submodules "
                f"{sorted({n for n, _, _ in post_hooks})} run after the fused forward, with no "
                "arguments and no output (the fused ops bypass those submodules).",
                stacklevel=3,
            )
        warned: set = set()
        owner = type(self).__name__

        def replay_pre_hooks(_fused, _args):
            # Read the hooks now, not at build time: DDP may install or remove them later.
            for name, module in descendants:
                for hook_id, hook in list(module._forward_pre_hooks.items()):
                    # Warned before the hook runs, so a hook that then fails is explained too.
                    if not _is_ddp_hook(hook) and (name, hook_id) not in warned:
                        warned.add((name, hook_id))
                        warnings.warn(
                            f"{owner}: replaying pre-forward hook {hook!r} of submodule {name!r} "
                            "with empty arguments before the fused forward (the fused ops do not "
                            "expose the submodule's input).",
                            stacklevel=2,
                        )
                    if hook_id in module._forward_pre_hooks_with_kwargs:
                        result = hook(module, (), {})
                    else:
                        result = hook(module, ())
                    if result is not None:
                        raise RuntimeError(
                            f"{owner}: pre-forward hook {hook!r} of submodule {name!r} returned "
                            "a value: it modifies input tensors, which the fused ops cannot pass "
                            "to a submodule."
                        )

        def replay_post_hooks(_fused, _args, _output):
            for _name, module, hook in post_hooks:
                hook(module, (), None)

        (pre_hook_target if pre_hook_target is not None else fused).register_forward_pre_hook(
            replay_pre_hooks
        )
        if post_hooks:
            fused.register_forward_hook(replay_post_hooks)

    # -- op builders (te_ops_adapters), under the names the fused classes call ---------------

    def _get_te_ops_tensor_parallel_context(self) -> tuple[int, Any]:
        """``(tp_size, tp_group or None)`` of this module: its own group, else fc1's, else
        parallel_state's tensor-parallel size."""
        group = getattr(self, "tp_group", None)
        if group is None:
            group = getattr(getattr(self, "linear_fc1", None), "tp_group", None)
        return tensor_parallel_context(group)

    _get_te_ops_rng_state_tracker_function = staticmethod(
        adapters._get_te_ops_rng_state_tracker_function
    )
    _make_te_ops_rmsnorm_from_te_rmsnorm = staticmethod(
        adapters._make_te_ops_rmsnorm_from_te_rmsnorm
    )
    _make_te_ops_norm_from_mcore_te_layernorm_linear = staticmethod(
        adapters._make_te_ops_norm_from_mcore_te_layernorm_linear
    )
    _make_te_ops_basic_linear_from_mcore_te_linear = staticmethod(
        adapters._make_te_ops_basic_linear_from_mcore_te_linear
    )
    _make_te_ops_grouped_linear_from_mcore_te_linear = staticmethod(
        adapters._make_te_ops_grouped_linear_from_mcore_te_linear
    )
    _make_te_ops_bias_from_tensor = staticmethod(adapters._make_te_ops_bias_from_tensor)
