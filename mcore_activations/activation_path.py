"""How an MLP layer computes its activation: one decision at construction, one call per forward.

A layer (``MLP``, the routed experts, the shared experts; the fork's classes and, through
``mcore_activations.megatron_patch``, upstream's) turns its config into an
:class:`ActivationSpec` and builds a :class:`LayerActivation` for it once, at construction
(:func:`select_layer_activation`, or :func:`select_activation_path` for a layer that already
holds its callable), which picks the path and refuses what that path cannot compute; every
forward calls that object:

- **Transformer Engine module** (``use_te_activation_func`` with a TE activation builder): TE's
  activation module. It takes no clamp, tanh scale or offset, so such a spec is refused.
- **Fused kernels** (``bias_activation_fusion``): the fused kernels of ``fused_activation``, which
  fuse the bias add, every non-custom spec (clamps, SiTU-GLU, offsets) and the per-row
  probabilities; their variants and parameters are derived at construction.
- **Unfused** (otherwise): :func:`unfused_activation`, plain torch ops calling the configured
  ``activation_func`` itself, so any callable works.

All three compute what :meth:`ActivationSpec.reference` defines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Optional

import torch

from mcore_activations.activation_spec import (
    ActivationSpec,
    UnsupportedActivationError,
    deinterleave_glu,
    unfused_activation,
)
from mcore_activations.fusions import in_place, output_recompute
from mcore_activations.fusions.activation_ops import kernel_backend, use_kernel_backend
from mcore_activations.fusions.fused_activation import (
    fused_activation_into,
    fused_activation_with_plan,
    lower_to_fused_kernel,
)
from mcore_activations.fusions.kernel_plan import KernelPlan
from mcore_activations.te_import import have_te

TE_MODULE_PATH = "te_module"
FUSED_KERNEL_PATH = "fused_kernel"
UNFUSED_PATH = "unfused"


def select_activation_path(
    config,
    spec: ActivationSpec,
    has_te_activation_builder: bool,
    owner: str,
    *,
    moe_act_on_graph: bool = False,
) -> str:
    """Chooses how a layer computes ``spec``, refusing what that path cannot compute.

    Args:
        config: Source of the path flags ``use_te_activation_func`` and
            ``bias_activation_fusion`` (a ``TransformerConfig``, the fork's or upstream's).
        spec: The activation to compute.
        has_te_activation_builder: The layer's submodules name a TE activation module.
            ``use_te_activation_func`` without one (e.g. with the local layer spec) computes the
            same activation on the unfused path.
        owner: The layer's class name, used in error messages.
        moe_act_on_graph: The layer runs a ``moe_act`` recompute on fc1's output itself
            (``in_place.config_conflicts``).

    Returns:
        One of ``TE_MODULE_PATH``, ``FUSED_KERNEL_PATH`` and ``UNFUSED_PATH``.

    Raises:
        UnsupportedActivationError: The selected path cannot compute ``spec``.
        ValueError: The fused path with the in-place backward on
            (``mcore_activations.fusions.in_place``) and a config under which it is unsafe.
    """
    if getattr(config, "use_te_activation_func", False) and has_te_activation_builder:
        if not spec.is_plain:
            raise UnsupportedActivationError(
                f"{owner}(use_te_activation_func=True)",
                spec,
                "Transformer Engine's activation modules take no clamp, tanh clamp scale or "
                "linear offset",
                "Set use_te_activation_func=False; bias_activation_fusion=True computes it "
                "with the fused kernels.",
            )
        return TE_MODULE_PATH
    if config.bias_activation_fusion:
        # Lowering now, not at the first forward, makes an unsupported config fail at build.
        lower_to_fused_kernel(spec, f"{owner}(bias_activation_fusion=True)")
        in_place.check_layer_config(config, owner, moe_act_on_graph=moe_act_on_graph)
        return FUSED_KERNEL_PATH
    return UNFUSED_PATH


class LayerActivation:
    """A layer's activation, decided at construction; called with fc1's output on every forward.

    It holds everything the layer's activation needs, read from the config once: the spec, the
    path, the callable (the TE module on ``TE_MODULE_PATH``) and, on ``FUSED_KERNEL_PATH``, the
    kernels' variants and parameter tensors (``kernel_plan.KernelPlan``), so a call does no spec,
    path or lowering work. Build it with :func:`select_layer_activation`.

    Two inputs stay per call, as upstream reads them at every forward: the CPU-offload tag of the
    fused kernels' saved input (``cpu_offloading`` and ``cpu_offloading_activations`` of the
    config it was built with, and whether Transformer Engine is present), and the in-place
    backward option when ``in_place_backward`` is None (the process default at the call,
    ``mcore_activations.fusions.in_place``).

    Args:
        spec: The activation.
        path: ``TE_MODULE_PATH``, ``FUSED_KERNEL_PATH`` or ``UNFUSED_PATH``; a spec the path
            cannot compute must have been refused already (:func:`select_activation_path`).
        func: The TE module on ``TE_MODULE_PATH``, else the configured callable.
        fp8_input_store: The fused kernels keep their saved input in FP8.
        offload_config: The config whose CPU-offloading flags tag the fused kernels' saved
            input; None: never tagged.
        in_place_backward: The fused kernels' backward writes the input gradient over fc1's
            output (True / False); None: the process default at each call.
        recompute_output: :meth:`fc2_saves_recipe` has fc2 save a recipe of the output
            instead of the output (True / False); None: the process default at each call
            (``mcore_activations.fusions.output_recompute``).

    Raises:
        TypeError: ``in_place_backward`` or ``recompute_output`` is not True, False or None.
    """

    __slots__ = (
        "spec",
        "path",
        "func",
        "fp8_input_store",
        "in_place_backward",
        "recompute_output",
        "_offload",
        "_plan",
    )

    def __init__(
        self,
        spec: ActivationSpec,
        path: str,
        func: Callable,
        *,
        fp8_input_store: bool = False,
        offload_config=None,
        in_place_backward: Optional[bool] = None,
        recompute_output: Optional[bool] = None,
    ):
        self.spec = spec
        self.path = path
        self.func = func
        self.fp8_input_store = bool(fp8_input_store)
        self.in_place_backward = in_place.check_option(in_place_backward)
        self.recompute_output = output_recompute.check_option(recompute_output)
        self._offload = offload_config
        self._plan = None
        if path == FUSED_KERNEL_PATH:
            # Raises as the functional fused_activation does for a spec without a kernel.
            self._plan = KernelPlan(lower_to_fused_kernel(spec, "fused_activation"))

    def with_spec(self, spec: ActivationSpec) -> LayerActivation:
        """This activation for ``spec`` on the same path, with the same flags.

        For a layer whose ``activation_spec`` was assigned after construction (a subclass
        changing the GLU layout, say): the layer computes what its ``activation_spec`` names.

        Raises:
            UnsupportedActivationError: On the fused path, ``spec`` has no kernel.
        """
        return LayerActivation(
            spec,
            self.path,
            self.func,
            fp8_input_store=self.fp8_input_store,
            offload_config=self._offload,
            in_place_backward=self.in_place_backward,
            recompute_output=self.recompute_output,
        )

    def offload_input(self) -> bool:
        """Whether a fused call now tags its saved input for TE's CPU offloading."""
        config = self._offload
        # Tagging saved tensors for offloading only means something to TE's offload handler.
        return bool(
            config is not None
            and config.cpu_offloading
            and config.cpu_offloading_activations
            and have_te()
        )

    def __call__(
        self,
        x: torch.Tensor,
        bias: Optional[torch.Tensor] = None,
        probs: Optional[torch.Tensor] = None,
        *,
        func: Optional[Callable] = None,
    ) -> torch.Tensor:
        """The activation of fc1's output ``x`` (and fc1's unadded ``bias``) on this path.

        Args:
            x: fc1's output, in the GLU layout of ``spec``.
            bias: fc1's bias when fc1 skipped adding it, else None.
            probs: Optional per-row weights ``x.shape[:-1] + (1,)`` (MoE probabilities).
            func: The callable the TE-module and unfused paths apply in place of ``self.func``.
                Layers pass their ``activation_func`` attribute, which upstream reads at every
                forward: a callable assigned to it after construction is used there, as
                upstream uses it. The fused kernels compute ``spec`` whatever it is.

        Returns:
            The activation in ``x.dtype``, with each row multiplied by ``probs``.
        """
        offload = self.offload_input()
        if self._plan is not None:
            return fused_activation_with_plan(
                self._plan,
                x,
                bias,
                probs,
                fp8_input_store=self.fp8_input_store,
                cpu_offload_input=offload,
                in_place_backward=self.in_place_backward,
            )
        func = self.func if func is None else func
        if bias is not None:
            x = x + bias
        if self.path == TE_MODULE_PATH:
            if self.spec.glu_interleave_size is not None:
                # TE's GLU modules read the two-halves layout.
                x = torch.cat(deinterleave_glu(x, self.spec.glu_interleave_size), dim=-1)
            out = func(x)
            return (out * probs).to(out.dtype) if probs is not None else out
        return unfused_activation(x, self.spec, func, probs=probs)

    def recomputes_fused_output(self) -> bool:
        """Whether :meth:`fc2_saves_recipe` can serve this activation: the fused path, saving
        fc1's output as it is (no FP8 copy, no CPU offloading)."""
        return self._plan is not None and not self.fp8_input_store and not self.offload_input()

    def fc2_saves_recipe(
        self,
        output: torch.Tensor,
        x: torch.Tensor,
        bias: Optional[torch.Tensor] = None,
        probs: Optional[torch.Tensor] = None,
    ):
        """A context for fc2's forward: with the output-recompute option, fc2 saves a recipe.

        Wrap fc2's forward in it, with the arguments the activation was called with: fc2 then
        keeps, instead of ``output``, a note that its backward turns into ``output`` again,
        computed by the same kernel from ``x``, ``bias`` and ``probs``
        (``output_recompute.recompute_when_saved``), and ``output`` is freed when the layer's
        forward drops it.

        Only the fused-kernel path does so, and there only when the saved input is fc1's output
        itself: that is all its backward keeps, so the recipe keeps nothing alive that was not
        kept anyway. The unfused and TE-module graphs save other tensors (the biased input,
        halves, FP8 or offloaded copies), and keeping ``x`` alive for a recomputation would cost
        more than the output saves.

        Args:
            output: What :meth:`__call__` returned for ``x``, ``bias`` and ``probs``.
            x: fc1's output, as passed to :meth:`__call__`.
            bias: fc1's bias, as passed to :meth:`__call__`.
            probs: The per-row weights, as passed to :meth:`__call__`.

        Returns:
            A context manager (a no-op one when the option is off or cannot help).
        """
        if not (output_recompute.resolve(self.recompute_output) and self.recomputes_fused_output()):
            return contextlib.nullcontext()
        plan, backend = self._plan, kernel_backend(x.device)

        def recompute(target: torch.Tensor) -> None:
            with use_kernel_backend(backend):  # the forward's backend: the same bits
                fused_activation_into(plan, target, x, bias, probs)

        return output_recompute.recompute_when_saved(output, recompute, (x, bias, probs))

    def __repr__(self) -> str:
        return f"LayerActivation({self.spec.name}, path={self.path!r})"


