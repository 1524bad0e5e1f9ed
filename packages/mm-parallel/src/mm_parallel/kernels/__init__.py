"""Fused kernels per device type: one table, ``op -> device type -> implementation``.

- ``varlen_attention``: ``cuda`` torch's ``varlen_attn`` (else flash-attn's ``flash_attn_varlen_func``);
  ``npu`` ``npu_fusion_attention`` in the TND layout with ``actual_seq_qlen/kvlen``; elsewhere SDPA once per
  document.
- ``rms_norm``: ``npu`` ``npu_rms_norm``; elsewhere ``F.rms_norm``.
- ``rotary``: ``npu`` ``npu_rotary_mul``; elsewhere the rotate-half formula.
- ``grouped_mm``: ``npu`` ``npu_grouped_matmul`` (forward and, through an autograd function, backward);
  elsewhere ``torch._grouped_mm``. mm's expert MLPs call the ``npu`` entry
  (:func:`mm_parallel.moe.grouped.fused_grouped_mm`).
- ``attention_lse``: :mod:`mm_parallel.kernels.attention_lse`, which dispatches on the device type itself.

Every entry of one op takes the same arguments (see the modules :mod:`.varlen`, :mod:`.norm`, :mod:`.rotary`,
:mod:`.grouped_mm`); the torch entries are the references the tests hold the others to (the ``npu`` ones on
CPU against a stand-in ``torch_npu`` written after its documentation: mm's calls are checked there, Ascend's
kernels await a device). ``torch_npu`` is imported only inside the ``npu`` entries, so this package imports
and runs without it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from mm_parallel.kernels import grouped_mm, norm, rotary, varlen

#: the entry used for a device type the op does not name
DEFAULT = "default"


def _attention_lse(*args: Any, **kwargs: Any) -> Any:
    from mm_parallel.kernels.attention_lse import attention_lse

    return attention_lse(*args, **kwargs)


KERNELS: Mapping[str, Mapping[str, Callable[..., Any]]] = MappingProxyType(
    {
        "varlen_attention": MappingProxyType(
            {
                "cuda": varlen.cuda_varlen_attention,
                "npu": varlen.npu_varlen_attention,
                DEFAULT: varlen.per_document_attention,
            }
        ),
        "rms_norm": MappingProxyType({"npu": norm.npu_rms_norm, DEFAULT: norm.rms_norm}),
        "rotary": MappingProxyType({"npu": rotary.npu_rotary, DEFAULT: rotary.rotary}),
        "grouped_mm": MappingProxyType({"npu": grouped_mm.npu_grouped_mm, DEFAULT: grouped_mm.grouped_mm}),
        "attention_lse": MappingProxyType({DEFAULT: _attention_lse}),
    }
)


def kernel(op: str, device_type: str) -> Callable[..., Any]:
    """The implementation of ``op`` for ``device_type`` (``"cuda"``, ``"npu"``, ``"cpu"``, ...)."""
    try:
        entries = KERNELS[op]
    except KeyError:
        raise KeyError(f"no kernel {op!r}; the table has {sorted(KERNELS)}") from None
    return entries.get(device_type, entries[DEFAULT])


__all__ = ["DEFAULT", "KERNELS", "grouped_mm", "kernel", "norm", "rotary", "varlen"]
