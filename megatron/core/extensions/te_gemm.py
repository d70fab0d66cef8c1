"""``te_general_gemm``: Transformer Engine's cuBLASLt GEMM with a chosen output dtype.

``torch.matmul`` writes its output in the inputs' dtype. A linear whose output must be wider
than its inputs (bf16 operands, float32 output, accumulated in float32 and never rounded to
bf16) needs TE's ``general_gemm``, which takes the output dtype. The public module exports
:func:`te_general_gemm` where the TE in force has ``general_gemm`` and None elsewhere, as
upstream does; the tensor-parallel linear uses it for its ``output_dtype``. TE is read from the
import seam (``mcore_activations.te_import``) at call time.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from mcore_activations import te_import

__all__ = ["te_general_gemm", "te_general_gemm_or_none"]


def _te_attr(path: str) -> Any:
    # Attribute access on the seam's module: the seam stays the only place TE is imported.
    current: Any = te_import.te
    for part in path.split("."):
        current = getattr(current, part, None)
        if current is None:
            return None
    return current


def _general_gemm() -> Optional[Any]:
    # Without TE the seam's placeholder answers every attribute, so ask have_te() first.
    if not te_import.have_te():
        return None
    return _te_attr("pytorch.cpp_extensions.general_gemm")


def te_general_gemm(
    A: torch.Tensor,
    B: torch.Tensor,
    out_dtype: Optional[torch.dtype] = None,
    layout: str = "TN",
    out: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    grad: bool = False,
) -> list:
    """TE's ``general_gemm(A, B, ...)`` without quantization, GELU or Userbuffers.

    With the default ``"TN"`` layout the first output is ``B @ A.T`` (plus ``bias``), so
    ``te_general_gemm(weight, x2d, out_dtype=torch.float32)[0]`` is a linear's output in float32.
    Which dtype / layout combinations run is cuBLASLt's decision (it raises otherwise).

    Args:
        A, B: The operands (``weight``, ``input`` for a linear's forward).
        out_dtype: The output's dtype (None: TE's default, the operands').
        layout: ``"TN"``, ``"NN"`` or ``"NT"``.
        out: Write the output into this tensor.
        bias: Added to the output.
        grad: TE's flag for GEMMs of a backward pass.

    Returns:
        TE's result list; the output is its first element.

    Raises:
        RuntimeError: The Transformer Engine in force has no ``general_gemm``.
    """
    gemm = _general_gemm()
    if gemm is None:
        raise RuntimeError(
            "te_general_gemm needs Transformer Engine's pytorch.cpp_extensions.general_gemm, "
            "which the Transformer Engine in force does not have (or TE is not installed)."
        )
    kwargs = dict(
        out_dtype=out_dtype,
        quantization_params=None,
        gelu=None,
        gelu_in=None,
        accumulate=False,
        layout=layout,
        out=out,
        bias=bias,
        use_split_accumulator=False,
        grad=grad,
        ub=None,
        ub_type=None,
        extra_output=None,
        bulk_overlap=False,
    )
    # Older TE takes the cuBLAS workspace as an argument; newer TE allocates it itself.
    get_workspace = _te_attr("pytorch.module.base.get_workspace")
    if get_workspace is not None:
        kwargs["workspace"] = get_workspace()
    return gemm(A, B, **kwargs)


def te_general_gemm_or_none() -> Optional[Any]:
    """:func:`te_general_gemm` where the TE in force has ``general_gemm``, else None (the value
    upstream's name has without it)."""
    return te_general_gemm if _general_gemm() is not None else None