def select_layer_activation(
    config,
    spec: ActivationSpec,
    owner: str,
    *,
    te_module_factory: Optional[Callable[[], Callable]] = None,
    fused_kernel_opt_in: bool = False,
    offload_input: bool = False,
    recompute_output: Optional[bool] = None,
) -> LayerActivation:
    """The one path selector of ``MLP``, the routed experts and the shared experts.

    Reads every activation field the path needs from ``config`` once: a config edited after the
    layer is built changes nothing about what the layer computes or saves.

    Args:
        config: The layer's config (path flags, ``activation_func``,
            ``activation_func_fp8_input_store``).
        spec: The activation to compute (``ActivationSpec.from_config``).
        owner: The layer's class name, used in error messages.
        te_module_factory: Builds the TE activation module the layer's submodules name; None
            when they name none.
        fused_kernel_opt_in: The layer runs the fused kernels even without
            ``bias_activation_fusion`` (upstream's ``use_fused_weighted_squared_relu``).
        offload_input: The fused kernels tag their saved input for CPU offloading when
            ``config``'s offloading flags ask for it at the call (as upstream's ``MLP`` does).
        recompute_output: The layer's output-recompute setting (``LayerActivation``); None
            follows the process default.

    Raises:
        UnsupportedActivationError: The selected path cannot compute ``spec``.
    """
    # The fork's layers recompute a 'moe_act' output from fc1's output itself (TEGroupedMLP,
    # through output_recompute), never from upstream's detached checkpoint copy.
    path = select_activation_path(
        config, spec, te_module_factory is not None, owner, moe_act_on_graph=True
    )
    if path == UNFUSED_PATH and fused_kernel_opt_in:
        lower_to_fused_kernel(spec, owner)
        in_place.check_layer_config(config, owner, moe_act_on_graph=True)
        path = FUSED_KERNEL_PATH
    func = te_module_factory() if path == TE_MODULE_PATH else config.activation_func
    return LayerActivation(
        spec,
        path,
        func,
        fp8_input_store=bool(getattr(config, "activation_func_fp8_input_store", False)),
        offload_config=config if offload_input else None,
        recompute_output=recompute_output,
    )


