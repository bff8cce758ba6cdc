"""DPO (`fsdp_train.py` on preference pairs) against a TRL-style DPO written here: peak memory per rank and pairs/s
of our precomputed-reference run (full weights) and of our LoRA run (reference = adapters off), on pairs of widely
mixed lengths, on CPU with 2 processes and, when a GPU is lent, on one GPU.

    python bench/bench_dpo.py            # CPU: the 125M preset, bf16, 2 processes, 2 repetitions of 3 runs
    python bench/bench_dpo.py --reps 3   # more repetitions (~5 minutes more)
    python bench/bench_dpo.py --quick    # hidden 256, 2 layers, a few steps: proves the benchmark still runs

Inputs are made here, nothing is downloaded. A byte-level BPE tokenizer (32000 tokens) is trained on a generated
pseudo-prose corpus and given the Llama-3 chat template and its three header/turn special tokens; the model is
`model_download.py --init 125M --tokenizer <that> --with-weights --dtype bfloat16` (SmolLM-135M's shape: 30 layers,
hidden 576, GQA 9/3, tied embeddings; 124,637,184 parameters with the 32003-token vocabulary, random weights).
The preference dataset (a `datasets.DatasetDict` with a `train` split of `prompt`, `chosen`, `rejected` message
lists) has one user turn per prompt and one assistant turn per response, each a slice of pseudo-prose whose length
is drawn log-uniformly between --min-tokens and --max-tokens (default 16 and 256), independently for the prompt,
the chosen and the rejected turn, so pairs range from ~90 to ~1000 tokens (prompt counted twice, as both sides
train on it). Pairs longer than one block (--seq-length) are redrawn, so neither side truncates anything.

Runs (each one `torchrun --nproc_per_node 2` launch, gloo, one OpenMP thread per process, bf16 compute with fp32
weights, AdamW(0.9, 0.95, eps 1e-8, no weight decay), clipping at 1.0, activation checkpointing off, sigmoid loss
with beta 0.1, one epoch over the same pairs; the three alternate in ABBA order, medians of --reps):

1. ours, full weights: `fsdp_train.py --reference precomputed`, unchanged, from a worker that only notes its RSS.
   The pairs are packed whole into blocks of --seq-length (chosen and rejected as separate documents, document
   masking), one block per process per step; the reference log-probabilities are computed once before step 1
   (timed from the trainer's log line) into a fresh save folder, so every repetition computes them again.
2. ours, LoRA: `--peft lora --lora-rank 16` (every attention and MLP Linear), reference auto = the same model with
   its adapters off (a second forward per micro-batch).
3. baseline, TRL-style (dpo_baseline.py: written, not imported): the same HF model under FSDP2 (fully_shard per decoder
   layer, then the root; bf16 MixedPrecisionPolicy; weights loaded shard by shard), a second, frozen reference copy
   sharded the same way; each step every process takes --baseline-pairs pairs in a seeded random order, tokenised
   as TRL's DPOTrainer does (the prompt rendered with the generation prompt, each completion the rest of the full
   render, tokenised separately), chosen and rejected concatenated into one batch padded to its longest sequence
   (attention_mask), the policy's forward with gradient, then the reference's under no_grad (TRL's order), full
   logits -> TRL's selective_log_softmax (row by row for bf16 logits) -> the masked completion sums, the sigmoid
   DPO loss, backward, clipping, AdamW. TRL also appends EOS to each completion; here it does not, so both sides
   train the same response tokens (the benchmark checks this against our token cache).

Measures (per run; the window of a figure is one optimizer step, --log-freq 1, the first one is warm-up):

- pairs/s: median over the steady windows of pairs / window time (ours: its own `pairs_per_s`; the baseline: the
  same, timed by its worker from batch assembly to the end of the step's metric all-reduce). With packing a
  window's pairs depend on its blocks, so the aggregate (all steady pairs / all steady time) is shown too.
- end-to-end pairs/s: all pairs trained / (precompute time + every window's time, warm-up included); start-up,
  tokenising, loading and our final checkpoint and export are not in it (the launch's wall time is reported).
- peak per rank: the highest steady window's peak, maximum over the ranks. On CPU the process's VmHWM (peak RSS),
  reset at every window start (/proc/self/clear_refs), as fsdp_train.py's `mem_peak_alloc_gb` does; on a GPU
  torch.cuda.max_memory_allocated, reset the same way. "above runtime": less the ranks' RSS after imports.
  whole-run: the highest VmHWM over the launch (loading, precompute, export included), read before each reset.
- pairs per step, the tokens each side pushes through the model (blocks x --seq-length; padded batch size x
  longest), and the real tokens in them.

Goals (issue): ours with full weights: peak per rank <= 0.7x the baseline's; pairs/s >= 1.5x the baseline's on
mixed lengths. The LoRA run's ratios against the same full-weight baseline are reported, not goals (a TRL LoRA run
is not measured here).

Precision: bf16 compute (MixedPrecisionPolicy with fp32 weights, gradients and AdamW moments) on CPU too, as
bench_peft.py: this CPU (AVX512-BF16, AMX) runs bf16 faster than fp32, and a GPU run would be bf16; --precision fp32
measures the CPU default. The default run takes ~11 minutes on a quiet 2-core machine (6 launches, each ~25-40 s of
start-up, loading and, for ours, the final checkpoint and export); --quick ~1.5 minutes.

GPU rows (when torch.cuda is available and not --quick): the same three runs on one GPU (one process), the 125M
preset, seq 2048, responses and prompts of 20-400 tokens. Without a GPU they read "not measured (no GPU lent)".
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import (
    bench_arg_parser,
    interleaved,
    last_loss,
    machine_info,
    median,
    print_table,
    work_folder,
    write_results,
)
from dpo_baseline import trl_tokenize
from inputs import init_model_folder, make_corpus
from launch import (
    LaunchError,
    failed_launch,
    gpus_hidden,
    rank_figures,
    report_failures,
    run_trainer,
    torchrun,
    trainer_worker,
)
from ratios import (
    device_results,
    failure_text,
    mode_figures,
    mode_ratios,
    numbered_runs,
    print_goal_ratios,
    print_reported_ratios,
)

CPU_FULL = {
    "label": "CPU, 2 processes",
    "preset": "125M",
    "overrides": [],
    "vocab": 32000,
    "corpus_chars": 3_000_000,
    "nproc": 2,
    "seq": 1024,  # our block: the longest pair fits (pairs are drawn to fit)
    "batch": 1,  # blocks per process per step (ours)
    "baseline_pairs": 3,  # pairs per process per step (the baseline)
    "pairs": 36,  # in the dataset: one epoch each run
    "min_tokens": 16,
    "max_tokens": 256,
    "precision": "bf16",
    "lora_rank": 16,
    "lr": 1e-5,
    "reps": 2,
}
CPU_QUICK = {
    "label": "CPU, 2 processes (quick)",
    "preset": "125M",
    "overrides": ["--hidden-size", "256", "--num-layers", "2", "--num-heads", "4", "--num-kv-heads", "2"],
    "vocab": 1024,
    "corpus_chars": 300_000,
    "nproc": 2,
    "seq": 256,
    "batch": 1,
    "baseline_pairs": 2,
    "pairs": 16,
    "min_tokens": 8,
    "max_tokens": 64,
    "precision": "bf16",
    "lora_rank": 8,
    "lr": 1e-4,
    "reps": 1,
    "modes": ("full", "baseline"),  # the smoke test proves both sides run (the DPO tests train LoRA)
}
CPU_QUICK["overrides"] += ["--intermediate-size", "512"]
GPU_FULL = {
    "label": "1 GPU",
    "preset": "125M",
    "overrides": [],
    "vocab": 32000,
    "corpus_chars": 3_000_000,
    "nproc": 1,
    "seq": 2048,
    "batch": 4,
    "baseline_pairs": 12,
    "pairs": 480,
    "min_tokens": 20,
    "max_tokens": 400,
    "precision": "bf16",
    "lora_rank": 16,
    "lr": 1e-5,
    "reps": 2,
}
MODES = ("full", "lora", "baseline")
NAMES = {
    "full": "ours, full weights, precomputed reference",
    "lora": "ours, LoRA, reference = adapters off",
    "baseline": "TRL-style: live reference copy, padded batches",
}
GOALS = {  # ratio key -> (comparison, bound, description)
    "full_over_baseline_peak": ("<=", 0.7, "ours (full weights) / baseline, peak memory per rank"),
    "full_over_baseline_pairs_per_s": (">=", 1.5, "ours (full weights) / baseline, pairs/s"),
}
BETA = 0.1
# The Llama-3 chat template (tests/fixtures/chat_templates/llama3.jinja) and the special tokens it uses
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
TEMPLATE_TOKENS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
PRECOMPUTE_LINE = re.compile(
    r"reference log-probabilities of the train pairs: computed .* in ([\d.]+)s \(([\d,]+) pairs"
)
PACKING_LINE = re.compile(r"([\d,]+) train pairs packed whole into ([\d,]+) blocks \(([\d.]+)% of their tokens used")
PEFT_LINE = re.compile(r"--peft \w+: ([\d,]+) trainable of ([\d,]+) parameters")


# --- Inputs ------------------------------------------------------------------------------------------------------


def make_tokenizer(folder: Path, docs: list[str], vocab: int) -> Any:
    """model_download.py's byte-level BPE trained on `docs`, plus the Llama-3 template and its special tokens."""
    from fsdp_lib.hub.tokenizer import train_bpe_tokenizer

    batches = [docs[i : i + 1000] for i in range(0, len(docs), 1000)]
    tokenizer = train_bpe_tokenizer(batches, vocab, 4096, len(docs))
    tokenizer.add_special_tokens({"additional_special_tokens": TEMPLATE_TOKENS})
    tokenizer.chat_template = LLAMA3_TEMPLATE
    tokenizer.save_pretrained(folder)
    return tokenizer


