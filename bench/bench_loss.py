"""Memory-efficient loss: peak memory and step time of the chunked loss (`--loss-chunk-tokens auto`, 512 tokens at
this vocabulary; `--chunk N` for another) against full logits (`--loss-chunk-tokens 0`), on a 1-layer Llama with a
128k vocabulary.

    python bench/bench_loss.py            # hidden 256, vocab 131072, micro-batch 4, seq 512 and 2048
    python bench/bench_loss.py --seqs 512,1024,2048 --reps 3
    python bench/bench_loss.py --quick    # tiny sizes, one repetition: proves the benchmark still runs

Both sides build the same model (seed 0, fp32, sdpa, tied embeddings like Llama 3.2 1B) and the same batch
(random token ids, every 10th label -100) and run `fsdp_train.CausalLMLoss(model, chunk)` unsharded, in one
process, without an optimizer. Each (seq, side, repetition) is a fresh subprocess, so no side inherits the
other's allocator state; the sides alternate (ABBA). In each subprocess:

1. decoder: a forward+backward that stops before the output head (`model.base_model`, then
   `last_hidden_state.sum().backward()`): the model-only baseline, also the warm-up;
2. step: the full forward+backward of the loss (decoder, head, cross-entropy), its peak memory and time.

Peak memory on CPU is the process's VmHWM, reset before each part by writing 5 to /proc/self/clear_refs; on
CUDA `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats` (that path was not run: no GPU).
The logits' share of the peak is step peak - decoder peak of the same process; the loss path's time is
step time - decoder time of the same process. Goal (issue 10): the logits' share drops by >= 4x at a step
time ratio chunked/full <= 1.05. The losses and gradient norms of the two sides must agree to 1e-5 relative,
or the benchmark exits 1 after printing its table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import REPO_ROOT, bench_arg_parser, interleaved, machine_info, median, print_table, write_results

FULL = {"hidden": 256, "layers": 1, "vocab": 131072, "batch": 4, "seqs": (512, 2048), "chunk": "auto", "reps": 2}
QUICK = {"hidden": 64, "layers": 1, "vocab": 32768, "batch": 4, "seqs": (128,), "chunk": 64, "reps": 1}
SIDES = ("chunked", "full")
GIB = 2**30
AGREE_REL = 1e-5


# --- The worker: one (seq, side) measurement in a fresh process ----------------------------------------------


def peak_memory_bytes(device: Any) -> int:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak_memory(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def measured(device: Any, fn: Any) -> tuple[Any, float, int]:
    """(fn(), seconds, peak bytes) with the peak reset just before."""
    import torch

    reset_peak_memory(device)
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - start, peak_memory_bytes(device)


def build(p: dict[str, Any], seq: int, device: Any) -> tuple[Any, Any]:
    """The model and one micro-batch, identical on both sides (seed 0)."""
    import torch
    import transformers as tf

    from fsdp_lib.data.batch import Batch
    from fsdp_lib.testing import llama_sizes

    config = tf.LlamaConfig(
        vocab_size=p["vocab"], **llama_sizes(p["hidden"], p["layers"], seq), tie_word_embeddings=True, use_cache=False
    )
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").to(device)
    model.train()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, p["vocab"], (p["batch"], seq + 1), generator=gen)
    labels = ids[:, 1:].clone()
    labels[:, ::10] = -100  # the SFT masks: ignored targets must not count
    return model, Batch(ids[:, :-1].contiguous(), labels, None).to(device)


def loss_worker(p: dict[str, Any], seq: int, side: str) -> dict[str, Any]:
    import torch

    from fsdp_lib.model.anatomy import find_decoder_layers
    from fsdp_lib.model.loss import CausalLMLoss

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, batch = build(p, seq, device)
    loss_fn = CausalLMLoss(model, p["chunk"] if side == "chunked" else 0)

    def decoder() -> None:
        hidden = model.base_model(input_ids=batch.input_ids).last_hidden_state
        hidden.sum().backward()

    def step() -> float:
        loss, _ = loss_fn(batch)  # (token loss, MoE router loss or None)
        loss.backward()
        return loss.item()

    _, decoder_s, decoder_peak = measured(device, decoder)
    model.zero_grad(set_to_none=True)
    loss, step_s, step_peak = measured(device, step)
    embed = model.get_input_embeddings().weight  # tied: head and embedding gradients both land here
    first_layer = next(iter(find_decoder_layers(model)[0].parameters()))
    return {
        "loss": loss,
        "grad_norm_embed": embed.grad.norm().item(),
        "grad_norm_first_layer": first_layer.grad.norm().item(),
        "decoder_s": decoder_s,
        "step_s": step_s,
        "loss_path_s": step_s - decoder_s,
        "decoder_peak_gib": decoder_peak / GIB,
        "step_peak_gib": step_peak / GIB,
        "logits_share_gib": (step_peak - decoder_peak) / GIB,
        "device": device.type,
        "threads": torch.get_num_threads(),
        "trained_tokens": int((batch.labels != -100).sum()),
    }


def run_worker(p: dict[str, Any], seq: int, side: str) -> dict[str, Any]:
    """One fresh process: its figures, or a RuntimeError with the end of its log."""
    spec = json.dumps({"p": p, "seq": seq, "side": side})
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", spec],
        cwd=REPO_ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"worker seq {seq} {side} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- The comparison -------------------------------------------------------------------------------------------


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def summarise(p: dict[str, Any], seq: int, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians per side, the ratios, their spread over the repetitions, and the agreement check."""
    fig = {
        side: {k: median([r[k] for r in runs[side]]) for k in ("step_s", "loss_path_s", "decoder_s")} for side in SIDES
    }
    for side in SIDES:
        for k in ("decoder_peak_gib", "step_peak_gib", "logits_share_gib"):
            fig[side][k] = median([r[k] for r in runs[side]])
    # Repetition i of each side ran next to each other (ABBA), so their ratio is one paired sample.
    pairs = list(zip(runs["chunked"], runs["full"]))
    step_ratios = [c["step_s"] / f["step_s"] for c, f in pairs]
    agreement = {
        k: max(rel_diff(c[k], f[k]) for c, f in pairs) for k in ("loss", "grad_norm_embed", "grad_norm_first_layer")
    }
    return {
        "seq": seq,
        "tokens": p["batch"] * seq,
        "figures": fig,
        "logits_share_full_over_chunked": fig["full"]["logits_share_gib"] / fig["chunked"]["logits_share_gib"],
        # the goal of --loss-chunk-tokens auto (issue 21): <= 0.4 of [tokens x vocab] fp32 logits at 2048 tokens
        "chunked_share_over_fp32_logits": fig["chunked"]["logits_share_gib"]
        * GIB
        / (p["batch"] * seq * p["vocab"] * 4),
        "step_peak_full_over_chunked": fig["full"]["step_peak_gib"] / fig["chunked"]["step_peak_gib"],
        "step_time_chunked_over_full": fig["chunked"]["step_s"] / fig["full"]["step_s"],
        "step_time_ratio_per_rep": step_ratios,
        "loss_path_time_chunked_over_full": fig["chunked"]["loss_path_s"] / fig["full"]["loss_path_s"],
        "max_rel_diff": agreement,
        "agree": all(v <= AGREE_REL for v in agreement.values()),
        "mean_loss": runs["full"][0]["loss"] / runs["full"][0]["trained_tokens"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = bench_arg_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", default="", help="comma-separated sequence lengths (default: 512,2048)")
    parser.add_argument("--chunk", default="", help="--loss-chunk-tokens of the chunked side (default: auto)")
    args = parser.parse_args(argv)
    p = dict(QUICK if args.quick else FULL)
    from fsdp_lib.model.loss import loss_chunk_tokens

    p["chunk"] = loss_chunk_tokens(args.chunk or p["chunk"], p["vocab"])
    if args.seqs:
        p["seqs"] = tuple(int(s) for s in args.seqs.split(","))
    reps = args.reps or p["reps"]
    info = machine_info()
    start = time.perf_counter()
    runs, summaries = {}, []
    for seq in p["seqs"]:
        print(f"seq {seq}, micro-batch {p['batch']}, vocab {p['vocab']}:", flush=True)
        sides = {side: (lambda s=side, q=seq: run_worker(p, q, s)) for side in SIDES}
        runs[seq] = interleaved(
            reps,
            sides,
            summary=lambda r: (
                f"step {r['step_s']:.2f}s (decoder {r['decoder_s']:.2f}s), peak {r['step_peak_gib']:.2f} GiB, "
                f"logits' share {r['logits_share_gib']:.2f} GiB, loss {r['loss']:.6g}"
            ),
        )
        summaries.append(summarise(p, seq, runs[seq]))
    rows = []
    for s in summaries:
        for side in SIDES:
            f = s["figures"][side]
            per_rep = runs[s["seq"]][side]
            rows.append(
                [
                    s["seq"],
                    side,
                    f["decoder_peak_gib"],
                    f["step_peak_gib"],
                    f["logits_share_gib"],
                    f["step_s"],
                    ", ".join(f"{r['step_s']:.2f}" for r in per_rep),
                    f["loss_path_s"],
                ]
            )
    print_table(
        [
            "seq",
            "side",
            "decoder peak (GiB)",
            "step peak (GiB)",
            "logits' share (GiB)",
            "step (s)",
            "step per rep (s)",
            "loss path (s)",
        ],
        rows,
    )
    for s in summaries:
        ratios = ", ".join(f"{r:.3f}" for r in s["step_time_ratio_per_rep"])
        print(
            f"seq {s['seq']}: logits' share full/chunked {s['logits_share_full_over_chunked']:.2f}x "
            f"(goal >= 4), step time chunked/full {s['step_time_chunked_over_full']:.3f} (per rep {ratios}; "
            f"goal <= 1.05), loss path time chunked/full {s['loss_path_time_chunked_over_full']:.3f}; "
            f"chunked share / full fp32 logits {s['chunked_share_over_fp32_logits']:.2f} (chunk {p['chunk']}); "
            f"max rel diff {', '.join(f'{k} {v:.1e}' for k, v in s['max_rel_diff'].items())}"
        )
    write_results(
        args.results_dir,
        "loss",
        {
            "machine": info,
            "params": {**p, "reps": reps},
            "device": runs[p["seqs"][0]]["full"][0]["device"],
            "wall_s": time.perf_counter() - start,
            "summaries": summaries,
            "runs": {str(seq): r for seq, r in runs.items()},
        },
    )
    failed = [s["seq"] for s in summaries if not s["agree"]]
    if failed:
        print(f"the chunked and full losses disagree beyond {AGREE_REL:g} relative at seq {failed}")
        return 1
    return 0


if __name__ == "__main__":
    from fsdp_lib.interrupts import exit_without_teardown  # a worker skips the interpreter teardown

    if len(sys.argv) > 2 and sys.argv[1] == "--worker":  # launched by run_worker
        spec = json.loads(sys.argv[2])
        print(json.dumps(loss_worker(spec["p"], spec["seq"], spec["side"])))
        exit_without_teardown(0)
    sys.exit(main())
