"""``MLP`` computed by one chain of Transformer Engine ops: TEFusedMLP and its grouped variant.

The activation of each class is lowered at construction by the one TE lowering
(``mcore_activations.te_lowering``), so a configuration TE cannot compute is refused when the
layer is built. The ops alias the layer's own parameters: the state dict is exactly ``MLP``'s.
TE is read from the import seam (``mcore_activations.te_import``) at call time.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from mcore_activations import te_import
from mcore_activations.activation_spec import (
    ActivationSpec,
    UnsupportedActivationError,
    fc1_weight_to_blocks,
    fc1_weight_to_halves,
)
from mcore_activations.te_import import TE_GROUPED_OPS_MIN_VERSION, TE_OPS_MIN_VERSION
from mcore_activations.te_lowering import TEActivationLowering, TEVersionError, plan_te_activation
from megatron.core.extensions.te_fused_ops import TEFusedOpsMixin, tensor_parallel_context
from megatron.core.extensions.te_linears import (
    TEColumnParallelLinear,
    TELayerNormColumnParallelLinear,
    TERowParallelLinear,
    _is_empty,
)
from megatron.core.extensions.te_ops_adapters import _te_ops_userbuffers_options
from megatron.core.extensions.te_public import require_te_min_version
from megatron.core.extensions.te_recipes import (
    TEFusedRecipeError,
    check_fused_recipe_runs_here,
    fused_recipe_autocast,
    fused_recipe_model_init,
    make_fused_recipe,
    resolve_fused_recipe,
)
from megatron.core.transformer.mlp import MLP, MLPSubmodules

# TEFusedOpsMixin lives in te_fused_ops (the fused norm uses it too); importable here as before.
__all__ = ["TEFusedMLP", "TEFusedMLPWithGroupedLinear", "TEFusedOpsMixin"]


def _is_te_module(module: Any, name: str) -> bool:
    """Whether ``module`` is an instance of TE's own ``te.pytorch.<name>`` (read at call time;
    False where TE has no such class)."""
    cls = getattr(getattr(te_import.te, "pytorch", None), name, None)
    return isinstance(cls, type) and isinstance(module, cls)


def _is_layer_norm_linear(module: Any) -> bool:
    """A linear that applies the pre-MLP norm itself: the Megatron wrapper or TE's class."""
    return isinstance(module, TELayerNormColumnParallelLinear) or _is_te_module(
        module, "LayerNormLinear"
    )


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
        require_te_min_version(type(self).__name__, TE_OPS_MIN_VERSION)
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

    def _check_fc2_chunks(self, is_expert: bool) -> None:
        # The op chain runs fc2 once on the whole input: the fc2-chunks option does not reach it.
        return None

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
        # "FC1" / "FC2" as in upstream's messages, which callers match.
        if not isinstance(fc1, TELayerNormColumnParallelLinear | TEColumnParallelLinear):
            raise ValueError(
                f"{type(self).__name__} expects FC1 (linear_fc1) to be a "
                "TELayerNormColumnParallelLinear or TEColumnParallelLinear, but found "
                f"{type(fc1).__name__}."
            )
        if not isinstance(fc2, TERowParallelLinear):
            raise ValueError(
                f"{type(self).__name__} expects FC2 (linear_fc2) to be a TERowParallelLinear, but "
                f"found {type(fc2).__name__}."
            )
        for linear in (fc1, fc2):
            _te_ops_userbuffers_options(linear)  # a configured overlap this TE cannot run

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
                # Only meaningful with a split: one rank has no sequence to gather.
                sequence_parallel=tp_size > 1 and bool(getattr(fc1, "sequence_parallel", False)),
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
    unquantized. With tensor parallelism > 1 the class runs :class:`TEFusedMLP`'s ops. At
    tensor-parallel size 1 fc1 / fc2 may also be TE's own ``LayerNormLinear`` / ``Linear``, as
    upstream's class allows.

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
        cls_name = type(self).__name__
        require_te_min_version(
            cls_name,
            TE_GROUPED_OPS_MIN_VERSION,
            needs="pytorch.ops.GroupedLinear and its Scaled ops",
        )
        if config.add_bias_linear:
            raise ValueError(
                f"{cls_name} does not support add_bias_linear=True: TE's grouped fused ops here "
                "carry no biases."
            )
        if glu_interleave_size is not None and not config.gated_linear_unit:
            raise ValueError(f"{cls_name}: glu_interleave_size applies to gated activations only.")
        # Checked before the linears are allocated, as the rules above, and by this class itself:
        # whatever the base initializer does, a configuration these ops cannot compute fails here.
        self._plan_activation(
            config,
            ActivationSpec.from_config(config),
            self._tensor_parallel_size_of(tp_group, pg_collection),
            glu_interleave_size,
        )
        # Resolved before the linears are allocated, so an unknown recipe fails fast; the
        # hardware is asked in _quantization_recipe(). Plain attributes may be set before
        # nn.Module.__init__; TEFusedMLP.__init__ reads them back.
        self.fused_recipe_name = resolve_fused_recipe(config, path=cls_name)
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
        if glu_interleave_size is not None:
            self._check_interleave_divides_ffn(glu_interleave_size)
            self.register_state_dict_post_hook(fc1_weight_to_halves)
            self.register_load_state_dict_pre_hook(fc1_weight_to_blocks)

    @staticmethod
    def _tensor_parallel_size_of(tp_group, pg_collection) -> int:
        # The group MLP.__init__ will take, before it exists: the one passed, else the global one.
        group = tp_group if tp_group is not None else getattr(pg_collection, "tp", None)
        return tensor_parallel_context(group)[0]

    def _setup_fused_activation(self) -> None:
        tp_size, _ = self._get_te_ops_tensor_parallel_context()
        self._plan_activation(
            self.config, self._fused_activation_spec(), tp_size, self.glu_interleave_size
        )

    def _plan_activation(
        self, config, spec: ActivationSpec, tp_size: int, glu_interleave_size
    ) -> None:
        """Lowers ``spec`` to the op this class runs at ``tp_size``, or refuses it.

        Raises:
            TEFusedRecipeError: A quantized recipe is named at tensor-parallel size > 1.
            UnsupportedActivationError: The ops cannot compute ``spec``.
        """
        name = type(self).__name__
        if tp_size > 1:
            # TEFusedMLP's unscaled ops run instead (see forward), unquantized, as upstream's
            # class does. A recipe the config asks for by name would then silently not apply.
            requested = getattr(config, "te_fused_recipe", None)
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
                glu_interleave_size=glu_interleave_size,
                cache_quantized_input=bool(config.activation_func_fp8_input_store),
            )
            self._grouped_te_activation = None
            return
        try:
            grouped = plan_te_activation(
                spec, path=name, scaled=True, glu_interleave_size=glu_interleave_size
            )
        except TEVersionError:
            raise
        except UnsupportedActivationError as error:
            # Upstream's class names SwiGLU as its requirement; this one computes more, says
            # so, and keeps the lowering's reason.
            raise type(error)(
                f"{name} requires SwiGLU activation (activation_func=F.silu, "
                "gated_linear_unit=True) or another activation its Scaled TE ops compute "
                f"exactly. {error}"
            ) from error
        self._te_activation = None
        self._grouped_te_activation = grouped

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

    def _check_fused_linears(self) -> None:
        if self._tensor_parallel():
            return super()._check_fused_linears()  # TEFusedMLP's ops run, on its linears
        # The grouped ops read only a linear's weight, its wgrad flag and (fc1) its norm
        # parameters, which TE's own modules have as the Megatron wrappers do.
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        if not (isinstance(fc1, TEColumnParallelLinear) or _is_layer_norm_linear(fc1)):
            raise ValueError(
                f"{type(self).__name__} expects FC1 (linear_fc1) to be a "
                "TELayerNormColumnParallelLinear, TEColumnParallelLinear or Transformer Engine "
                f"LayerNormLinear, but found {type(fc1).__name__}."
            )
        if not (isinstance(fc2, TERowParallelLinear) or _is_te_module(fc2, "Linear")):
            raise ValueError(
                f"{type(self).__name__} expects FC2 (linear_fc2) to be a TERowParallelLinear or "
                f"Transformer Engine Linear, but found {type(fc2).__name__}."
            )
        for linear in (fc1, fc2):
            _te_ops_userbuffers_options(linear)  # a configured overlap this TE cannot run

    def _quantization_recipe(self):
        """The TE recipe object (None for ``"none"``), made on first use and kept as ``_recipe``,
        upstream's attribute.

        Made at the first forward: the GPU is only known where the model runs. A refusal keeps
        nothing, so every later forward refuses again.
        """
        if "_recipe" not in self.__dict__:
            name = self.__dict__.get("fused_recipe_name")
            if name is None:  # an instance made without __init__: upstream's choice, at call time
                name = resolve_fused_recipe(None, path=type(self).__name__)
            check_fused_recipe_runs_here(name, path=type(self).__name__)
            self._recipe = make_fused_recipe(name)
        return self._recipe

    def _get_fused_impl(self):
        if self._tensor_parallel():
            return super()._get_fused_impl()
        if self._fused_impl is None:
            # The grouped ops are made under the recipe, so that TE allocates their weights'
            # quantized forms; _make_fused_impl hooks them itself, as upstream's does.
            with fused_recipe_model_init(self._quantization_recipe()):
                self._fused_impl = (self._make_fused_impl(),)
        return self._fused_impl[0]

    def _make_fused_impl(self):
        if self._tensor_parallel():
            return super()._make_fused_impl()
        self._check_fused_linears()
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        rng = self._get_te_ops_rng_state_tracker_function()
        ops = te_import.te.pytorch.ops
        # The norm runs apart from the recipe (see forward); it holds no weight a recipe would
        # quantize (fc1's is aliased).
        self._norm_seq = None
        if _is_layer_norm_linear(fc1):
            norm_seq = ops.Sequential()
            norm_seq.append(
                self._make_te_ops_norm_from_mcore_te_layernorm_linear(fc1, "linear_fc1")
            )
            self._norm_seq = (norm_seq,)
        fused = ops.Sequential()
        fused.append(
            self._make_te_ops_grouped_linear_from_mcore_te_linear(
                fc1, module_name="linear_fc1", rng_state_tracker_function=rng
            )
        )
        activation = self._grouped_te_activation.build()
        # The row scales are always ones here; TE's fused kernel may then skip them.
        activation._grouped_mlp_unit_activation_scale = True
        fused.append(activation)
        fused.append(
            self._make_te_ops_grouped_linear_from_mcore_te_linear(
                fc2, module_name="linear_fc2", rng_state_tracker_function=rng
            )
        )
        self._register_hooks_on_fused_impl(fused)
        return fused

    def forward(self, hidden_states: torch.Tensor, per_token_scale=None, **kwargs):
        """Returns ``(output, None)`` like :meth:`MLP.forward` (the class has no biases).

        Raises:
            ValueError: ``per_token_scale`` is given.
        """
        if self._tensor_parallel():
            # As upstream's class: the caller's keywords go on to TEFusedMLP.forward as given.
            if per_token_scale is not None:
                kwargs["per_token_scale"] = per_token_scale
            return super().forward(hidden_states, **kwargs)
        self._refuse_per_token_scale(per_token_scale)
        fused = self._get_fused_impl()
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        rows = x.size(0)
        split_sizes = torch.full((1,), rows, dtype=torch.int64, device=x.device)
        scales = torch.ones(rows, dtype=x.dtype, device=x.device)
        if self._norm_seq is not None:
            # The norm stays outside the recipe, as upstream: its output feeds the quantized GEMM.
            norm_weight = getattr(getattr(self, "linear_fc1", None), "layer_norm_weight", None)
            x = self._norm_seq[0](x if norm_weight is None else x.to(norm_weight.dtype))
        with fused_recipe_autocast(self._quantization_recipe()):
            out = fused(x, split_sizes, scales, split_sizes)
        return out.reshape(*shape[:-1], out.size(-1)), None