def init_model(work: Path, tokenizer_dir: Path, p: dict[str, Any]) -> Path:
    """model_download.py --init <preset> [overrides] --tokenizer <dir> --with-weights (bf16 safetensors)."""
    flags = [*p["overrides"], "--tokenizer", str(tokenizer_dir), "--with-weights", "--dtype", "bfloat16"]
    return init_model_folder(work / "model", p["preset"], flags)


def make_pairs(tokenizer: Any, p: dict[str, Any], seed: int = 1) -> list[dict[str, list[dict[str, str]]]]:
    """p["pairs"] preference pairs: a user prompt, a chosen and a rejected assistant turn, each a slice of pseudo-prose
    of a log-uniform number of tokens in [min_tokens, max_tokens]; a pair whose two rendered sequences exceed one
    block is redrawn."""
    docs = make_corpus(max(200_000, p["pairs"] * p["max_tokens"] * 40), seed=seed)
    encoded = tokenizer.backend_tokenizer.encode_batch(docs, add_special_tokens=False)
    stream = np.concatenate([np.asarray(e.ids, dtype=np.int64) for e in encoded])
    rng = np.random.default_rng(seed)
    lo, hi = np.log(p["min_tokens"]), np.log(p["max_tokens"])

    def piece() -> str:
        n = int(round(np.exp(rng.uniform(lo, hi))))
        start = int(rng.integers(0, len(stream) - n))
        return tokenizer.decode(stream[start : start + n].tolist()).strip()

    pairs = []
    while len(pairs) < p["pairs"]:
        pair = {
            "prompt": [{"role": "user", "content": piece()}],
            "chosen": [{"role": "assistant", "content": piece()}],
            "rejected": [{"role": "assistant", "content": piece()}],
        }
        if sum(len(ids) for ids in rendered_ids(tokenizer, pair)) <= p["seq"] - 8:
            pairs.append(pair)
    return pairs