def per_token_probs(per_token_scale: Optional[torch.Tensor], x: torch.Tensor):
    """``per_token_scale`` (one weight per row of ``x``) as ``[..., 1]`` probabilities, or None.

    An integer or boolean scale is converted to float32, so every path computes what upstream's
    MLP computes with it (its product with the activation promotes it to a float).

    Raises:
        TypeError: the scale is not a real tensor (e.g. complex).
        ValueError: the scale is not shaped like ``x.shape[:-1]``; a ``[s, 1]`` or 0-d scale
            would broadcast on the unfused path and be refused by the fused kernels.
    """
    if per_token_scale is None:
        return None
    if not isinstance(per_token_scale, torch.Tensor) or per_token_scale.is_complex():
        got = getattr(per_token_scale, "dtype", type(per_token_scale).__name__)
        raise TypeError(f"per_token_scale must be a real tensor, one weight per token; got {got}.")
    if not per_token_scale.is_floating_point():
        per_token_scale = per_token_scale.to(torch.float32)
    if tuple(per_token_scale.shape) != tuple(x.shape[:-1]):
        raise ValueError(
            f"per_token_scale of shape {tuple(per_token_scale.shape)} does not match the "
            f"{tuple(x.shape[:-1])} tokens of the MLP input: pass one weight per token, shaped "
            "like hidden_states without its last dimension."
        )
    return per_token_scale.unsqueeze(-1)


def add_weighted_output_bias(
    output: torch.Tensor, bias: torch.Tensor, per_token_scale: torch.Tensor
) -> torch.Tensor:
    """An expert's fc2 output plus its bias weighted by each token's router probability.

    Computes ``output + bias * per_token_scale[..., None]`` out of place and rounds once to
    ``output.dtype``: the same bits as adding the (float32) product in place, which is what
    upstream does. In place is not an option: when fc2 is a Transformer Engine linear its output
    is a view made inside a custom autograd Function, and autograd refuses to modify it (an
    expert with biases and token weights, as in gpt-oss, could not train).
    """
    return (output + bias * per_token_scale.unsqueeze(-1)).to(output.dtype)
