"""``MLP`` computed by one chain of Transformer Engine ops: TEFusedMLP and its grouped variant.

The activation of each class is lowered at construction by the one TE lowering
(``mcore_activations.te_lowering``), so a configuration TE cannot compute is refused when the
layer is built. The ops alias the layer's own parameters: the state dict is exactly ``MLP``'s.
TE is read from the import seam (``mcore_activations.te_import``) at call time.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any, Optional

import torch

from mcore_activations import te_import
from mcore_activations.activation_spec import (
    ActivationSpec,
    fc1_weight_to_blocks,
    fc1_weight_to_halves,
)
from mcore_activations.te_import import (
    TE_GROUPED_OPS_MIN_VERSION,
    TE_OPS_MIN_VERSION,
    require_te,
)
from mcore_activations.te_lowering import TEActivationLowering, plan_te_activation
from megatron.core.extensions.te_linears import (
    TEColumnParallelLinear,
    TELayerNormColumnParallelLinear,
    TERowParallelLinear,
    _is_empty,
    _rng_tracker_function,
)
from megatron.core.extensions.te_recipes import (
    TEFusedRecipeError,
    check_fused_recipe_runs_here,
    fused_recipe_autocast,
    fused_recipe_model_init,
    make_fused_recipe,
    resolve_fused_recipe,
)
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.utils import get_pg_size

__all__ = ["TEFusedMLP", "TEFusedMLPWithGroupedLinear", "TEFusedOpsMixin"]


def _is_ddp_hook(hook: Callable) -> bool:
    # Megatron's DDP / distributed optimizer register forward pre-hooks that wait for parameter
    # all-gathers; those are expected on fused modules and replayed without a warning.
    func = getattr(hook, "func", hook)  # functools.partial
    module = getattr(func, "__module__", "") or ""
    return "distributed" in module


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
                f"{type(self).__name__}: forward hooks of {sorted({n for n, _, _ in post_hooks})} "
                "run after the fused forward, with no arguments and no output (the fused ops "
                "bypass those submodules).",
                stacklevel=3,
            )
        warned: set = set()
        owner = type(self).__name__

        def replay_pre_hooks(_fused, _args):
            # Read the hooks now, not at build time: DDP may install or remove them later.
            for name, module in descendants:
                for hook_id, hook in list(module._forward_pre_hooks.items()):
                    if hook_id in module._forward_pre_hooks_with_kwargs:
                        result = hook(module, (), {})
                    else:
                        result = hook(module, ())
                    if result is not None:
                        raise RuntimeError(
                            f"{owner}: forward pre-hook {hook!r} of submodule {name!r} returned "
                            "a value; the fused ops cannot pass modified inputs to a submodule."
                        )
                    if not _is_ddp_hook(hook) and (name, hook_id) not in warned:
                        warned.add((name, hook_id))
                        warnings.warn(
                            f"{owner}: replaying forward pre-hook {hook!r} of submodule {name!r} "
                            "with empty arguments before the fused forward.",
                            stacklevel=2,
                        )

        def replay_post_hooks(_fused, _args, _output):
            for _name, module, hook in post_hooks:
                hook(module, (), None)

        (pre_hook_target if pre_hook_target is not None else fused).register_forward_pre_hook(
            replay_pre_hooks
        )
        if post_hooks:
            fused.register_forward_hook(replay_post_hooks)

    # -- helpers shared by the fused classes (here and in moe/) --------------------------------

    def _get_te_ops_tensor_parallel_context(self) -> tuple[int, Any]:
        """``(tp_size, tp_group or None)`` of this module (its own group, else fc1's)."""
        group = getattr(self, "tp_group", None)
        if group is None:
            group = getattr(getattr(self, "linear_fc1", None), "tp_group", None)
        size = get_pg_size(group)
        return size, (group if size > 1 else None)

    def _get_te_ops_rng_state_tracker_function(self) -> Optional[Callable]:
        """The RNG tracker getter TE ops would fork for weight init, once it is seeded."""
        return _rng_tracker_function()

    @staticmethod
    def _require_attrs(module, module_name: str, names) -> None:
        missing = [n for n in names if not hasattr(module, n)]
        if missing:
            raise ValueError(
                f"{module_name} ({type(module).__name__}) must be a Megatron Core Transformer "
                f"Engine wrapper; it lacks {', '.join(missing)}."
            )

    def _make_te_ops_norm_from_mcore_te_layernorm_linear(self, module, module_name: str):
        """A ``LayerNorm`` / ``RMSNorm`` op aliasing the norm parameters of a LayerNorm linear."""
        self._require_attrs(module, module_name, ("layer_norm_weight", "normalization", "eps"))
        weight = module.layer_norm_weight
        kwargs = dict(
            eps=module.eps,
            device="meta",
            dtype=weight.dtype,
            zero_centered_gamma=bool(getattr(module, "zero_centered_gamma", False)),
        )
        ops = te_import.te.pytorch.ops
        if module.normalization == "RMSNorm":
            op = ops.RMSNorm(weight.size(0), **kwargs)
        elif module.normalization == "LayerNorm":
            op = ops.LayerNorm(weight.size(0), **kwargs)
            op.bias = module.layer_norm_bias
        else:
            raise ValueError(f"{module_name}: unsupported normalization {module.normalization!r}.")
        op.weight = weight
        return op

    @staticmethod
    def _userbuffers_options(module) -> Optional[dict]:
        """``{"comm_name": ub_name}`` when ``module`` overlaps its communication through TE's
        Userbuffers (``config.tp_comm_overlap`` and a buffer name), as the module itself would;
        None otherwise.

        Raises:
            RuntimeError: The overlap is configured but this TE's ``ops.BasicLinear`` cannot
                take it (it would silently run without the overlap).
        """
        config = getattr(module, "config", None)
        ub_name = getattr(module, "ub_name", None)
        if not (getattr(config, "tp_comm_overlap", False) and ub_name is not None):
            return None
        accepted = inspect.signature(te_import.te.pytorch.ops.BasicLinear.__init__).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
        if "userbuffers_options" not in accepted and not takes_any:
            raise RuntimeError(
                f"tp_comm_overlap=True: this Transformer Engine ({te_import.te_version()}) has no "
                "userbuffers_options on ops.BasicLinear, so the fused TE ops would run without "
                "the Userbuffers overlap. Upgrade Transformer Engine or set tp_comm_overlap=False."
            )
        return {"comm_name": ub_name}

    def _make_te_ops_basic_linear_from_mcore_te_linear(
        self,
        module,
        *,
        module_name: str,
        output_features: Optional[int] = None,
        tensor_parallel_mode: Optional[str] = None,
        tensor_parallel_group=None,
        sequence_parallel: Optional[bool] = None,
        rng_state_tracker_function: Optional[Callable] = None,
    ):
        """A ``BasicLinear`` op aliasing ``module.weight``.

        ``BasicLinear`` takes global feature counts: the split side is multiplied back by the
        tensor-parallel size. A linear that overlaps its communication through Userbuffers
        passes its buffer name on (``_userbuffers_options``).
        """
        self._require_attrs(module, module_name, ("weight",))
        weight = module.weight
        local_out, local_in = weight.shape
        tp_size = get_pg_size(tensor_parallel_group) if tensor_parallel_mode else 1
        in_features = local_in * (tp_size if tensor_parallel_mode == "row" else 1)
        if output_features is None:
            output_features = local_out * (tp_size if tensor_parallel_mode == "column" else 1)
        if sequence_parallel is None:
            sequence_parallel = bool(getattr(module, "sequence_parallel", False))
        userbuffers = self._userbuffers_options(module)
        extra = {} if userbuffers is None else {"userbuffers_options": userbuffers}
        op = te_import.te.pytorch.ops.BasicLinear(
            in_features,
            output_features,
            device="meta",
            dtype=weight.dtype,
            tensor_parallel_mode=tensor_parallel_mode,
            tensor_parallel_group=tensor_parallel_group,
            sequence_parallel=bool(sequence_parallel) and tensor_parallel_mode is not None,
            rng_state_tracker_function=rng_state_tracker_function,
            accumulate_into_main_grad=bool(getattr(module, "fuse_wgrad_accumulation", False)),
            **extra,
        )
        op.weight = weight
        return op

    def _make_te_ops_grouped_linear_from_mcore_te_linear(
        self, module, *, module_name: str, rng_state_tracker_function: Optional[Callable] = None
    ):
        """A one-group ``GroupedLinear`` op (no bias) aliasing ``module.weight`` as ``weight0``."""
        self._require_attrs(module, module_name, ("weight",))
        weight = module.weight
        op = te_import.te.pytorch.ops.GroupedLinear(
            1,
            weight.size(1),
            weight.size(0),
            bias=False,
            device="meta",
            dtype=weight.dtype,
            rng_state_tracker_function=rng_state_tracker_function,
            accumulate_into_main_grad=bool(getattr(module, "fuse_wgrad_accumulation", False)),
        )
        op.weight0 = weight
        return op

    @staticmethod
    def _make_te_ops_bias_from_tensor(bias: Optional[torch.Tensor]):
        """A ``Bias`` op aliasing ``bias``, or None for a missing or empty bias."""
        if _is_empty(bias):
            return None
        op = te_import.te.pytorch.ops.Bias(bias.numel(), device="meta", dtype=bias.dtype)
        op.bias = bias
        return op


# --------------------------------------------------------------------------------- fused MLPs


class TEFusedMLP(TEFusedOpsMixin, MLP):
    """``MLP`` computed by one chain of Transformer Engine ops.

    The ops are ``[norm] -> BasicLinear(fc1) -> [Bias] -> activation -> BasicLinear(fc2) ->
    [AllReduce | ReduceScatter] -> [Bias]``, aliasing the parameters of the module's own TE
    linears: the state dict is exactly :class:`MLP`'s, so weights move between the two freely.

    The activation is lowered in ``__init__`` (:func:`plan_te_activation`) and the linear types
    are checked there too: a config the ops cannot compute exactly fails at construction, never at
    the first forward and never silently. fc1 must be a :class:`TELayerNormColumnParallelLinear`
    (or :class:`TEColumnParallelLinear`) and fc2 a :class:`TERowParallelLinear`.

    Args: as :class:`MLP`.

    Raises:
        ImportError: Transformer Engine is unavailable.
        RuntimeError: Transformer Engine is older than 1.13, or a linear overlaps its
            communication through Userbuffers (``tp_comm_overlap``) and this TE's ops cannot.
        UnsupportedActivationError: TE cannot compute the configured activation
            (:class:`TEVersionError`, also a RuntimeError, when only the TE version is at fault).
        ValueError: fc1 or fc2 is not one of the TE linear wrappers above.
    """

    def __init__(
        self,
        config,
        submodules: MLPSubmodules,
        is_expert: bool = False,
        input_size: Optional[int] = None,
        ffn_hidden_size: Optional[int] = None,
        tp_group=None,
        name: Optional[str] = None,
        pg_collection=None,
    ):
        require_te(type(self).__name__, TE_OPS_MIN_VERSION)
        super().__init__(
            config,
            submodules,
            is_expert=is_expert,
            input_size=input_size,
            ffn_hidden_size=ffn_hidden_size,
            tp_group=tp_group,
            name=name,
            pg_collection=pg_collection,
        )
        # Both checks run now: the ops are built lazily, but a config they cannot run must fail
        # at model build.
        self._setup_fused_activation()
        self._check_fused_linears()

    def _setup_fused_activation(self) -> None:
        """Lowers the activation once, at construction; the ops are built from the result."""
        self._te_activation: Optional[TEActivationLowering] = plan_te_activation(
            self._fused_activation_spec(),
            path=type(self).__name__,
            scaled=False,
            cache_quantized_input=bool(self.config.activation_func_fp8_input_store),
        )

    def _fused_activation_spec(self) -> ActivationSpec:
        spec = getattr(self, "activation_spec", None)
        return spec if spec is not None else ActivationSpec.from_config(self.config)

    def _check_fused_linears(self) -> None:
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        if not isinstance(fc1, TELayerNormColumnParallelLinear | TEColumnParallelLinear):
            raise ValueError(
                f"{type(self).__name__} needs linear_fc1 to be a TELayerNormColumnParallelLinear "
                f"or TEColumnParallelLinear, got {type(fc1).__name__}."
            )
        if not isinstance(fc2, TERowParallelLinear):
            raise ValueError(
                f"{type(self).__name__} needs linear_fc2 to be a TERowParallelLinear, got "
                f"{type(fc2).__name__}."
            )
        for linear in (fc1, fc2):
            self._userbuffers_options(linear)  # a configured overlap this TE cannot run

    def _make_fused_impl(self):
        self._check_fused_linears()
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        tp_size, tp_group = self._get_te_ops_tensor_parallel_context()
        rng = self._get_te_ops_rng_state_tracker_function()
        ops = te_import.te.pytorch.ops
        chain = []
        if isinstance(fc1, TELayerNormColumnParallelLinear):
            chain.append(self._make_te_ops_norm_from_mcore_te_layernorm_linear(fc1, "linear_fc1"))
        chain.append(
            self._make_te_ops_basic_linear_from_mcore_te_linear(
                fc1,
                module_name="linear_fc1",
                tensor_parallel_mode="column" if tp_size > 1 else None,
                tensor_parallel_group=tp_group,
                rng_state_tracker_function=rng,
            )
        )
        fc1_bias = self._make_te_ops_bias_from_tensor(getattr(fc1, "bias", None))
        if fc1_bias is not None:
            chain.append(fc1_bias)
        chain.append(self._te_activation.build())
        # fc2 runs on the local shard; the reduction is its own op so fc2's bias is added once,
        # after it.
        chain.append(
            self._make_te_ops_basic_linear_from_mcore_te_linear(
                fc2, module_name="linear_fc2", rng_state_tracker_function=rng
            )
        )
        if tp_size > 1:
            if getattr(fc2, "sequence_parallel", False):
                chain.append(ops.ReduceScatter(tp_group))
            else:
                chain.append(ops.AllReduce(tp_group))
        if not getattr(fc2, "te_return_bias", False):
            fc2_bias = self._make_te_ops_bias_from_tensor(getattr(fc2, "bias", None))
            if fc2_bias is not None:
                chain.append(fc2_bias)
        return ops.Sequential(*chain)

    def _returned_bias(self) -> Optional[torch.Tensor]:
        fc2 = self.linear_fc2
        bias = getattr(fc2, "bias", None)
        if getattr(fc2, "te_return_bias", False) and not _is_empty(bias):
            return bias
        return None

    def _refuse_per_token_scale(self, per_token_scale) -> None:
        if per_token_scale is not None:
            raise ValueError(
                f"{type(self).__name__} does not apply per_token_scale (MoE router "
                "probabilities); use MLP or the MoE expert classes for scaled tokens."
            )

    def forward(self, hidden_states: torch.Tensor, per_token_scale=None, **kwargs):
        """Returns ``(output, fc2 bias or None)`` like :meth:`MLP.forward`.

        Raises:
            ValueError: ``per_token_scale`` is given (the fused ops would ignore it).
        """
        self._refuse_per_token_scale(per_token_scale)
        fc1 = self.linear_fc1
        if isinstance(fc1, TELayerNormColumnParallelLinear):
            # As the TE LayerNorm linear does in MLP: the norm runs in its weight's dtype.
            hidden_states = hidden_states.to(fc1.layer_norm_weight.dtype)
        return self._get_fused_impl()(hidden_states), self._returned_bias()


class TEFusedMLPWithGroupedLinear(TEFusedMLP):
    """Dense ``MLP`` computed by TE's grouped-MLP ops (one group), optionally quantized.

    With tensor parallelism 1 the ops are ``GroupedLinear(fc1) -> Scaled<activation> ->
    GroupedLinear(fc2)`` with unit row scales, the chain TE fuses into one grouped-MLP kernel on
    SM100 GPUs under an MXFP8/NVFP4 recipe; the norm of a LayerNorm fc1 runs before it,
    unquantized. With tensor parallelism > 1 the class runs :class:`TEFusedMLP`'s ops.

    The recipe is chosen at construction by :func:`resolve_fused_recipe` (``"mxfp8"`` by
    default, as upstream; ``"none"`` runs unquantized and is what a GPU without MXFP8/NVFP4, such
    as an H200, must use). Whether this machine can run it is checked at the first forward that
    uses it, so a model can be built on a CPU or the meta device and moved to the GPU later. The
    activation is lowered at construction to its ``Scaled*`` op.

    Args:
        config, submodules, is_expert, input_size, ffn_hidden_size, tp_group, name,
        pg_collection: as :class:`MLP`.
        glu_interleave_size: Store fc1's gated rows block-interleaved (blocks of this many rows,
            a multiple of 32) so that the Scaled GLU op reads them in TE's interleaved layout, as
            TE's fused grouped-MLP kernel requires (32). The state dict stays in MLP's
            ``[gate; linear]`` layout: it is converted on save and load. Default None: fc1 is
            kept in MLP's layout and read as halves (the SM100 kernel then declines to fuse).

    Raises:
        RuntimeError: Transformer Engine is older than 2.14.
        ValueError: ``add_bias_linear`` is set; ``glu_interleave_size`` does not divide the
            per-rank FFN width.
        TEFusedRecipeError: The chosen recipe is unknown (at construction), is named in the
            config's ``te_fused_recipe`` as a quantized recipe at tensor-parallel size > 1 (at
            construction: those ops run unquantized), or cannot run on this machine (at the
            first forward).
        UnsupportedActivationError: TE's grouped ops cannot compute the activation.
    """

    def __init__(
        self,
        config,
        submodules: MLPSubmodules,
        is_expert: bool = False,
        input_size: Optional[int] = None,
        ffn_hidden_size: Optional[int] = None,
        tp_group=None,
        name: Optional[str] = None,
        pg_collection=None,
        *,
        glu_interleave_size: Optional[int] = None,
    ):
        require_te(type(self).__name__, TE_GROUPED_OPS_MIN_VERSION)
        if config.add_bias_linear:
            raise ValueError(
                f"{type(self).__name__} does not support add_bias_linear=True: TE's grouped "
                "fused ops here carry no biases."
            )
        if glu_interleave_size is not None and not config.gated_linear_unit:
            raise ValueError(
                f"{type(self).__name__}: glu_interleave_size applies to gated activations only."
            )
        # Resolved before the linears are allocated, so an unknown recipe fails fast; the
        # hardware is asked in _recipe(). Plain attributes may be set before nn.Module.__init__;
        # TEFusedMLP.__init__ reads them back.
        self.fused_recipe_name = resolve_fused_recipe(config, path=type(self).__name__)
        self.glu_interleave_size = glu_interleave_size
        super().__init__(
            config,
            submodules,
            is_expert=is_expert,
            input_size=input_size,
            ffn_hidden_size=ffn_hidden_size,
            tp_group=tp_group,
            name=name,
            pg_collection=pg_collection,
        )
        self._norm_seq: Optional[tuple[Any]] = None
        self._fused_recipe: Optional[tuple[Any]] = None
        if glu_interleave_size is not None:
            self._check_interleave_divides_ffn(glu_interleave_size)
            self.register_state_dict_post_hook(fc1_weight_to_halves)
            self.register_load_state_dict_pre_hook(fc1_weight_to_blocks)

    def _setup_fused_activation(self) -> None:
        spec = self._fused_activation_spec()
        name = type(self).__name__
        tp_size, _ = self._get_te_ops_tensor_parallel_context()
        if tp_size > 1:
            # TEFusedMLP's unscaled ops run instead (see forward), unquantized, as upstream's
            # class does. A recipe the config asks for by name would then silently not apply.
            requested = getattr(self.config, "te_fused_recipe", None)
            if requested not in (None, "none"):
                raise TEFusedRecipeError(
                    f"{name}: te_fused_recipe={requested!r} cannot apply at tensor-parallel "
                    f"size {tp_size}, where this class runs TEFusedMLP's unquantized ops. Leave "
                    "te_fused_recipe unset (or 'none') with tensor parallelism, or use "
                    "tensor_model_parallel_size=1 for the quantized grouped ops."
                )
            self._te_activation = plan_te_activation(
                spec,
                path=f"{name} (tensor-parallel, TEFusedMLP ops)",
                scaled=False,
                glu_interleave_size=self.glu_interleave_size,
                cache_quantized_input=bool(self.config.activation_func_fp8_input_store),
            )
            self._grouped_te_activation = None
        else:
            self._te_activation = None
            self._grouped_te_activation = plan_te_activation(
                spec, path=name, scaled=True, glu_interleave_size=self.glu_interleave_size
            )

    def _check_interleave_divides_ffn(self, k: int) -> None:
        rows = self.linear_fc1.weight.size(0)  # local [gate; linear] rows
        if (rows // 2) % k:
            raise ValueError(
                f"{type(self).__name__}: glu_interleave_size={k} must divide the per-rank FFN "
                f"width {rows // 2}."
            )

    def _reset_fused_impl(self) -> None:
        super()._reset_fused_impl()
        self._norm_seq = None

    def _register_hooks_on_fused_impl(self, fused, *, pre_hook_target=None) -> None:
        # The norm runs before the grouped ops and reads fc1's norm parameters, so the replayed
        # pre-hooks (e.g. a parameter all-gather) must run before it.
        if pre_hook_target is None and self._norm_seq is not None:
            pre_hook_target = self._norm_seq[0]
        super()._register_hooks_on_fused_impl(fused, pre_hook_target=pre_hook_target)

    def _tensor_parallel(self) -> bool:
        return self._get_te_ops_tensor_parallel_context()[0] > 1

    def _recipe(self):
        if self._fused_recipe is None:
            # Once, on first use (the first forward): the GPU is only known where the model runs.
            # A refusal leaves the cache empty, so every later forward refuses again.
            check_fused_recipe_runs_here(self.fused_recipe_name, path=type(self).__name__)
            self._fused_recipe = (make_fused_recipe(self.fused_recipe_name),)
        return self._fused_recipe[0]

    def _make_fused_impl(self):
        if self._tensor_parallel():
            return super()._make_fused_impl()
        self._check_fused_linears()
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        rng = self._get_te_ops_rng_state_tracker_function()
        ops = te_import.te.pytorch.ops
        with fused_recipe_model_init(self._recipe()):
            if isinstance(fc1, TELayerNormColumnParallelLinear):
                norm = self._make_te_ops_norm_from_mcore_te_layernorm_linear(fc1, "linear_fc1")
                self._norm_seq = (ops.Sequential(norm),)
            else:
                self._norm_seq = None
            fc1_op = self._make_te_ops_grouped_linear_from_mcore_te_linear(
                fc1, module_name="linear_fc1", rng_state_tracker_function=rng
            )
            activation = self._grouped_te_activation.build()
            # The row scales are always ones here; TE's fused kernel may then skip them.
            activation._grouped_mlp_unit_activation_scale = True
            fc2_op = self._make_te_ops_grouped_linear_from_mcore_te_linear(
                fc2, module_name="linear_fc2", rng_state_tracker_function=rng
            )
        return ops.Sequential(fc1_op, activation, fc2_op)

    def forward(self, hidden_states: torch.Tensor, per_token_scale=None, **kwargs):
        """Returns ``(output, None)`` like :meth:`MLP.forward` (the class has no biases).

        Raises:
            ValueError: ``per_token_scale`` is given.
        """
        if self._tensor_parallel():
            return super().forward(hidden_states, per_token_scale, **kwargs)
        self._refuse_per_token_scale(per_token_scale)
        fused = self._get_fused_impl()
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        rows = x.size(0)
        split_sizes = torch.full((1,), rows, dtype=torch.int64, device=x.device)
        scales = torch.ones(rows, dtype=x.dtype, device=x.device)
        if self._norm_seq is not None:
            # The norm stays outside the recipe, as upstream: its output feeds the quantized GEMM.
            x = self._norm_seq[0](x.to(self.linear_fc1.layer_norm_weight.dtype))
        with fused_recipe_autocast(self._recipe()):
            out = fused(x, split_sizes, scales, split_sizes)
        return out.reshape(*shape[:-1], out.size(-1)), None
