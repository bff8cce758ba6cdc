"""The varlen attention kernel alone (fsdp_lib/model/varlen.py) against SDPA with a dense document mask and against
plain causal SDPA: the largest output and gradient differences, and forward+backward milliseconds, on random
[1 x 32 x T x 64] queries with 8 key/value heads and packed documents of random lengths.

    python bench/varlen_kernel_check.py            # a GPU in bf16 (torch's varlen flash kernel); CPU in fp32
    python bench/varlen_kernel_check.py --seq 4096 --mean-doc 300
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fsdp_lib.data.batch import Documents  # noqa: E402
from fsdp_lib.model import varlen  # noqa: E402


def dense_mask(positions: torch.Tensor) -> torch.Tensor:
    document = (positions == 0).cumsum(1)
    same = document[:, :, None] == document[:, None, :]
    return (same & torch.ones_like(same[0]).tril())[:, None]


def timed(fn, reps: int) -> tuple[torch.Tensor, list[torch.Tensor], float]:
    out, grads = fn()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return out, grads, 1000 * (time.perf_counter() - start) / reps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--mean-doc", type=int, default=600)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    found = varlen._torch_varlen()
    print(f"torch {torch.__version__}, {device}, {dtype}; varlen_attn: "
          f"{inspect.signature(found[0]) if found else 'none'}")  # fmt: skip
    rng = np.random.default_rng(0)
    lengths = []
    while sum(lengths) < args.seq:
        lengths.append(int(min(args.seq - sum(lengths), max(1, rng.exponential(args.mean_doc)))))
    positions = torch.from_numpy(np.concatenate([np.arange(n) for n in lengths]))[None]
    documents = Documents.of(positions.numpy())
    documents = Documents(documents.bounds, documents.cu_seqlens.to(device), documents.longest, documents.row_length)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, h, args.seq, 64, device=device, dtype=dtype, generator=gen) for h in (32, 8, 8))
    for t in (q, k, v):
        t.requires_grad_(True)
    grad_out = torch.randn(1, args.seq, 32, 64, device=device, dtype=dtype, generator=gen)
    mask = dense_mask(positions.to(device))
    module = torch.nn.Module().eval()

    def run(kind: str):
        for t in (q, k, v):
            t.grad = None
        if kind == "varlen":
            varlen.use_documents(documents)
            out, _ = varlen.varlen_attention(module, q, k, v, varlen.documents_mark(1, device))
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask if kind == "dense mask" else None, is_causal=kind == "causal", enable_gqa=True
            ).transpose(1, 2)
        out.backward(grad_out)
        return out.detach(), [t.grad.detach().clone() for t in (q, k, v)]

    results = {kind: timed(lambda kind=kind: run(kind), args.reps) for kind in ("varlen", "dense mask", "causal")}
    ref_out, ref_grads, _ = results["dense mask"]
    out, grads, _ = results["varlen"]
    rel = lambda a, b: float((a.float() - b.float()).abs().max() / b.float().abs().max())  # noqa: E731
    print(f"{len(lengths)} documents, longest {documents.longest}, seq {args.seq}")
    print(
        f"varlen vs dense mask: output {rel(out, ref_out):.2e}, grads {max(rel(a, b) for a, b in zip(grads, ref_grads)):.2e}"
    )
    for kind, (_, _, ms) in results.items():
        print(f"{kind:>10}: {ms:8.2f} ms forward+backward")
    return 0


if __name__ == "__main__":
    sys.exit(main())
