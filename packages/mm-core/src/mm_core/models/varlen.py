"""Document-aware attention for packed and padded rows (``model.attn_implementation: mm_varlen`` / ``auto``).

The attention function is registered with transformers' public ``AttentionInterface`` under
:data:`VARLEN_ATTENTION`, and with ``AttentionMaskInterface`` a mask function (:func:`padding_mask`) that
hands the 2-D padding mask through as it came: neither the mask step nor the attention ever builds a
``seq x seq`` mask, and K/V are never repeated to the query heads. (transformers' mask step still looks for
packed rows in ``position_ids`` when no mask is given, one small host read per forward; the attention
ignores its result.)

Documents of a micro-batch, flattened over its rows (``[batch x seq]`` tokens), come from, in order:

1. ``cu_seq_lens_q`` / ``cu_seq_lens_k`` / ``max_length_q`` / ``max_length_k`` keyword arguments (the names of
   transformers' flash-attention kwargs), as packing collators emit them (:mod:`mm_core.data.packing`), plus
   :data:`LENGTHS_KWARG`, the same lengths as host integers;
2. otherwise ``position_ids`` restarting at 0 (a new document at every 0; for multi-axis rope positions
   ``[axes, batch, seq]`` where every axis is 0) and the 2-D ``attention_mask`` (each run of padding is a
   document of its own, never attended to by a real token).

:func:`document_kwargs` computes 1. from 2. on the host, once per micro-batch, before the batch moves to the
device (mm's trainer calls it); a model used outside the trainer falls back to 2. inside every layer (one
host read per layer). Each document is then attended causally by the device's fused varlen kernel
(:mod:`mm_parallel.kernels`): torch's ``varlen_attn`` on CUDA, ``npu_fusion_attention`` (TND) on Ascend,
SDPA per document elsewhere; a micro-batch whose rows are each one whole document runs one causal SDPA over
the batch, the very call transformers' ``sdpa`` makes there, and so, on CPU, does one whose rows are each one
document followed by padding (:data:`ROWS_KWARG`: exact for every real token, and one call instead of one per
document and padding run).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mm_parallel.kernels import kernel

VARLEN_ATTENTION = "mm_varlen"
#: the document lengths of a micro-batch as host integers (a tuple), beside ``cu_seq_lens_q``
LENGTHS_KWARG = "mm_document_lengths"
#: True when every row of a micro-batch is one document from its first column, then only padding (a host bool
#: beside the lengths): the CPU path then runs one causal SDPA over the batch (see :func:`one_document_rows`)
ROWS_KWARG = "mm_one_document_rows"
#: transformers' keyword names of variable-length attention
CU_Q, CU_K, MAX_Q, MAX_K = "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"


def _restarts(position_ids: torch.Tensor, shape: tuple[int, int]) -> np.ndarray:
    """``[rows, seq]`` bools (host): where the positions restart at 0 (for multi-axis rope positions
    ``[axes, batch, seq]``, where every axis does)."""
    pos = position_ids.detach().cpu().numpy()
    return np.broadcast_to((pos == 0).all(0) if pos.ndim == 3 else pos == 0, shape)


def _tokens(attention_mask: torch.Tensor) -> np.ndarray:
    """The 2-D padding mask as host bools (True: a token)."""
    return attention_mask.detach().cpu().numpy().astype(bool)


def document_lengths(
    position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, rows: int, seq: int
) -> list[int]:
    """Lengths of the documents of ``rows x seq`` tokens read row after row (module docstring, rule 2).
    Computed with numpy on a host copy: on a host batch (mm's trainer) no torch value is read."""
    starts = np.zeros((rows, seq), dtype=bool)
    starts[:, 0] = True
    if position_ids is not None:
        starts |= _restarts(position_ids, (rows, seq))
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"attention {VARLEN_ATTENTION!r} takes a 2-D attention_mask [batch, seq] (1 = token, "
                f"0 = padding); got shape {tuple(attention_mask.shape)}"
            )
        real = _tokens(attention_mask)
        change = real[:, 1:] != real[:, :-1]
        # a run of padding is one document whatever its position ids; a token after a change starts one
        starts[:, 1:] = (starts[:, 1:] & real[:, 1:]) | change
        runs = (real[:, 1:] & change).sum(1) + real[:, 0]
        if (runs > 1).any():
            row = int(np.flatnonzero(runs > 1)[0])
            raise ValueError(
                f"attention {VARLEN_ATTENTION!r}: row {row} of the attention_mask has padding "
                "between tokens; "
                "it supports padding before or after each row's tokens (pack documents with position_ids "
                "restarting at 0 instead), or use model.attn_implementation: sdpa"
            )
    bounds = np.append(np.flatnonzero(starts.reshape(-1)), rows * seq)
    return [int(n) for n in np.diff(bounds)]