def rendered_ids(tokenizer: Any, pair: dict) -> list[list[int]]:
    """The token ids of prompt + chosen and prompt + rejected, each rendered whole with the chat template."""
    texts = [tokenizer.apply_chat_template(pair["prompt"] + pair[k], tokenize=False) for k in ("chosen", "rejected")]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def save_pairs(pairs: list[dict], folder: Path) -> Path:
    import datasets

    datasets.disable_progress_bars()
    columns = {k: [pair[k] for pair in pairs] for k in ("prompt", "chosen", "rejected")}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(columns)}).save_to_disk(str(folder))
    return folder


def prepare(work: Path, p: dict[str, Any], name: str) -> dict[str, Any]:
    """The tokenizer, model folder, preference dataset and the baseline's tokenised pairs for configuration p."""
    start = time.perf_counter()
    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    docs = make_corpus(p["corpus_chars"])
    tokenizer = make_tokenizer(folder / "tokenizer", docs, p["vocab"])
    model_dir = init_model(folder, folder / "tokenizer", p)
    pairs = make_pairs(tokenizer, p)
    dataset = save_pairs(pairs, folder / "pairs")
    baseline_pairs = trl_tokenize(tokenizer, pairs)
    pairs_file = folder / "baseline_pairs.json"
    pairs_file.write_text(json.dumps(baseline_pairs))
    lengths = [len(r["prompt"]) * 2 + len(r["chosen"]) + len(r["rejected"]) for r in baseline_pairs]
    turns = [len(r[k]) for r in baseline_pairs for k in ("chosen", "rejected")]
    stats = {
        "pairs": len(pairs),
        "pair_tokens_min_median_max": [min(lengths), float(np.median(lengths)), max(lengths)],
        "response_tokens_min_median_max": [min(turns), float(np.median(turns)), max(turns)],
        "prompt_tokens_min_median_max": [
            min(len(r["prompt"]) for r in baseline_pairs),
            float(np.median([len(r["prompt"]) for r in baseline_pairs])),
            max(len(r["prompt"]) for r in baseline_pairs),
        ],
        "vocab": len(tokenizer),
        "seconds": time.perf_counter() - start,
    }
    print(
        f"{p['label']}: {len(pairs)} pairs, tokens per pair (prompt twice) {stats['pair_tokens_min_median_max']}, "
        f"per response {stats['response_tokens_min_median_max']}, per prompt {stats['prompt_tokens_min_median_max']}; "
        f"inputs made in {stats['seconds']:.0f}s",
        flush=True,
    )
    return {"dataset": dataset, "model": model_dir, "baseline_pairs": pairs_file, "data": stats, "work": folder}


