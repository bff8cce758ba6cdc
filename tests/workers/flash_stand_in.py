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


def install() -> None:
    import transformers.modeling_flash_attention_utils as fa
    from transformers import PreTrainedModel

    fa._flash_fn, fa._flash_varlen_fn, fa._flash_with_kvcache_fn = flash_fn, varlen_fn, None
    fa._process_flash_kwargs_fn = fa._lazy_define_process_function(varlen_fn)
    fa._process_with_kvcache_kwargs_fn = dict
    fa._loaded_implementation = "flash_attention_2"
    PreTrainedModel._flash_attn_can_dispatch = lambda self, *args, **kwargs: True  # no flash_attn, no GPU: fine
    import transformers.modeling_utils as modeling

    # transformers >= 5.25 with the kernels package: without flash_attn it fetches kernels-community/flash-attn2
    # from the hub instead (offline: "Version 4 ... is not available in the local cache"); the stand-in is the kernel
    modeling.is_kernels_available = lambda: False


if __name__ == "__main__":
    install()
    import fsdp_train
    from fsdp_lib.interrupts import exit_without_teardown

    exit_without_teardown(fsdp_train.main(sys.argv[1:]))