def one_document_rows(position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> bool:
    """Whether every row is one document starting at its first column followed only by padding (right
    padding, as mm's collators pad). Then causal attention over the whole row gives each real token exactly
    the keys of its document (padding comes after it), so one causal SDPA over the batch is exact for every
    real token; only the padding positions' outputs, which nothing reads, differ from the per-document run."""
    if attention_mask is None or attention_mask.dim() != 2:
        return False
    real = _tokens(attention_mask)
    if not real[:, 0].all() or (real[:, 1:] & ~real[:, :-1]).any():
        return False  # an empty or left-padded row, or padding between tokens
    # no second document inside a row
    return position_ids is None or not (_restarts(position_ids, real.shape)[:, 1:] & real[:, 1:]).any()


def _cumulative(lengths: list[int], device: torch.device | None = None) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)


def document_kwargs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The document keyword arguments of a (host) micro-batch with ``input_ids`` ``[batch, seq]``: those it
    carries, completed with :data:`LENGTHS_KWARG`, or computed from its ``position_ids``/``attention_mask``.
    Empty for a batch without ``input_ids`` (the model computes its own inputs)."""
    cu = batch.get(CU_Q)
    if isinstance(cu, torch.Tensor):
        lengths = tuple(int(n) for n in np.diff(cu.detach().cpu().numpy()))
        return {LENGTHS_KWARG: lengths}
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return {}
    rows, seq = ids.shape
    position_ids, attention_mask = batch.get("position_ids"), batch.get("attention_mask")
    found = document_lengths(position_ids, attention_mask, rows, seq)
    cu = _cumulative(found)
    out = {CU_Q: cu, CU_K: cu, MAX_Q: max(found), MAX_K: max(found), LENGTHS_KWARG: tuple(found)}
    if one_document_rows(position_ids, attention_mask):
        out[ROWS_KWARG] = True
    return out


def _decode_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
) -> torch.Tensor:
    """Queries after a key/value cache (generation): causal SDPA over every cached key (``[q, k]`` mask)."""
    q_len, k_len = query.shape[2], key.shape[2]
    i = torch.arange(q_len, device=query.device)[:, None] + (k_len - q_len)
    mask = (torch.arange(k_len, device=query.device)[None, :] <= i)[None, None]
    if attention_mask is not None:
        mask = mask & attention_mask[:, None, None, -k_len:].bool()
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
    )
    return out.transpose(1, 2).contiguous()


def varlen_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function (``AttentionInterface`` signature): ``query`` ``[batch, heads, seq,
    dim]``, ``key``/``value`` ``[batch, kv_heads, seq, dim]``; returns ``[batch, seq, heads, dim]``."""
    if dropout:
        raise ValueError(
            f"attention {VARLEN_ATTENTION!r} has no attention dropout (got {dropout}); set "
            "model.config_overrides.attention_dropout: 0.0 or model.attn_implementation: sdpa"
        )
    if kwargs.get("softcap") is not None:
        raise ValueError(f"attention {VARLEN_ATTENTION!r} does not support attention logit soft-capping")
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        raise ValueError(
            f"attention {VARLEN_ATTENTION!r} is causal; {type(module).__name__} attends bidirectionally "
            "(use model.attn_implementation: sdpa)"
        )
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() != 2:
        raise ValueError(
            f"attention {VARLEN_ATTENTION!r} got a {attention_mask.dim()}-D attention mask; it takes the 2-D "
            "[batch, seq] padding mask (a model that builds its own mask needs "
            "model.attn_implementation: sdpa)"
        )
    rows, heads, seq, dim = query.shape
    if key.shape[2] != seq:
        return _decode_attention(module, query, key, value, attention_mask, scaling), None
    cu, lengths, max_len = kwargs.get(CU_Q), kwargs.get(LENGTHS_KWARG), kwargs.get(MAX_Q)
    if cu is None:
        lengths = document_lengths(kwargs.get("position_ids"), attention_mask, rows, seq)
        cu = _cumulative(lengths, query.device)
    elif lengths is not None and sum(lengths) != rows * seq:
        raise ValueError(
            f"attention {VARLEN_ATTENTION!r}: the documents ({CU_Q}) cover {sum(lengths)} tokens, but the "
            f"layer sees {rows} x {seq}"
        )
    if lengths is not None:
        max_len = max(lengths)
    device = query.device.type
    whole_rows = lengths is not None and set(lengths) == {seq}
    # right-padded rows of one document each: one causal SDPA is exact for every real token, and on devices
    # whose varlen entry is a loop of SDPA calls (CPU) it is the faster; CUDA / Ascend skip the padding
    padded_rows = kwargs.get(ROWS_KWARG) is True and device not in ("cuda", "npu")
    if device != "npu" and sliding_window is None and (whole_rows or padded_rows):
        # one causal SDPA over the batch (for whole rows, transformers' sdpa call)
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=heads != key.shape[1]
        )
        return out.transpose(1, 2).contiguous(), None

    def tnd(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).reshape(rows * seq, t.shape[1], dim)

    run = kernel("varlen_attention", device)
    out = run(
        tnd(query),
        tnd(key),
        tnd(value),
        cu.to(query.device),
        None if max_len is None else int(max_len),
        lengths=lengths,
        scale=scaling,
        window=sliding_window,
    )
    return out.view(rows, seq, heads, dim), None


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The mask function of :data:`VARLEN_ATTENTION` (``AttentionMaskInterface`` signature): the 2-D padding
    mask as it came (its last ``kv_length`` columns), or None; never a ``q x kv`` mask."""
    return None if attention_mask is None else attention_mask[:, -kv_length:]


def register_varlen_attention() -> str:
    """Register :func:`varlen_attention_forward` and its mask function :func:`padding_mask` with transformers
    (idempotent); returns their name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN_ATTENTION, padding_mask)
    return VARLEN_ATTENTION


