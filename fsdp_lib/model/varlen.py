"""--attn-implementation varlen: attention over packed documents without a [T x T] mask.

The data plan knows where each packed document starts; `Batch.to` turns that into host-side bounds (and a
`cu_seqlens` tensor copied with the batch) before the batch reaches the device. The training forward hands the
bounds over (`use_documents`) and gives the model an empty 4-D "mask" (`documents_mark`): transformers returns a
4-D mask as it is, so it builds no [B x 1 x T x T] tensor and never inspects the position ids for packing (no host
sync), and every attention layer calls `varlen_attention` with it. That function attends within each document:
  - on CUDA in bf16/fp16, torch's own variable-length flash kernel (`torch.nn.attention.varlen.varlen_attn`) over
    the flattened micro-batch, cu_seqlens on the device and the longest document as a host int;
  - elsewhere (CPU, fp32, dropout, a torch without varlen_attn), causal scaled_dot_product_attention over the
    documents gathered into groups of similar length, each padded at its end (one call per group, about log2(T)
    calls), so the work is about the sum of the documents' squares rather than T squared.
A sliding window shorter than a document gets that document's own banded mask ([L x L], never [T x T]).
Without the mark (generation, evaluation of unpacked rows, --document-masking off) the call is plain sdpa, with
the mask transformers builds for sdpa. Soft-capped logits and attention sinks are refused with a clear error, so
the start-up probe (probes.py) moves on to another way of masking.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fsdp_lib.data.batch import Documents

TORCH_2_13 = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 13)

NAME = "varlen"


@dataclass(frozen=True)
class Context:
    """--context-parallel: this process holds part `rank` of `size` equal parts of each sequence; `group` the
    processes holding the others (rank i holds part i)."""

    size: int
    rank: int
    group: Any


_CURRENT: list[tuple[Documents, Context | None] | None] = [None]
# Whether a call since the last reset was given a sliding window: a model that applies its window through its mask
# alone (PhiMoE) never passes one, and varlen, which reads no mask, would drop it (probes.choose_document_masking).
SAW_WINDOW = [False]


def use_documents(documents: Documents, context: Context | None = None) -> None:
    """The documents (of the whole micro-batch, also under context parallelism) every varlen attention call reads
    until the next micro-batch sets its own. Kept beside the model rather than passed as a forward argument:
    compiled layers would guard on (and recompile for) every micro-batch's bounds, and the activation-checkpoint
    recompute of the backward runs after the forward returns."""
    _CURRENT[0] = (documents, context)


def _all_to_all(send: torch.Tensor, context: Context) -> torch.Tensor:
    """Equal parts of dim 0 exchanged over the context group, differentiable (the backward is the reverse exchange).
    From torch 2.13 the functional collective, waited for here (torch.distributed.nn.functional's warns there that it
    is deprecated); before, that one, whose wait_tensor may lack a backward."""
    if TORCH_2_13:
        from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

        return wait_tensor(all_to_all_single_autograd(send, None, None, context.group))
    from torch.distributed.nn.functional import all_to_all_single

    return all_to_all_single(torch.empty_like(send), send, group=context.group)


def _heads_to_sequence(t: torch.Tensor, context: Context) -> torch.Tensor:
    """[B x H x T/N x D], this rank's tokens of every head -> [B x H/N x T x D], every token of this rank's heads
    (Ulysses: one all-to-all; its backward is the reverse all-to-all). The result is a view of a [B x T x H/N x D]
    buffer (at -b 1 the all-to-all's own output), the layout both attention paths flatten to without a copy: one
    copy per tensor (the send buffer) where a [B x H x T x D] result would take three."""
    rows, heads, part, dim = t.shape
    n = context.size
    send = t.reshape(rows, n, heads // n, part, dim).permute(1, 0, 3, 2, 4).contiguous()  # head group j -> rank j
    got = _all_to_all(send, context)  # [part i, B, T/N, H/N, D]
    return got.transpose(0, 1).reshape(rows, n * part, heads // n, dim).transpose(1, 2)


def _sequence_to_heads(t: torch.Tensor, context: Context) -> torch.Tensor:
    """The way back, in the attention output's layout: [B x T x H/N x D] -> [B x T/N x H x D]."""
    rows, length, heads, dim = t.shape
    n = context.size
    send = t.reshape(rows, n, length // n, heads, dim).transpose(0, 1).contiguous()  # part i -> rank i (a view at -b 1)
    got = _all_to_all(send, context)  # [head group j, B, T/N, H/N, D]
    return got.permute(1, 2, 0, 3, 4).reshape(rows, length // n, n * heads, dim)


# What the training forward passes as attention_mask: 4-D, so transformers returns it untouched, and empty, so it
# can never be taken for a real mask (a real one is [B x 1 x q x kv] with q, kv >= 1).
_MARKS: dict[tuple[int, torch.device], torch.Tensor] = {}


def documents_mark(rows: int, device: torch.device) -> torch.Tensor:
    """The empty [rows x 1 x 0 x 0] attention_mask that asks the model's layers for document attention."""
    key = (rows, device)
    if key not in _MARKS:
        _MARKS[key] = torch.zeros(rows, 1, 0, 0, dtype=torch.bool, device=device)
    return _MARKS[key]


@functools.cache
def _torch_varlen():
    """torch's variable-length flash attention and how this version says "causal" (2.11: is_causal; 2.13:
    window_size=(-1, 0)), or None where torch has none. Read once: every attention layer asks."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    return varlen_attn, causal, "enable_gqa" in params


def _banded(length: int, window: int, device: torch.device) -> torch.Tensor:
    """[L x L]: causal, and a key at most window - 1 tokens behind its query (transformers' sliding window)."""
    q = torch.arange(length, device=device)[:, None]
    k = torch.arange(length, device=device)[None, :]
    return (k <= q) & (q - k < window)


@dataclass(frozen=True)
class Bucket:
    """Documents of similar length, padded at their end to `length`: rows index the flat tokens ([k x length],
    a pad repeating the document's last token), one SDPA call for all of them."""

    length: int
    rows: torch.Tensor


def buckets_of(documents: Documents, device: torch.device) -> tuple[list[Bucket], torch.Tensor]:
    """The documents grouped by length (lengths in (2^(j-1), 2^j] together, padded to the group's longest), and
    the inverse index: where each flat token's output lies in the groups' outputs laid end to end. Built once per
    micro-batch on the host and kept for every layer and the backward's recompute."""
    if _BUCKETS and _BUCKETS[0][0] is documents and _BUCKETS[0][1] == device:
        return _BUCKETS[0][2], _BUCKETS[0][3]
    bounds = np.asarray(documents.bounds)
    starts, lengths = bounds[:-1], np.diff(bounds)
    group = np.ceil(np.log2(lengths)).astype(np.int64)
    buckets, inverse, offset = [], np.empty(bounds[-1], dtype=np.int64), 0
    for g in np.unique(group):
        members = np.flatnonzero(group == g)
        length = int(lengths[members].max())
        steps = np.minimum(np.arange(length)[None, :], lengths[members, None] - 1)
        rows = starts[members, None] + steps
        for i, m in enumerate(members):
            inverse[starts[m] : starts[m] + lengths[m]] = offset + i * length + np.arange(lengths[m])
        buckets.append(Bucket(length, _to_device(rows.reshape(-1), device)))
        offset += len(members) * length
    found = buckets, _to_device(inverse, device)
    _BUCKETS[:] = [(documents, device, *found)]
    return found


_BUCKETS: list[tuple[Documents, torch.device, list[Bucket], torch.Tensor]] = []


def _to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host indices on `device`; to a GPU through pinned memory without waiting (a plain copy from pageable memory
    waits for the GPU's queue)."""
    t = torch.from_numpy(values)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _bucketed(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    documents: Documents,
    scale: float | None,
    dropout: float,
    window: int | None,
) -> torch.Tensor:
    """[B x T x H x D]: each document attends to itself; one causal SDPA call per group of similar lengths (the
    padding sits after each document, so causal attention never lets a real token see it)."""
    rows, heads, length, _ = query.shape
    dim = value.shape[-1]  # the output's head size: the value's (MLA's differs from the query's and key's)
    flat = [t.transpose(1, 2).reshape(rows * length, t.shape[1], t.shape[-1]) for t in (query, key, value)]
    gqa = key.shape[1] != heads
    buckets, inverse = buckets_of(documents, query.device)
    outs = []
    for bucket in buckets:
        q, k, v = (t.index_select(0, bucket.rows).view(-1, bucket.length, *t.shape[1:]).transpose(1, 2) for t in flat)
        mask = _banded(bucket.length, window, query.device) if window is not None and bucket.length > window else None
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None, scale=scale, enable_gqa=gqa
        )
        outs.append(out.transpose(1, 2).reshape(-1, heads, dim))
    return torch.cat(outs).index_select(0, inverse).view(rows, length, heads, dim)


def _flat_varlen(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, documents: Documents, scale: float | None
) -> torch.Tensor | None:
    """[B x T x H x D] through torch's varlen flash kernel, or None where it does not apply."""
    found = _torch_varlen()
    if found is None or not query.is_cuda or query.dtype not in (torch.bfloat16, torch.float16):
        return None
    if value.shape[-1] != query.shape[-1]:  # MLA's value head size: the bucketed SDPA calls take it
        return None
    varlen_attn, causal, takes_gqa = found
    rows, heads, length, dim = query.shape
    if key.shape[1] != heads and not takes_gqa:
        key, value = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (key, value))
    flat = [t.transpose(1, 2).reshape(rows * length, t.shape[1], dim) for t in (query, key, value)]
    extra = {"enable_gqa": True} if takes_gqa and key.shape[1] != heads else {}
    cu = documents.cu_seqlens
    out = varlen_attn(*flat, cu, cu, documents.longest, documents.longest, scale=scale, **causal, **extra)
    return out.reshape(rows, length, heads, dim)


@torch.compiler.disable
def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B x H x T x D], key/value [B x H_kv x T x D]; returns
    ([B x T x H x D], None)."""
    SAW_WINDOW[0] = SAW_WINDOW[0] or sliding_window is not None
    if attention_mask is None or attention_mask.numel() or attention_mask.dim() != 4:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    documents, context = _CURRENT[0] or (None, None)
    rows, _, length, _ = query.shape
    parts = context.size if context else 1
    if documents is None or documents.bounds[-1] != rows * length * parts or key.shape[2] != length:
        raise RuntimeError(
            f"varlen attention: no documents for this [{rows} x {length}] micro-batch (use_documents was not called "
            "for it, or keys come from a cache)"
        )
    for what in ("softcap", "s_aux", "position_bias"):
        if kwargs.get(what) is not None:
            raise NotImplementedError(f"varlen attention does not apply {what} (use --attn-implementation eager)")
    dropout = dropout if module.training else 0.0
    window = sliding_window if sliding_window and sliding_window < documents.longest else None
    if context:
        if key.shape[1] < context.size:  # fewer key/value heads than processes: each to N / kv_heads of them
            key, value = (t.repeat_interleave(context.size // t.shape[1], dim=1) for t in (key, value))
        query, key, value = (_heads_to_sequence(t, context) for t in (query, key, value))
    out = None if dropout or window else _flat_varlen(query, key, value, documents, scaling)
    if out is None:
        out = _bucketed(query, key, value, documents, scaling, dropout, window)
    return (_sequence_to_heads(out, context) if context else out), None


def register() -> None:
    """Make "varlen" an attention implementation transformers accepts, with sdpa's mask for the calls that have
    no documents (the mark bypasses mask creation)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, varlen_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