# --- One run ---------------------------------------------------------------------------------------------------


def window_figures(windows: list[dict[str, Any]], precompute_s: float, on_cpu: bool, idle: float) -> dict[str, Any]:
    """A run's figures from its per-step windows ({pairs, seconds, mem_peak_alloc_gb, loss}); the first is warm-up."""
    steady = windows[1:]
    if not steady:
        raise RuntimeError(f"{len(windows)} windows: need at least 2 optimizer steps")
    pairs = sum(w["pairs"] for w in windows)
    peak = max(w["mem_peak_alloc_gb"] for w in steady)
    return {
        "status": "ok",
        "steps": len(windows),
        "pairs_trained": pairs,
        "pairs_per_step": pairs / len(windows),
        "pairs_per_s": median([w["pairs"] / w["seconds"] for w in steady]),
        "pairs_per_s_aggregate": sum(w["pairs"] for w in steady) / sum(w["seconds"] for w in steady),
        "windows_pairs_per_s": [w["pairs"] / w["seconds"] for w in windows],
        "windows_pairs": [w["pairs"] for w in windows],
        "windows_s": [w["seconds"] for w in windows],
        "precompute_s": precompute_s,
        "train_s": sum(w["seconds"] for w in windows),
        "end_to_end_pairs_per_s": pairs / (precompute_s + sum(w["seconds"] for w in windows)),
        "peak_gib": peak,
        "windows_peak_gib": [w["mem_peak_alloc_gb"] for w in windows],
        "idle_rss_gib": idle,
        "peak_above_runtime_gib": peak - idle if on_cpu else None,
        "last_loss": last_loss(windows),
    }