def auto_applies(cls: type, config: Any) -> bool:
    """Whether ``model.attn_implementation: auto`` picks :data:`VARLEN_ATTENTION` for this transformers class:
    a text-only causal language model (a transformers ``...ForCausalLM`` or a subclass of one, e.g. mm's
    ``Qwen3ForTraining``, without sub-configs, whose forward takes
    ``**kwargs``) that dispatches its attention through ``AttentionInterface``, with no attention dropout
    (``mm_varlen`` has none). Anything else (towers, encoders, mm's own models, ``attention_dropout`` > 0)
    keeps ``sdpa``."""
    forward = getattr(cls, "forward", None)
    takes_kwargs = callable(forward) and any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(forward).parameters.values()
    )  # the document kwargs reach the attention through the forward's **kwargs
    return (
        bool(getattr(cls, "_supports_attention_backend", False))
        and any(
            c.__name__.endswith("ForCausalLM")
            for c in cls.__mro__
            if c.__module__.startswith("transformers.")
        )
        and not getattr(config, "sub_configs", None)
        and not getattr(config, "attention_dropout", 0.0)
        and takes_kwargs
    )


def resolve_attn_implementation(name: str, cls: type, config: Any) -> str | dict[str, str]:
    """The attention implementation a transformers class is built with for ``model.attn_implementation``
    ``name`` (``auto`` resolved; mm's own registered first when chosen). A model with towers given
    ``mm_varlen`` gets it for its language model only (``{"text_config": "mm_varlen"}``): the towers keep
    their (bidirectional) attention."""
    if name == "auto":
        name = VARLEN_ATTENTION if auto_applies(cls, config) else "sdpa"
    if name == VARLEN_ATTENTION:
        register_varlen_attention()
        if "text_config" in (getattr(config, "sub_configs", None) or {}):
            return {"text_config": VARLEN_ATTENTION}
    return name


def plain_attn_implementation(name: str) -> str:
    """``model.attn_implementation`` for a model of mm's own (a ``BaseModel`` that builds transformers modules
    itself): ``auto`` is ``sdpa`` there; ``mm_varlen`` is registered before use."""
    if name == "auto":
        return "sdpa"
    if name == VARLEN_ATTENTION:
        register_varlen_attention()
    return name


def uses_varlen(model: nn.Module) -> bool:
    """Whether ``model``'s (language model's) attention is :data:`VARLEN_ATTENTION`."""
    config = getattr(model, "config", None)
    if config is None:
        return False
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    return getattr(text, "_attn_implementation", None) == VARLEN_ATTENTION
