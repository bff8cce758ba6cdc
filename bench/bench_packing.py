"""What keeping packed documents apart costs: fsdp_train.py's step time and peak memory with document masking by
the varlen kernel and by the dense [T x T] mask, each as a ratio to the same run with no document masking (plain
causal attention over the whole block), at long sequences.

    python bench/bench_packing.py                    # CPU, 1 process: seq 16,384 and 32,768; several minutes
    python bench/bench_packing.py --seqs 8192        # other lengths
    python bench/bench_packing.py --quick            # seconds: seq 512, the plumbing only

The model is a 2-layer Llama with grouped-query attention (hidden 256, 4 query heads, 2 key/value heads), made
here with a tokenizer trained on a generated corpus of short documents (about 150 tokens each: many documents per
block, the case where a mask costs most). Each setting is one `torchrun --nproc_per_node 1 fsdp_train.py` launch,
-b 1, fp32, no activation checkpointing, the loss in chunks: "unmasked" (--document-masking off), "varlen"
(--attn-implementation varlen: each document attends to itself, no mask) and "dense mask" (--attn-implementation
sdpa: transformers' [1 x 1 x T x T] mask). The figures are fsdp_train.py's own (metrics.jsonl, a window per step,
the first skipped): the median step time and the peak resident set (VmHWM; the CUDA allocator's peak on a GPU).
Goal (issue 32): varlen at most 1.3x the unmasked step and 1.2x its peak memory at seq 32,768.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from common import REPO_ROOT, bench_arg_parser, machine_info, median, print_table, work_folder, write_results
from inputs import make_corpus, save_text_dataset
from launch import report_failures, run_trainer

FULL = {"seqs": (16_384, 32_768), "steps": 4, "corpus_chars": 1_500_000, "precision": "fp32"}
QUICK = {"seqs": (512,), "steps": 3, "corpus_chars": 60_000, "precision": "fp32"}
SETTINGS = {
    "unmasked": ["--document-masking", "off"],
    "varlen": ["--document-masking", "on", "--attn-implementation", "varlen"],
    "dense mask": ["--document-masking", "on", "--attn-implementation", "sdpa"],
}
GOALS = {"varlen": (1.3, 1.2)}  # (step time, peak memory) as ratios to unmasked, at the longest sequence


def make_inputs(work: Path, corpus_chars: int, max_positions: int) -> tuple[Path, Path]:
    """work/dataset (short documents) and work/model (the 2-layer GQA Llama, random weights made by the trainer)."""
    from fsdp_lib.testing import llama_sizes, make_model

    docs = make_corpus(corpus_chars, mean_doc_chars=600)
    sizes = {**llama_sizes(256, 2, max_positions), "num_key_value_heads": 2}
    make_model(work / "model", texts=docs[:300], vocab_size=4096, sizes=sizes, seed=0)
    return save_text_dataset(docs, work / "dataset"), work / "model"


def run_setting(work: Path, dataset: Path, model: Path, seq: int, name: str, p: dict[str, Any]) -> dict[str, Any]:
    exp = f"packing_{seq}_{name.replace(' ', '_')}"
    args = ["-e", exp, "-d", str(dataset), "-m", str(model), "--save-dir", str(work / "outputs")]
    args += ["--seq-length", str(seq), "--precision", p["precision"], "-b", "1", "--max-steps", str(p["steps"])]
    args += ["--num-epochs", "1000", "--log-freq", "1", "--ckpt-freq", "0", "--activation-checkpointing", "off"]
    args += ["--lr", "1e-4", *SETTINGS[name]]
    run = run_trainer(REPO_ROOT / "fsdp_train.py", args, 1, work / "outputs" / exp)
    if run.failure:
        return run.failure
    steady = run.windows[1:]
    if not steady:
        raise RuntimeError(f"{exp}: {len(run.windows)} metric windows; need at least 2 steps")
    masking = next((line for line in run.log.splitlines() if "packed documents kept apart" in line), "")
    return {
        "status": "ok",
        "step_s": median([seq / r["tokens_per_s"] for r in steady]),
        "peak_gb": max(r["mem_peak_alloc_gb"] for r in steady),
        "losses": [r["loss"] for r in run.windows],
        "masking_log": masking.strip()[-160:],
    }


def main(argv: list[str] | None = None) -> int:
    parser = bench_arg_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", default="", help="comma-separated sequence lengths (default: 16384,32768)")
    parser.add_argument("--steps", type=int, default=0, help="optimizer steps per setting (default: 4)")
    args = parser.parse_args(argv)
    p = dict(QUICK if args.quick else FULL)
    if args.seqs:
        p["seqs"] = tuple(int(s) for s in args.seqs.split(","))
    p["steps"] = args.steps or p["steps"]
    results: dict[str, dict[str, Any]] = {}
    with work_folder(args, "bench_packing_") as work:
        dataset, model = make_inputs(work, p["corpus_chars"], max(p["seqs"]))
        for seq in p["seqs"]:
            for name in SETTINGS:
                results[f"{seq} {name}"] = {"seq": seq, "setting": name}
                results[f"{seq} {name}"] |= run_setting(work, dataset, model, seq, name, p)
                r = results[f"{seq} {name}"]
                print(f"  seq {seq} {name}: " + (f"{r['step_s']:.2f} s/step" if r["status"] == "ok" else r["status"]))
    rows, verdicts = [], []
    for r in results.values():
        base = results.get(f"{r['seq']} unmasked", {})
        if r["status"] != "ok" or base.get("status") != "ok":
            rows.append([r["seq"], r["setting"], r["status"], "-", "-", "-"])
            continue
        r["time_ratio"], r["memory_ratio"] = r["step_s"] / base["step_s"], r["peak_gb"] / base["peak_gb"]
        rows.append(
            [
                r["seq"],
                r["setting"],
                round(r["step_s"], 3),
                f"{r['time_ratio']:.2f}x",
                r["peak_gb"],
                f"{r['memory_ratio']:.2f}x",
            ]
        )
        if r["setting"] in GOALS and r["seq"] == max(p["seqs"]):
            time_goal, memory_goal = GOALS[r["setting"]]
            met = r["time_ratio"] <= time_goal and r["memory_ratio"] <= memory_goal
            verdicts.append(
                f"{r['setting']} at seq {r['seq']}: {r['time_ratio']:.2f}x time (goal <= {time_goal}x), "
                f"{r['memory_ratio']:.2f}x memory (goal <= {memory_goal}x): {'met' if met else 'NOT met'}"
            )
    print(f"2-layer GQA Llama (hidden 256), -b 1, {p['precision']}, {p['steps']} steps, 1 process")
    print_table(["seq", "setting", "step (s)", "vs unmasked", "peak mem (GB)", "vs unmasked"], rows)
    for line in verdicts:
        print(line)
    write_results(args.results_dir, "packing", {"machine": machine_info(), "params": p, "results": results})
    return report_failures(results)


if __name__ == "__main__":
    sys.exit(main())