def run_ours(inputs: dict[str, Any], p: dict[str, Any], mode: str, rep: int, on_cpu: bool) -> dict[str, Any]:
    """One fsdp_train.py launch (full weights with a precomputed reference, or LoRA), in a fresh save folder."""
    work = inputs["work"]
    exp = f"{mode}_{rep}"
    save_dir = work / f"outputs_{exp}"  # fresh: a stored reference would be read, not computed
    args = ["-e", exp, "-d", str(inputs["dataset"]), "-m", str(inputs["model"]), "--save-dir", str(save_dir)]
    args += ["--seq-length", str(p["seq"]), "-b", str(p["batch"]), "--precision", p["precision"], "--lr", str(p["lr"])]
    args += ["--num-epochs", "1", "--log-freq", "1", "--ckpt-freq", "0", "--activation-checkpointing", "off"]
    args += ["--dpo-beta", str(BETA), "--dpo-loss", "sigmoid"]
    args += ["--reference", "precomputed"] if mode == "full" else ["--peft", "lora", "--lora-rank", str(p["lora_rank"])]
    prefix = work / f"{exp}.rss"
    start = time.perf_counter()
    run = run_trainer(Path(__file__), ["--worker", str(prefix), *args], p["nproc"], save_dir / exp)
    if run.failure:
        return run.failure
    launch_s = time.perf_counter() - start
    log = run.log
    token_check = check_tokens(save_dir, inputs["baseline_pairs"]) if rep == 0 else None
    references = list(save_dir.glob(".token_cache/*/train.reference-*.f64"))
    if token_check is not None and references:
        token_check["reference_logps"] = np.fromfile(references[0], dtype=np.float64).tolist()
    windows = []
    for r in run.windows:
        seconds = r["trained_tokens"] / r["trained_tokens_per_s"]
        windows.append(
            {
                "pairs": int(round(r["pairs_per_s"] * seconds)),
                "seconds": seconds,
                "mem_peak_alloc_gb": r["mem_peak_alloc_gb"],
                "loss": r["loss"],
                "trained_tokens": r["trained_tokens"],
            }
        )
    precompute = PRECOMPUTE_LINE.search(log)
    idle, run_peak = rank_figures(work, prefix.name, p["nproc"])
    out = window_figures(windows, float(precompute.group(1)) if precompute else 0.0, on_cpu, idle)
    out |= {
        "launch_s": launch_s,
        "run_peak_rss_gib": run_peak,
        "trained_tokens": sum(w["trained_tokens"] for w in windows),
    }
    out["model_tokens"] = len(windows) * p["nproc"] * p["batch"] * p["seq"]
    if m := PACKING_LINE.search(log):
        out["packing"] = {"pairs": int(m.group(1).replace(",", "")), "blocks": int(m.group(2).replace(",", ""))}
        out["packing"]["tokens_used_percent"] = float(m.group(3))
    if m := PEFT_LINE.search(log):
        out["trainable"], out["total"] = (int(g.replace(",", "")) for g in m.groups())
    if mode == "full" and precompute is None:
        raise RuntimeError(f"{exp}: no 'reference log-probabilities ... computed' line in the log:\n{log[-3000:]}")
    if token_check is not None:
        out["token_check"] = token_check
    import shutil

    shutil.rmtree(save_dir, ignore_errors=True)
    return out


def check_tokens(save_dir: Path, baseline_pairs: Path) -> dict[str, Any]:
    """Our token cache (sequence 2p = prompt + chosen of pair p, 2p + 1 = prompt + rejected; the trained mask) against
    the baseline's TRL-style tokens: equal response tokens per sequence, and the sequences' lengths."""
    rows = json.loads(baseline_pairs.read_text())
    (tokens_file,) = save_dir.glob(".token_cache/*/train.tokens")
    docs = np.fromfile(tokens_file.with_suffix(".docs"), dtype=np.int64)
    mask = np.fromfile(tokens_file.with_suffix(".mask"), dtype=np.uint8)
    tokens = np.fromfile(tokens_file, dtype=np.uint16 if tokens_file.stat().st_size == 2 * len(mask) else np.uint32)
    starts = np.concatenate([[0], docs[:-1]])
    ours = [(tokens[a:b], mask[a:b].astype(bool)) for a, b in zip(starts, docs)]
    theirs = [(r["prompt"] + r[k], r[k]) for r in rows for k in ("chosen", "rejected")]
    same_trained = sum(ids[m].tolist() == response for (ids, m), (_, response) in zip(ours, theirs))
    length_diff = [len(ids) - len(b_ids) for (ids, _), (b_ids, _) in zip(ours, theirs)]
    return {
        "sequences": len(ours),
        "baseline_sequences": len(theirs),
        "response_tokens_equal": same_trained,
        "ours_tokens": int(len(tokens)),
        "baseline_tokens": int(sum(len(b) for b, _ in theirs)),
        "length_diff_min_max": [min(length_diff), max(length_diff)] if length_diff else None,
    }


