"""A CPU stand-in for flash-attention 2: torch's scaled_dot_product_attention, one sequence at a time for the
variable-length kernel, installed where transformers looks up the flash_attn functions. Everything above the
kernel is transformers' own flash path (modeling_flash_attention_utils._flash_attention_forward), so the stand-in
shows what it decides on a GPU: packed documents are detected from the position ids only in a batch of one row.
No sliding window or soft-capping (the models it is used with have neither).

Run under torchrun as fsdp_train.py with the stand-in installed in every worker:

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/workers/flash_stand_in.py \
        -e EXP -d DATA -m MODEL --attn-implementation flash_attention_2 ...
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F


def flash_fn(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **_):  # noqa: ANN001, ANN201
    """flash_attn_func: [batch, seq, heads, dim] in and out."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=softmax_scale, enable_gqa=True
    )
    return out.transpose(1, 2)


def varlen_fn(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
    dropout_p=0.0,  # noqa: ANN001, ANN201
    softmax_scale=None,
    causal=False,
    **_,
):
    """flash_attn_varlen_func: [tokens, heads, dim], sequences delimited by the cumulative lengths."""
    pieces = []
    for i in range(len(cu_seqlens_q) - 1):
        q_part = q[cu_seqlens_q[i] : cu_seqlens_q[i + 1]][None]
        k_part, v_part = (t[cu_seqlens_k[i] : cu_seqlens_k[i + 1]][None] for t in (k, v))
        pieces.append(flash_fn(q_part, k_part, v_part, softmax_scale=softmax_scale, causal=causal)[0])
    return torch.cat(pieces)


def install(patch: Callable[[object, str, object], None] = setattr) -> None:
    """Put the stand-in where transformers looks; `patch` sets each attribute (a test passes monkeypatch.setattr so
    that the process's later tests get transformers back as it was: with the kernels fallback off, every model
    load after it failed, "Kernels are not available")."""
    import transformers.modeling_flash_attention_utils as fa
    import transformers.modeling_utils as modeling
    from transformers import PreTrainedModel

    for name, value in (
        ("_flash_fn", flash_fn), ("_flash_varlen_fn", varlen_fn), ("_flash_with_kvcache_fn", None),
        ("_process_flash_kwargs_fn", fa._lazy_define_process_function(varlen_fn)),
        ("_process_with_kvcache_kwargs_fn", dict), ("_loaded_implementation", "flash_attention_2"),
    ):  # fmt: skip
        patch(fa, name, value)
    patch(PreTrainedModel, "_flash_attn_can_dispatch", lambda self, *args, **kwargs: True)  # no flash_attn, no GPU
    # transformers >= 5.25 (which requires the kernels package): without flash_attn it fetches
    # kernels-community/flash-attn2 from the hub instead (offline: "Version 4 ... is not available in the local
    # cache"); the stand-in is the kernel
    patch(modeling, "is_kernels_available", lambda: False)


if __name__ == "__main__":
    install()
    import fsdp_train
    from fsdp_lib.interrupts import exit_without_teardown

    exit_without_teardown(fsdp_train.main(sys.argv[1:]))
