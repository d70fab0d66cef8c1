"""Target patcher: upstream's ``MLP`` decides its activation once, at construction.

``MLP.__init__`` is wrapped to attach the layer's :class:`ActivationSpec` and its activation, a
:class:`~mcore_activations.activation_path.LayerActivation` (or the Transformer Engine lowering,
for ``TEFusedMLP``), refusing what no path computes; ``MLP.forward`` is replaced by one that calls
that activation. The shared experts' side-stream forward (``shared_experts``) and TE's fused
classes (``te_fused``) call the same two functions.
"""

from __future__ import annotations

import importlib

import torch

from mcore_activations import activation_path as paths
from mcore_activations.activation_spec import ActivationKind
from mcore_activations.fusions import fc2_chunks
from mcore_activations.upstream_patch.patcher import (
    Patcher,
    is_te_instance,
    layer_spec,
    refuse,
    wrap_init,
)
from mcore_activations.upstream_patch.upstream import MLP_MODULE


def attach_mlp_activation(layer) -> None:
    """After upstream's ``MLP.__init__``: the layer's spec, and how it computes or refuses it."""
    owner = type(layer).__name__
    spec = layer_spec(layer)
    layer.activation_spec = spec
    if is_te_instance(layer, "TEFusedMLPWithGroupedLinear"):
        if not (spec.kind == ActivationKind.SILU and spec.gated and spec.is_plain):
            refuse(
                owner,
                spec,
                "upstream's TEFusedMLPWithGroupedLinear always builds te.pytorch.ops.ScaledSwiGLU",
                "Use TEFusedMLP (use_grouped_gemm_for_dense_mlp=False), which lowers every "
                "activation Transformer Engine can compute.",
            )
    # Every activation field is read once, here, as in the fork (docs/activations.md).
    if is_te_instance(layer, "TEFusedMLP"):
        from mcore_activations.te_lowering import plan_te_activation

        layer._mcore_te_activation = plan_te_activation(
            spec,
            path=owner,
            scaled=False,
            cache_quantized_input=bool(layer.config.activation_func_fp8_input_store),
        )
        return
    has_te_module = isinstance(layer.activation_func, torch.nn.Module)
    path = paths.select_activation_path(layer.config, spec, has_te_module, owner)
    layer.activation_path = path
    layer._mcore_activation = paths.LayerActivation(
        spec,
        path,
        layer.activation_func,
        fp8_input_store=bool(layer.config.activation_func_fp8_input_store),
        offload_config=layer.config,
    )
    is_expert = bool(getattr(getattr(layer, "linear_fc2", None), "is_expert", False))
    layer._mcore_fc2_chunks_conflicts = fc2_chunks.check_layer(
        layer.config, owner, layer._mcore_activation, is_expert=is_expert
    )


def layer_activation(layer) -> paths.LayerActivation:
    """A patched layer's activation, as built at construction (now, if built before)."""
    activation = getattr(layer, "_mcore_activation", None)
    if activation is None:
        attach_mlp_activation(layer)  # a layer built before the patch: decide now
        activation = layer._mcore_activation
    elif activation.spec is not layer.activation_spec:
        # activation_spec was assigned after construction; the layer computes what it names.
        activation = layer._mcore_activation = activation.with_spec(layer.activation_spec)
    return activation


def mlp_activate(layer, x, bias, per_token_scale):
    """The activation of a patched layer on fc1's output ``x``."""
    probs = paths.per_token_probs(per_token_scale, x)
    # Upstream reads its ``activation_func`` at every forward (see LayerActivation.__call__).
    return layer_activation(layer)(x, bias, probs, func=layer.activation_func)


def _nvtx(module, what: str, suffix: str) -> None:
    fn = getattr(module, f"nvtx_range_{what}", None)
    if fn is not None:
        fn(suffix=suffix)


def _make_mlp_forward(mlp_module):
    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        """MLP forward with the activation of ``self.activation_spec`` (mcore_activations)."""
        _nvtx(mlp_module, "push", "linear_fc1")
        fc1_output, bias = self.linear_fc1(hidden_states)
        _nvtx(mlp_module, "pop", "linear_fc1")
        activation = layer_activation(self)
        probs = paths.per_token_probs(per_token_scale, fc1_output)
        # The activation and fc2, in row blocks with the fc2-chunks option (fusions.fc2_chunks);
        # with the output-recompute option fc2 saves a recipe of its input, not the input.
        output, output_bias = fc2_chunks.activation_and_fc2(
            activation,
            self.linear_fc2,
            fc1_output,
            bias,
            probs,
            self.activation_func,
            conflicts=getattr(self, "_mcore_fc2_chunks_conflicts", ()),
            owner=type(self).__name__,
            nvtx=lambda what, name: _nvtx(mlp_module, what, name),
        )
        if per_token_scale is not None and output_bias is not None:
            output = paths.add_weighted_output_bias(output, output_bias, per_token_scale)
            output_bias = None
        return output, output_bias

    return forward


def patch_mlp(patcher: Patcher) -> None:
    """Wraps ``MLP.__init__`` (spec and path at construction) and replaces ``MLP.forward``."""
    mlp_module = importlib.import_module(MLP_MODULE)
    mlp_cls = mlp_module.MLP
    patcher.set(mlp_cls, "__init__", wrap_init(mlp_cls.__init__, attach_mlp_activation))
    patcher.record(f"{MLP_MODULE}:MLP.__init__", "wrapped", "spec and path chosen at construction")
    patcher.set(mlp_cls, "forward", _make_mlp_forward(mlp_module))
    patcher.record(f"{MLP_MODULE}:MLP.forward", "replaced", "computes the spec on its path")