def run_baseline(inputs: dict[str, Any], p: dict[str, Any], rep: int, on_cpu: bool) -> dict[str, Any]:
    """One torchrun launch of the TRL-style worker."""
    from transformers import AutoTokenizer

    work = inputs["work"]
    prefix = work / f"baseline_{rep}.rss"
    tokenizer = AutoTokenizer.from_pretrained(inputs["model"])
    config = {
        "model": str(inputs["model"]),
        "pairs": str(inputs["baseline_pairs"]),
        "pairs_per_rank": p["baseline_pairs"],
        "precision": p["precision"],
        "lr": p["lr"],
        "seed": 0,
        "pad_id": tokenizer.pad_token_id,
        "beta": BETA,
        "out": str(prefix),
    }
    config_file = work / f"baseline_{rep}.json"
    config_file.write_text(json.dumps(config))
    start = time.perf_counter()
    try:
        torchrun(Path(__file__).with_name("dpo_baseline.py"), [str(config_file)], p["nproc"], timeout=1800)
    except LaunchError as exc:
        return failed_launch(exc)
    launch_s = time.perf_counter() - start
    windows = json.loads(Path(f"{prefix}.windows.json").read_text())
    idle, run_peak = rank_figures(work, prefix.name, p["nproc"])
    out = window_figures(windows, 0.0, on_cpu, idle)
    out |= {"launch_s": launch_s, "run_peak_rss_gib": run_peak}
    out["trained_tokens"] = sum(w["trained_tokens"] for w in windows)
    out["model_tokens"] = sum(w["padded_tokens"] for w in windows)
    out["real_tokens"] = sum(w["real_tokens"] for w in windows)
    checks = [json.loads(f.read_text())["reference_check"] for f in sorted(work.glob(f"{prefix.name}.rank*.json"))]
    out["reference_check"] = {
        "pairs": [i for c in checks for i in c["pairs"]],
        "chosen": [v for c in checks for v in c["reference_logps"][: len(c["pairs"])]],
        "rejected": [v for c in checks for v in c["reference_logps"][len(c["pairs"]) :]],
    }
    return out


def compare_references(ours: list[float], baseline: dict[str, list]) -> dict[str, Any]:
    """Our precomputed reference log-probs (sequence 2i, 2i + 1 = pair i's chosen, rejected; packed blocks) against
    the baseline's live reference model on its first step's pairs (padded batches): the same sums, up to bf16."""
    ours_values = [ours[2 * i + k] for k in (0, 1) for i in baseline["pairs"]]
    theirs = baseline["chosen"] + baseline["rejected"]
    diffs = [abs(a - b) for a, b in zip(ours_values, theirs)]
    return {
        "sequences": len(diffs),
        "max_abs_diff": max(diffs),
        "max_rel_diff": max(d / max(1e-9, abs(b)) for d, b in zip(diffs, theirs)),
        "ours": ours_values,
        "baseline": theirs,
    }


def summary(r: dict[str, Any]) -> str:
    if (failed := failure_text(r)) is not None:
        return failed
    pre = f", precompute {r['precompute_s']:.1f}s" if r["precompute_s"] else ""
    return (
        f"{r['pairs_per_s']:.3f} pairs/s (windows {', '.join(f'{t:.2f}' for t in r['windows_pairs_per_s'])}; "
        f"aggregate {r['pairs_per_s_aggregate']:.3f}), {r['pairs_trained']} pairs in {r['steps']} steps{pre}, "
        f"end-to-end {r['end_to_end_pairs_per_s']:.3f} pairs/s, peak {r['peak_gib']:.3f} GiB/rank "
        f"(whole run {r['run_peak_rss_gib']:.3f}), launch {r['launch_s']:.0f}s, loss {r['last_loss']:.4g}"
    )


# --- The comparison ----------------------------------------------------------------------------------------------

FIGURE_KEYS = (
    "pairs_per_s",
    "pairs_per_s_aggregate",
    "end_to_end_pairs_per_s",
    "precompute_s",
    "train_s",
    "launch_s",
    "pairs_per_step",
    "pairs_trained",
    "steps",
    "peak_gib",
    "peak_above_runtime_gib",
    "run_peak_rss_gib",
    "model_tokens",
    "trained_tokens",
    "last_loss",
)
RATIOS = {  # key -> (numerator mode, denominator mode, figure)
    "full_over_baseline_peak": ("full", "baseline", "peak_gib"),
    "full_over_baseline_pairs_per_s": ("full", "baseline", "pairs_per_s"),
    "full_over_baseline_pairs_per_s_aggregate": ("full", "baseline", "pairs_per_s_aggregate"),
    "full_over_baseline_end_to_end_pairs_per_s": ("full", "baseline", "end_to_end_pairs_per_s"),
    "full_over_baseline_peak_above_runtime": ("full", "baseline", "peak_above_runtime_gib"),
    "full_over_baseline_whole_run_peak": ("full", "baseline", "run_peak_rss_gib"),
    "lora_over_baseline_peak": ("lora", "baseline", "peak_gib"),
    "lora_over_baseline_pairs_per_s": ("lora", "baseline", "pairs_per_s"),
    "lora_over_baseline_end_to_end_pairs_per_s": ("lora", "baseline", "end_to_end_pairs_per_s"),
}


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians per mode, the ratios of the medians, and the per-repetition ratios."""
    fig = mode_figures(runs, FIGURE_KEYS, ("trainable", "total", "real_tokens", "packing", "token_check"))
    check = fig["full"].get("token_check", {})
    baseline_ok = [r for r in runs["baseline"] if r["status"] == "ok"]
    if "reference_logps" in check and baseline_ok:
        check["reference"] = compare_references(check.pop("reference_logps"), baseline_ok[0]["reference_check"])
    ratios, per_rep = mode_ratios(fig, runs, RATIOS)
    return {"figures": fig, "ratios": ratios, "ratios_per_rep": per_rep}


def table_rows(label: str, s: dict[str, Any], runs: dict[str, list[dict[str, Any]]]) -> list[list[Any]]:
    rows = []
    for mode in MODES:
        f = s["figures"][mode]
        if "pairs_per_s" not in f:
            status = ", ".join(r["status"] for r in runs[mode]) or "not run (--quick)"
            rows.append([label, NAMES[mode], status, *["-"] * 9])
            continue
        above = f.get("peak_above_runtime_gib")
        tokens = f"{f['model_tokens']:,.0f}" + (f" ({f['real_tokens']:,} real)" if "real_tokens" in f else "")
        rows.append(
            [
                label,
                NAMES[mode],
                f["pairs_per_s"],
                ", ".join(f"{r['pairs_per_s']:.3f}" for r in runs[mode] if r["status"] == "ok"),
                f["pairs_per_s_aggregate"],
                f"{f['end_to_end_pairs_per_s']:.3g}" + (f" ({f['precompute_s']:.1f} s)" if f["precompute_s"] else ""),
                f"{f['pairs_per_step']:.2f} ({f['steps']:.0f} steps)",
                tokens,
                f["peak_gib"],
                "-" if above is None else above,
                f["run_peak_rss_gib"],
                f["last_loss"],
            ]
        )
    return rows


HEADERS = [
    "device",
    "run",
    "pairs/s (median)",
    "pairs/s per rep",
    "pairs/s (aggregate)",
    "end-to-end pairs/s (precompute)",
    "pairs per step",
    "tokens through the model",
    "peak per rank (GiB)",
    "peak above runtime (GiB)",
    "whole-run peak (GiB)",
    "last loss",
]


def print_ratios(label: str, s: dict[str, Any]) -> None:
    print_goal_ratios(label, s, GOALS)
    print_reported_ratios(label, s, RATIOS, GOALS)
    check = s["figures"]["full"].get("token_check")
    if check:
        print(
            f"{label}: tokens: response tokens equal in {check['response_tokens_equal']} of {check['sequences']} "
            f"sequences; all tokens ours {check['ours_tokens']:,} vs baseline {check['baseline_tokens']:,} "
            f"(per sequence {check['length_diff_min_max']})"
        )
    if check and "reference" in check:
        ref = check["reference"]
        print(
            f"{label}: reference log-probs, ours precomputed (packed) vs the baseline's live reference (padded), "
            f"{ref['sequences']} sequences of its first step: max difference {ref['max_abs_diff']:.3g} "
            f"({ref['max_rel_diff']:.2%} relative)"
        )


def measure(inputs: dict[str, Any], p: dict[str, Any], reps: int, on_cpu: bool) -> tuple[dict, dict]:
    print(f"{p['label']}: seq {p['seq']}, {p['precision']}, {reps} repetitions:", flush=True)
    counters = {mode: iter(range(reps)) for mode in MODES}
    sides = {
        "full": lambda: run_ours(inputs, p, "full", next(counters["full"]), on_cpu),
        "lora": lambda: run_ours(inputs, p, "lora", next(counters["lora"]), on_cpu),
        "baseline": lambda: run_baseline(inputs, p, next(counters["baseline"]), on_cpu),
    }
    with gpus_hidden(on_cpu):
        runs = interleaved(reps, {mode: sides[mode] for mode in p.get("modes", MODES)}, summary=summary)
    runs = {mode: runs.get(mode, []) for mode in MODES}  # a mode not run (--quick: lora) has no runs
    return runs, summarise(runs)


def main(argv: list[str] | None = None) -> int:
    parser = bench_arg_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="", help="compute dtype (default: bf16)")
    parser.add_argument("--pairs", type=int, default=0, help="pairs in the dataset, one epoch per run (CPU)")
    parser.add_argument("--min-tokens", type=int, default=0, help="shortest prompt/response (CPU; default 16)")
    parser.add_argument("--max-tokens", type=int, default=0, help="longest prompt/response (CPU; default 256)")
    args = parser.parse_args(argv)
    import torch

    started = time.perf_counter()
    p = dict(CPU_QUICK if args.quick else CPU_FULL)
    p["precision"] = args.precision or p["precision"]
    p["pairs"] = args.pairs or p["pairs"]
    p["min_tokens"] = args.min_tokens or p["min_tokens"]
    p["max_tokens"] = args.max_tokens or p["max_tokens"]
    reps = args.reps or p["reps"]
    gpu = torch.cuda.is_available() and not args.quick
    gpu_note = "not measured (--quick)" if args.quick else "not measured (no GPU lent)"
    results: dict[str, Any] = {"machine": machine_info(), "params": {"cpu": {**p, "reps": reps}}}
    with work_folder(args, "bench_dpo_") as work:
        inputs = prepare(work, p, "cpu")
        results["data"] = {"cpu": inputs["data"]}
        cpu_runs, cpu_summary = measure(inputs, p, reps, on_cpu=True)
        results["cpu"] = device_results(cpu_runs, cpu_summary, GOALS)
        if gpu:
            g = {**GPU_FULL, "reps": args.reps or GPU_FULL["reps"]}
            results["params"]["gpu"] = g
            gpu_inputs = prepare(work, g, "gpu")
            results["data"]["gpu"] = gpu_inputs["data"]
            gpu_runs, gpu_summary = measure(gpu_inputs, g, g["reps"], on_cpu=False)
            results["gpu"] = device_results(gpu_runs, gpu_summary, GOALS)
        else:
            results["gpu"] = gpu_note
    rows = table_rows(p["label"], cpu_summary, cpu_runs)
    if gpu:
        rows += table_rows("1 GPU, 125M, bf16", gpu_summary, gpu_runs)
    else:
        rows += [["1 GPU, 125M, bf16", NAMES[mode], gpu_note, *["-"] * 9] for mode in MODES]
    print_table(HEADERS, rows)
    print_ratios(p["label"], cpu_summary)
    if gpu:
        print_ratios("1 GPU", gpu_summary)
    else:
        print(f"1 GPU: {gpu_note}")
    results["seconds"] = time.perf_counter() - started
    print(f"benchmark time: {results['seconds'] / 60:.1f} minutes")
    write_results(args.results_dir, "dpo", results)
    all_runs = numbered_runs("cpu", cpu_runs)
    if gpu:
        all_runs |= numbered_runs("gpu", gpu_runs)
    return report_failures(all_runs)


if __name__ == "__main__":
    from fsdp_lib.interrupts import exit_without_teardown  # a worker skips the interpreter teardown

    if sys.argv[1:2] == ["--worker"]:  # ours, launched by torchrun from run_ours
        exit_without_teardown(trainer_worker(sys.argv[2], sys.argv[3:]))
    sys.exit(main())
