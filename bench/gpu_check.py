"""Every GPU claim of the README and BENCHMARKS.md checked by one command on a lent GPU (issue 32), in sections that
each fit 8 minutes on one H100: figures, a claims table, and exit code 1 when a claim fails.

    python bench/gpu_check.py                              # every section (~32 minutes on one H100: split it, below)
    python bench/gpu_check.py --section kernels,mfu        # some sections (--section may also be repeated)
    python bench/gpu_check.py --dry-run                    # CPU, ~45-60 s: every section's plumbing, tiny preset

On the device machine datasets, dill and multiprocess are missing (Python 3.12, torch and transformers present).
Fetch their wheels here into .whl/ (kept out of git by .git/info/exclude, so the device call must carry [".whl"]):

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d .whl datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19

and run from the repository root there:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site && python3 bench/gpu_check.py --section kernels --out $OUT/gpu_check

One section per device call (each is sized for 8 of a call's 10 minutes); the estimates on one H100, from
BENCHMARKS.md's launches of the 1B preset (72-105 s each: start-up, model init, compilation, then the final 12 GB
checkpoint and export, which fsdp_train.py always writes; a 1B run at seq 2048 x 8 trains ~58k tokens/s compiled):
kernels ~6-7 min (4 launches), mfu ~4 min (2), peft ~6-7 min (6; 3 took 3 min, plus a 1B model with weights), dpo
1 min measured (1, the 125M preset), resume ~1.5 min (3, a 4-layer model), grpo ~2.5 min on an H200 (1 launch, then
transformers' generate in-process; 1B with weights, shared with peft), fp8 6 min measured (4 launches like mfu's
first; torchao must be carried as a wheel), scale ~6 min measured on an H200 (3 launches of ~2.0B with weights).
--budget-s (default 480) bounds each section: a launch that would start with less of it left than the section's
longest launch so far (at least a minute) is skipped ("not measured"), one that runs past it is killed and
reported the same way; --total-budget-s bounds the command (e.g. 540 for several sections in one 10-minute call). The
outputs are rewritten after every section, so a call cut short keeps the finished ones.

Sections (--section NAME; every launch is `torchrun --nproc_per_node 1 fsdp_train.py`, bf16, through
launch.run_trainer or the bench that owns the measurement; a generated corpus, no download):

- kernels: the 1B preset (`model_download.py --init 1B`, random weights), seq 8192, micro-batch 1, compile off,
  activation checkpointing on, 12 steps, a metric line every 4: (a) `--document-masking off` (plain causal SDPA),
  (b) `--document-masking on --attn-implementation sdpa` (a dense [T x T] document mask), (c) the same with
  `varlen`, (d) with `flex_attention`. A kernel fsdp_train.py does not offer is "not available". Claims: varlen
  tokens/s >= 0.95x unmasked; varlen's and flex's loss at every logged step equal the dense mask's within 2e-2
  relative (same seed and data; bf16).
- mfu: the 1B preset, compile on, activation checkpointing off, document masking on with the best kernel (varlen
  where fsdp_train.py has it, else its own auto choice), 20 steps, a line every 5: seq 2048 x micro-batch 8 and
  seq 8192 x 2 (the same tokens per step). Claim: MFU >= 45% at seq 2048.
- peft: bench_peft.run_mode's GPU setting (`--init 1B --with-weights`, seq 2048, micro-batch 4, activation
  checkpointing on, 20 steps; the plan's "extra" flags are added to every launch): full fine-tuning and LoRA (the
  fused kernel), the same two with `--compile on`, checkpointing off and micro-batch 8 (the speed pair), LoRA with
  `--lora-kernel peft` and QLoRA, one launch each (~7 min on an H200 with the model's init). With checkpointing on,
  the recomputed forward caps LoRA at 4/3 of full fine-tuning's speed even if its adapters cost nothing, and at
  micro-batch 4 the host's work per small kernel leaves the GPU idle (BENCHMARKS.md row 18). Claims: LoRA tokens/s
  >= 1.3x full fine-tuning's (the speed pair); LoRA's peak memory <= 0.40x full fine-tuning's (CUDA allocator
  peak, checkpointing on); the fused kernel at least as fast as peft's modules (eager).
- dpo: bench_dpo's GPU inputs (the 125M preset, 480 preference pairs of 20-400-token turns, seq 2048, micro-batch 4)
  and its run_ours launch (`--reference precomputed`, full weights, one epoch): pairs/s, reported (no goal).
- resume: a 4-layer Llama (hidden 256, vocab 4096), seq 512, micro-batch 4, 20 steps, a checkpoint every 5, with
  deterministic kernels (`--attn-implementation eager`, CUBLAS_WORKSPACE_CONFIG=:4096:8): an uninterrupted run; a run
  killed inside its step-15 checkpoint save (FSDP_TRAIN_FAULT=kill_during_write@0:15); the same command rerun, which
  resumes from step 10. Claims: the resumed run's loss equals the uninterrupted run's at every step, bit for bit;
  the steps trained twice (before the kill and after the resume) have the same losses.
- fp8: mfu's first setting (1B, seq 2048 x 8, compile on, activation checkpointing off), bf16 against `--fp8 on`,
  with document masking off (fp8's tensorwise scales, weights all-gathered in float8) and on (rowwise scales, the
  best kernel). Claims: fp8 tokens/s >= 1.2x bf16's (masking off); rowwise fp8 at least bf16's (masking on); fp8's
  loss within 5% of bf16's at every logged step (same seed and data).
- grpo: `--objective grpo` on bench_peft's 1B with weights (random: the completions run to --max-new-tokens), 64
  prompts of 60 words, --reward accuracy, seq 1024, --max-new-tokens 256, --num-generations 8, -b 4 (32 completions
  per step), activation checkpointing on, 4 steps (the first skipped): generation tokens/s, step and generation time,
  the CUDA peak; against transformers' `generate` on an unsharded bf16 copy of the same weights (same prompts,
  sampling and lengths, -b prompts x 8 per call, one warm-up call). Claim: our generation tokens/s >= generate's.
- longctx (issue 33; not yet run on a GPU, ~4 launches of the 1B preset, estimated 6-8 min): the longest sequence
  the 1B preset trains at on this GPU, -b 1, activation checkpointing on, document masking on (best kernel), 2
  steps, on a 10M-character corpus, the model's positions raised to the longest length: plain at 262,144 then
  393,216 tokens, and with `--activation-offload on --tiled-mlp 8` at 786,432 then 1,048,576 (an H200 trained 393k
  plain and 786k offloaded on 2026-11-26, BENCHMARKS.md row 16; the 1M row was not reached); each setting stops at its first length that
  does not fit (an out-of-memory exit, recorded as "does not fit"). Reported, no goal: the issue's 500k-token goal
  is ALST's for Llama-3.1-8B, whose full fine-tuning state does not fit one GPU (not measured here).
- scale: fp8's and peft's speed claims at Llama-3-8B's layer shapes (`--init 7B --num-layers 8 --num-kv-heads 8
  --intermediate-size 14336 --with-weights`, ~2.0B parameters), seq 2048 x 8, compile on, activation checkpointing
  off, document masking off, 5 warm-up steps, 15 steps: bf16 full fine-tuning, `--fp8 on` and LoRA (rank 16), one
  launch each (~6 min on an H200, 2026-11-27: 94-114 s per full launch, most of it the 2B checkpoint and export).
  Claims: fp8 tokens/s >= 1.2x bf16's; LoRA tokens/s >= 1.3x full fine-tuning's; fp8's loss within 5% of bf16's.

Figures are fsdp_train.py's own metrics.jsonl (tokens_per_s, mfu, mem_peak_alloc_gb), as bench_mfu.py reads them:
the first window (warm-up, compilation) skipped, the median of the others (peak: their highest).

Writes --out DIR (default outputs/gpu_check/): gpu_check.json (the machine: GPU, torch, transformers, commit; every
row; every claim, each {name, goal, measured, passed: true/false/null, reason}) and gpu_check.md (a table per section
and the claims table, to paste into BENCHMARKS.md). Exit code 1 when a claim fails or a launch crashes (a section
that raises is reported as failed with its error, and the others still run); a claim that was not measured
(passed null, with the reason) does not fail the run.

--dry-run: on CPU (GPUs hidden), fp32, a small Llama (hidden 256, 2 layers, bf16 weights), seq 64-128, 4-6 steps,
MFU against a nominal 1 TFLOP/s, and only 5 launches (~45 s): kernels' varlen row, which is also mfu's row (identical
settings, launched once), and resume's killed run and its rerun (the steps trained twice compared). The other rows
read "not launched in --dry-run": peft's launches (bench_peft.run_mode) are what bench_peft.py --quick's smoke test
runs, dpo's (bench_dpo.run_ours) what bench_dpo.py --quick's runs, grpo's fsdp_train.py launch what bench_grpo.py
--quick's runs (its transformers baseline: GPU only), fp8's what tests/test_fsdp_train_float8.py runs; longctx
launches its offload row at seq 512 (a 4th launch), scale its LoRA row on the tiny preset (a 5th). The
claims are evaluated and marked "dry run": they never fail the exit code; a crashed section or
launch does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import bench_dpo
import bench_peft
from common import REPO_ROOT, env_set, format_table, last_loss, machine_info, median
from inputs import init_model_folder, make_corpus, make_llama_folder, save_text_dataset
from launch import LaunchError, gpus_hidden, run_trainer, torchrun

SECTIONS = ("kernels", "mfu", "peft", "dpo", "resume", "fp8", "grpo", "longctx", "scale")
DEFAULT_OUT = REPO_ROOT / "outputs" / "gpu_check"
DEFAULT_BUDGET_S = 480.0
LOSS_RTOL = 2e-2
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
ATTENTION_LINE = re.compile(r"attention (\S+),")
RESUMED_LINE = re.compile(r"resumed from \S+ at step (\d+)")
FAILED = ("failed", "OOM")

# --- Sizes: the GPU check and the CPU dry run ----------------------------------------------------------------

GPU_PLAN: dict[str, Any] = {
    "precision": "bf16",
    "text": {"preset": "1B", "corpus_chars": 3_000_000},
    "kernels": {"seq": 8192, "batch": 1, "steps": 12, "log_freq": 4, "ac": "on", "compile": "off"},
    "mfu": {"seqs": ((2048, 8), (8192, 2)), "steps": 20, "log_freq": 5, "ac": "off", "compile": "on"},
    "fp8": {"seq": 2048, "batch": 8, "steps": 20, "log_freq": 5, "ac": "off", "compile": "on", "mode": "on"},
    # bench_peft's GPU setting, where the memory claim is defined (activation checkpointing on, compile off); on
    # 2026-11-26 an H200 ran it with checkpointing off and compile on too ("extra"): LoRA 0.776x, peak 0.570x
    "peft": bench_peft.GPU_FULL,
    "dpo": bench_dpo.GPU_FULL,
    "resume": {"hidden": 256, "layers": 4, "vocab": 4096, "seq": 512, "batch": 4, "steps": 20, "ckpt": 5, "kill": 15},
    "grpo": {"prompts": 64, "prompt_words": 60, "seq": 1024, "new": 256, "group": 8, "batch": 4, "steps": 4},
    # an H200 (141 GB) trained the first three on 2026-11-26; --dry-run's planner for 80 GB: ~254k plain, ~688k
    # tiled and offloaded (its rule 5-10% over the H200's peaks)
    "longctx": {"corpus_chars": 10_000_000, "plain": (262144, 393216), "offload": (786432, 1048576), "tiles": 8},
    # fp8's and peft's speed claims at Llama-3-8B's layer shapes (hidden 4096, MLP 14336, GQA 32/8), 8 of its 32
    # layers (~2.0B parameters with the 32k vocabulary: full fine-tuning's state fits one H100)
    "scale": {
        "preset": "7B",
        "overrides": ["--num-layers", "8", "--num-kv-heads", "8", "--intermediate-size", "14336"],
        **{"seq": 2048, "batch": 8, "steps": 15, "log_freq": 5, "ac": "off", "compile": "on", "fp8": "on"},
        "warmup": 5,  # without it both runs spiked at step 5 (lr 1e-4 from random weights): losses 16.6 vs 13.9
    },
    "min_launch_s": 60.0,
}
DRY_PLAN: dict[str, Any] = {
    "precision": "fp32",
    "text": {"hidden": 256, "layers": 2, "vocab": 1024, "corpus_chars": 200_000},
    # kernels' varlen row and mfu's row are the same launch here (identical settings: launched once)
    "kernels": {"seq": 128, "batch": 1, "steps": 4, "log_freq": 2, "ac": "off", "compile": "off"},
    "mfu": {"seqs": ((128, 1),), "steps": 4, "log_freq": 2, "ac": "off", "compile": "off"},
    "fp8": {"seq": 128, "batch": 1, "steps": 4, "log_freq": 2, "ac": "off", "compile": "off", "mode": "emulate"},
    "peft": {**bench_peft.CPU_QUICK, "label": "CPU, 1 process (dry run)", "nproc": 1, "precision": "fp32"},
    "dpo": {**bench_dpo.CPU_QUICK, "label": "CPU, 1 process (dry run)", "nproc": 1, "pairs": 8, "precision": "fp32"},
    "resume": {"seq": 64, "batch": 2, "steps": 6, "ckpt": 2, "kill": 4},
    "grpo": {"prompts": 16, "prompt_words": 12, "seq": 128, "new": 16, "group": 4, "batch": 2, "steps": 3},
    "longctx": {"corpus_chars": 0, "plain": (256,), "offload": (512,), "tiles": 2},
    "scale": {
        "preset": "tiny",
        "overrides": ["--num-layers", "2", "--num-kv-heads", "2", "--intermediate-size", "192"],
        **{"seq": 64, "batch": 2, "steps": 4, "log_freq": 2, "ac": "off", "compile": "off", "fp8": "emulate"},
        "warmup": 1,
    },
    "min_launch_s": 0.0,
    "peak_tflops": 1.0,  # nominal: a CPU has no datasheet peak; proves the MFU plumbing, not a figure
    # the rows a dry run launches where a section has several; the others: "not launched in --dry-run"
    # (dpo: none; its launch, bench_dpo.run_ours, is what tests/test_bench_smoke.py's bench_dpo --quick test runs)
    # (grpo: none; fsdp_train.py's GRPO launch is what tests/test_bench_smoke.py's bench_grpo --quick test runs)
    # (fp8: none; tests/test_fsdp_train_float8.py runs --fp8 emulate)
    # (peft: none; its launch, bench_peft.run_mode, is what tests/test_bench_smoke.py's bench_peft --quick test runs)
    # (longctx: the offload row; tests/test_context_parallel.py trains with --activation-offload and --tiled-mlp)
    "rows": {
        "kernels": ("masked varlen",),
        "peft": (),
        "dpo": (),
        "grpo": (),
        "fp8": (),
        "longctx": ("offload, seq 512",),
        "scale": ("LoRA",),  # the preset's model with weights, made as on a GPU, and LoRA's flags
    },
}


# --- Rows and claims -----------------------------------------------------------------------------------------

Row = dict[str, Any]  # {"row": name, "status": "ok" | "failed" | "OOM" | "not available" | "not measured", ...}


@dataclass
class Claim:
    """A claim checked: passed None means not measured (`reason` says why), never a pass."""

    name: str
    goal: str
    measured: str = "-"
    passed: bool | None = None
    reason: str = ""
    value: float | None = None


def not_run(name: str, status: str, reason: str) -> Row:
    return {"row": name, "status": status, "reason": reason}


def missing(rows: list[Row]) -> tuple[str, bool | None, str] | None:
    """(measured, passed, reason) of a claim one of whose rows did not run: failed if one crashed, else not
    measured; None when every row ran."""
    for r in rows:
        if r["status"] in FAILED:
            return f"{r['row']}: {r['status']} ({r.get('error', '')})", False, ""
    for r in rows:
        if r["status"] != "ok":
            return "-", None, f"{r['row']}: {r['status']} ({r.get('reason', '')})"
    return None


def ratio_claim(name: str, num: Row, den: Row, key: str, op: str, bound: float, unit: str) -> Claim:
    """num[key] / den[key] against `op bound` ("<=" or ">=")."""
    goal = f"{num['row']} / {den['row']} {unit} {op} {bound}x"
    if (absent := missing([num, den])) is not None:
        return Claim(name, goal, *absent)
    ratio = num[key] / den[key]
    passed = ratio <= bound if op == "<=" else ratio >= bound
    return Claim(name, goal, f"{ratio:.3f}x ({num[key]:,.4g} / {den[key]:,.4g})", passed, value=ratio)


def losses_claim(name: str, a: Row, b: Row, rtol: float) -> Claim:
    """a's loss equals b's at every step both logged, within `rtol` relative (0: bit for bit)."""
    goal = f"{a['row']} loss = {b['row']}'s at every logged step" + (
        f", relative {rtol:g}" if rtol else ", bit for bit"
    )
    if (absent := missing([a, b])) is not None:
        return Claim(name, goal, *absent)
    la, lb = dict(a["losses"]), dict(b["losses"])
    if not la:
        return Claim(name, goal, "no step to compare", False)
    if sorted(la) != sorted(lb):
        return Claim(name, goal, f"steps differ: {sorted(la)} vs {sorted(lb)}", False)
    worst = max(abs(la[s] - lb[s]) / max(abs(lb[s]), 1e-12) for s in la)
    return Claim(name, goal, f"max relative difference {worst:.3g} over {len(la)} steps", worst <= rtol, value=worst)


def reported(name: str, row: Row, key: str, unit: str) -> Claim:
    """A figure with no goal: passed None, or False when its run crashed."""
    if (absent := missing([row])) is not None:
        return Claim(name, "reported (no goal)", *absent)
    return Claim(name, "reported (no goal)", f"{row[key]:,.4g} {unit}", None, "no goal: the figure is reported")


def launches_claim(section: str, rows: list[Row]) -> Claim:
    """Every launch of the section completed (no crash, no OOM); None when nothing was launched."""
    failed = [f"{r['row']}: {r['status']} ({r.get('error', '')})" for r in rows if r["status"] in FAILED]
    ran = [r for r in rows if r["status"] == "ok"]
    goal = "every launch completes (no crash, no OOM)"
    if failed:
        return Claim(f"{section}: launches", goal, "; ".join(failed), False)
    if not ran:
        return Claim(f"{section}: launches", goal, "-", None, "nothing launched")
    return Claim(f"{section}: launches", goal, f"{len(ran)} of {len(rows)} rows ran", True)


# --- The run's context: inputs made once, the section's time budget ------------------------------------------


@dataclass
class Context:
    work: Path
    plan: dict[str, Any]
    dry: bool
    budget_s: float
    choices: dict[str, Any]  # fsdp_train.py's flags (dest -> choices or None)
    deadline: float = float("inf")  # time.perf_counter() at which --total-budget-s is spent
    made: dict[str, Any] = field(default_factory=dict)
    launched: dict[tuple[str, ...], Row] = field(default_factory=dict)  # train()'s rows by their launch's arguments
    section_start: float = 0.0
    longest_launch_s: float = 0.0

    def left(self) -> float:
        """Seconds left to the section: its --budget-s, or less when --total-budget-s runs out first."""
        now = time.perf_counter()
        return min(self.budget_s - (now - self.section_start), self.deadline - now)

    def cached(self, name: str, make: Callable[[], Any]) -> Any:
        """Inputs made once per command and shared by the sections (a section's first use pays for them)."""
        if name not in self.made:
            print(f"  making inputs: {name}", flush=True)
            self.made[name] = make()
        return self.made[name]

    def skip_reason(self, row: str, section: str) -> str | None:
        """Why `row` is not launched: the dry run's choice, or too little of the section's budget left."""
        if self.dry and section in self.plan["rows"] and row not in self.plan["rows"][section]:
            return "not launched in --dry-run"
        need = max(self.plan["min_launch_s"], self.longest_launch_s)
        if self.left() < need:
            return f"time budget: {self.left():.0f} s left (--budget-s, --total-budget-s), a launch takes ~{need:.0f} s"
        return None

    def corpus(self) -> Path:
        """The generated corpus, saved as a text dataset (the GPU sections' one)."""
        chars = self.plan["text"]["corpus_chars"]
        return self.cached("corpus", lambda: save_text_dataset(make_corpus(chars), self.work / "corpus"))

    def text_inputs(self) -> tuple[Path, Path]:
        """The corpus and the text model: the 1B preset (no weights: fsdp_train.py initialises them) with a tokenizer
        trained on the corpus on a GPU; a small Llama with bf16 weights (QLoRA needs weight files) in the dry run."""
        p = self.plan["text"]
        if self.dry:
            return self.cached("text", lambda: small_model(self.work / "text", p, "bfloat16"))
        flags = ["--tokenizer-from", str(self.corpus())]
        return self.corpus(), self.cached(
            "1B", lambda: long_positions(init_model_folder(self.work / "1B", p["preset"], flags))
        )


def long_positions(model_dir: Path, positions: int = 8192) -> Path:
    """The 1B preset's config allows 4096 positions; the kernels and mfu sections train at 8192 (rotary positions
    need no weights for the longer range)."""
    config = json.loads((model_dir / "config.json").read_text())
    config["max_position_embeddings"] = max(config.get("max_position_embeddings", 0), positions)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    return model_dir


def small_model(folder: Path, p: dict[str, Any], weights: str | None) -> tuple[Path, Path]:
    """A generated corpus saved as folder/dataset and a Llama of p's sizes (tokenizer trained on 200 documents)."""
    docs = make_corpus(p.get("corpus_chars", 400_000))
    model = make_llama_folder(folder / "model", docs[:200], p["hidden"], p["layers"], p["vocab"], 2048, weights)
    return save_text_dataset(docs, folder / "dataset"), model


# --- fsdp_train.py launches -----------------------------------------------------------------------------------


@dataclass
class Setting:
    """One fsdp_train.py launch's settings beyond the data and model."""

    seq: int
    batch: int
    steps: int
    log_freq: int
    ac: str = "on"
    compile: str = "off"
    masking: str = "on"
    attn: str = ""  # "": fsdp_train.py's auto
    extra: list[str] = field(default_factory=list)

    def args(self, ctx: Context) -> list[str]:
        args = ["--seq-length", str(self.seq), "-b", str(self.batch), "--precision", ctx.plan["precision"]]
        args += ["--max-steps", str(self.steps), "--num-epochs", "1000", "--log-freq", str(self.log_freq)]
        args += ["--activation-checkpointing", self.ac, "--compile", self.compile, "--document-masking", self.masking]
        args += ["--attn-implementation", self.attn] if self.attn else []
        args += ["--peak-tflops", str(ctx.plan["peak_tflops"])] if "peak_tflops" in ctx.plan else []
        return args + self.extra


def train(ctx: Context, name: str, exp: str, inputs: tuple[Path, Path], s: Setting) -> Row:
    """One launch: fsdp_train.py's steady-state figures (first window skipped) and its loss at every logged step;
    or status failed / OOM with the error, or "not measured" if it ran past the section's budget. A launch whose
    arguments an earlier row already ran is not repeated (the dry run's kernels and mfu rows)."""
    dataset, model = inputs
    args = ["-d", str(dataset), "-m", str(model), "--save-dir", str(ctx.work / "outputs")]
    args += ["--ckpt-freq", "0", "--lr", "1e-4", *s.args(ctx)]
    if (same := ctx.launched.get(tuple(args))) is not None:
        return {**same, "row": name, "note": f"the launch of {same['row']} (identical settings)"}
    row = launch_row(ctx, name, ["-e", exp, *args], s)
    ctx.launched[tuple(args)] = row
    return row


def launch_row(ctx: Context, name: str, args: list[str], s: Setting) -> Row:
    exp = args[1]
    print(f"  {name}: launching ({ctx.left():.0f} s of the section's budget left)", flush=True)
    timeout = max(ctx.left(), 60.0)
    start = time.perf_counter()
    run = run_trainer(REPO_ROOT / "fsdp_train.py", args, 1, ctx.work / "outputs" / exp, timeout=timeout)
    launch_s = time.perf_counter() - start
    ctx.longest_launch_s = max(ctx.longest_launch_s, launch_s)
    if run.failure:
        if launch_s >= timeout - 1:
            return not_run(name, "not measured", f"killed at the section budget after {launch_s:.0f} s")
        return {"row": name, **run.failure, "launch_s": launch_s}
    return {"row": name, "status": "ok", "launch_s": launch_s, "settings": asdict(s), **figures(run.windows, run.log)}


def figures(windows: list[dict[str, Any]], log: str) -> dict[str, Any]:
    """bench_mfu's reading of metrics.jsonl: medians of the windows after the first (their peak: the highest)."""
    steady = windows[1:]
    if not steady:
        raise RuntimeError(f"{len(windows)} metric windows: need steps >= 2 x log_freq")
    attention = ATTENTION_LINE.search(log)
    return {
        "tokens_per_s": median([w["tokens_per_s"] for w in steady]),
        "mfu": median([w["mfu"] for w in steady]) if all("mfu" in w for w in steady) else None,
        "peak_gib": max(w["mem_peak_alloc_gb"] for w in steady),
        "losses": [[w["step"], w["loss"]] for w in windows],
        "last_loss": last_loss(windows),
        "attention": attention.group(1) if attention else None,
        **(
            {  # --objective grpo's windows (one step each): the phases' sum is the step
                "generation_tokens_per_s": median([w["generation_tokens_per_s"] for w in steady]),
                "generate_ms": median([w["time_generate_ms"] for w in steady]),
                "step_ms": median(
                    [sum(v for k, v in w.items() if k.startswith("time_") and k.endswith("_ms")) for w in steady]
                ),
                "completion_length": median([w["completion_length"] for w in steady]),
            }
            if all("generation_tokens_per_s" in w for w in steady)
            else {}
        ),  # fmt: skip
    }


def unavailable_kernel(ctx: Context, attn: str) -> str | None:
    choices = ctx.choices.get("attn_implementation") or ()
    if attn and attn not in choices:
        return f"fsdp_train.py refuses --attn-implementation {attn} (choices: {', '.join(choices)})"
    return None


def run_rows(
    ctx: Context, section: str, specs: list[tuple[str, Setting]], inputs: Callable[[], tuple[Path, Path]]
) -> list[Row]:
    """Each (name, setting) launched in order, unless its kernel is not available or it is skipped; the inputs are
    made at the first launch."""
    rows = []
    for name, s in specs:
        if (reason := unavailable_kernel(ctx, s.attn)) is not None:
            rows.append(not_run(name, "not available", reason))
        elif (reason := ctx.skip_reason(name, section)) is not None:
            rows.append(not_run(name, "not measured", reason))
        else:
            rows.append(train(ctx, name, f"{section}_{len(rows)}", inputs(), s))
        print(f"  {name}: {summary(rows[-1])}", flush=True)
    return rows


def summary(r: Row) -> str:
    if r["status"] != "ok":
        return f"{r['status']}: {r.get('error') or r.get('reason', '')}"
    parts = [
        f"{r[k]:,.4g} {unit}" for k, unit in (("tokens_per_s", "tokens/s"), ("pairs_per_s", "pairs/s")) if r.get(k)
    ]
    if r.get("mfu") is not None:
        parts.append(f"MFU {100 * r['mfu']:.1f}%")
    parts += [f"peak {r['peak_gib']:.2f} GiB"] if r.get("peak_gib") is not None else []
    return ", ".join(parts + [f"last loss {r['last_loss']:.4g}"])


# --- Sections ---------------------------------------------------------------------------------------------------

SectionResult = tuple[list[Row], list[Claim]]


def section_kernels(ctx: Context) -> SectionResult:
    p = ctx.plan["kernels"]
    base = {k: p[k] for k in ("seq", "batch", "steps", "log_freq", "ac", "compile")}
    specs = [
        ("unmasked", Setting(**base, masking="off", attn="sdpa")),
        ("masked sdpa", Setting(**base, attn="sdpa")),
        ("masked varlen", Setting(**base, attn="varlen")),
        ("masked flex", Setting(**base, attn="flex_attention")),
    ]
    if ctx.dry:  # flex compiles its kernel (inductor): minutes on a CPU; the dry run proves the others' plumbing
        specs = specs[:3]
    rows = run_rows(ctx, "kernels", specs, ctx.text_inputs)
    by = {r["row"]: r for r in rows}
    claims = [
        ratio_claim(
            "varlen keeps unmasked speed", by["masked varlen"], by["unmasked"], "tokens_per_s", ">=", 0.95, "tokens/s"
        ),
        losses_claim("varlen = dense mask", by["masked varlen"], by["masked sdpa"], LOSS_RTOL),
    ]
    if "masked flex" in by:
        claims.append(losses_claim("flex = dense mask", by["masked flex"], by["masked sdpa"], LOSS_RTOL))
    return rows, claims


def best_kernel(ctx: Context) -> str:
    """varlen where fsdp_train.py offers it, else its own auto choice (flash_attention_2 when installed, else sdpa)."""
    return "varlen" if unavailable_kernel(ctx, "varlen") is None else ""


def section_mfu(ctx: Context) -> SectionResult:
    p = ctx.plan["mfu"]
    kernel = best_kernel(ctx)
    common = {k: p[k] for k in ("steps", "log_freq", "ac", "compile")}
    specs = [(f"seq {seq} x {b}", Setting(seq, b, **common, attn=kernel)) for seq, b in p["seqs"]]
    rows = run_rows(ctx, "mfu", specs, ctx.text_inputs)
    first = rows[0]
    goal = "MFU >= 45% (fsdp_train.py's: 6N + 12*L*H*Q*T flops per token over the device's peak)"
    if (absent := missing([first])) is not None:
        claim = Claim(f"MFU at {first['row']}", goal, *absent)
    elif first["mfu"] is None:
        claim = Claim(f"MFU at {first['row']}", goal, "-", None, "no peak known for this device: --peak-tflops")
    else:
        claim = Claim(f"MFU at {first['row']}", goal, f"{100 * first['mfu']:.1f}%", first["mfu"] >= 0.45,
                      value=first["mfu"])  # fmt: skip
    return rows, [claim]


# (row, --peft, flags): LoRA with peft's own modules shows what the fused kernel (model/lora_kernel.py) gives
# and the speed pair, compiled at micro-batch 8 without checkpointing: at micro-batch 4 the host's work per small kernel
# leaves the GPU idle under LoRA (BENCHMARKS.md row 18: 0.96x compiled at -b 4, 1.18x at -b 8 on an H200)
SPEED = ("--compile", "on", "--activation-checkpointing", "off", "-b", "8")
PEFT_ROWS = (
    ("full fine-tuning", "none", ()),
    ("LoRA", "lora", ()),
    ("full fine-tuning, compiled, -b 8", "none", SPEED),
    ("LoRA, compiled, -b 8", "lora", SPEED),
    ("LoRA, peft's modules", "lora", ("--lora-kernel", "peft")),
    ("QLoRA", "qlora", ()),
)


def section_peft(ctx: Context) -> SectionResult:
    """bench_peft.run_mode: full fine-tuning, LoRA (fused kernel, then peft's modules) and QLoRA at the same
    settings, one launch each."""
    p = ctx.plan["peft"]

    def inputs() -> tuple[Path, Path]:  # made at the first launch: the 1B with weights (bf16 safetensors) on a GPU
        if ctx.dry:
            return ctx.text_inputs()
        model = ctx.cached("peft model", lambda: bench_peft.init_model(ctx.work, ctx.corpus(), p, "model_peft"))
        return ctx.corpus(), model

    rows = []
    for i, (name, mode, flags) in enumerate(PEFT_ROWS):
        if (reason := ctx.skip_reason(name, "peft")) is not None:
            rows.append(not_run(name, "not measured", reason))
        else:
            print(f"  {name}: launching ({ctx.left():.0f} s of the section's budget left)", flush=True)
            start = time.perf_counter()
            extra = (*p.get("extra", ()), *flags)
            rows.append({"row": name, **bench_peft.run_mode(ctx.work, *inputs(), p, mode, i, extra)})
            ctx.longest_launch_s = max(ctx.longest_launch_s, time.perf_counter() - start)
        print(f"  {name}: {summary(rows[-1])}", flush=True)
    full, lora, full_fast, lora_fast, lora_peft = rows[:5]
    claims = [
        ratio_claim("LoRA faster than full", lora_fast, full_fast, "tokens_per_s", ">=", 1.3, "tokens/s"),
        ratio_claim("LoRA memory", lora, full, "peak_gib", "<=", 0.40, "peak memory"),
        ratio_claim("fused LoRA kernel", lora, lora_peft, "tokens_per_s", ">=", 1.0, "tokens/s"),
    ]
    return rows, claims


def section_dpo(ctx: Context) -> SectionResult:
    """bench_dpo's inputs and its run_ours launch of fsdp_train.py on preference pairs (full weights, precomputed
    reference)."""
    p = ctx.plan["dpo"]
    name = "DPO, full weights, precomputed reference"
    if (reason := ctx.skip_reason("full", "dpo")) is not None:
        row = not_run(name, "not measured", reason)
    else:
        inputs = ctx.cached("dpo", lambda: bench_dpo.prepare(ctx.work, p, "dpo"))
        print(f"  {name}: launching", flush=True)
        row = {"row": name, **bench_dpo.run_ours(inputs, p, "full", 0, on_cpu=ctx.dry)}
        row.pop("token_check", None)
    print(f"  {name}: {summary(row)}", flush=True)
    return [row], [reported("DPO pairs/s", row, "pairs_per_s", "pairs/s")]


def read_losses(exp_dir: Path) -> list[list[float]]:
    path = exp_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [[r["step"], r["loss"]] for r in map(json.loads, lines) if "loss" in r and "tokens_per_s" in r]


def section_resume(ctx: Context) -> SectionResult:
    """An uninterrupted run, a run killed inside a checkpoint save, and its rerun (which resumes), deterministic
    kernels: the losses must match bit for bit."""
    p = ctx.plan["resume"]
    inputs = ctx.text_inputs() if ctx.dry else ctx.cached("resume", lambda: small_model(ctx.work / "resume", p, None))
    extra = ["--ckpt-freq", str(p["ckpt"]), "--lr-schedule", "constant", "--seed", "3"]
    s = Setting(p["seq"], p["batch"], p["steps"], 1, attn="eager", extra=extra)
    args = ["-d", str(inputs[0]), "-m", str(inputs[1]), "--save-dir", str(ctx.work / "outputs"), "--lr", "1e-3"]
    args += s.args(ctx)
    fault = {"FSDP_TRAIN_FAULT": f"kill_during_write@0:{p['kill']}"}
    rows: list[Row] = []
    with env_set(DETERMINISTIC_ENV):
        rows.append(resume_launch(ctx, "uninterrupted", ["-e", "resume_ref", *args], None))
        rows.append(
            resume_launch(ctx, f"killed in the step-{p['kill']} save", ["-e", "resume_cut", *args], fault, p["kill"])
        )
        rows.append(resume_launch(ctx, "rerun (resumes)", ["-e", "resume_cut", *args], None))
    ref, cut, rerun = rows
    claims = [losses_claim("resume = uninterrupted", rerun, ref, 0.0)]
    twice = {**cut, "losses": [sl for sl in cut.get("losses", []) if sl[0] > rerun.get("resumed_at", 0)]}
    again = {**rerun, "losses": [sl for sl in rerun.get("losses", []) if sl[0] in dict(twice["losses"])]}
    claims.append(losses_claim("steps trained twice", again, twice, 0.0))
    if rerun["status"] == "ok" and rerun.get("resumed_at") is None:
        claims.append(Claim("rerun resumed", "the rerun resumes from a checkpoint", "no 'resumed from' line", False))
    return rows, claims


def resume_launch(ctx: Context, name: str, args: list[str], fault: dict[str, str] | None, kill_step: int = 0) -> Row:
    """One launch of the resume check. The killed one (`fault`) must fail and keep its folder for the rerun; the
    others are run_trainer launches (their folder is removed)."""
    if ctx.dry and name == "uninterrupted":
        return not_run(name, "not measured", "not launched in --dry-run (the steps trained twice are compared)")
    if (reason := ctx.skip_reason(name, "resume")) is not None:
        return not_run(name, "not measured", reason)
    exp_dir = ctx.work / "outputs" / args[1]
    start = time.perf_counter()
    print(f"  {name}: launching", flush=True)
    if fault is None:
        run = run_trainer(REPO_ROOT / "fsdp_train.py", args, 1, exp_dir, timeout=max(ctx.left(), 60.0))
        row = {"row": name, "status": "ok", **(run.failure or {})}
        row["losses"] = [[w["step"], w["loss"]] for w in run.windows]
        if m := RESUMED_LINE.search(run.log):
            row["resumed_at"] = int(m.group(1))
    else:
        with env_set(fault):
            try:
                torchrun(REPO_ROOT / "fsdp_train.py", args, 1, timeout=max(ctx.left(), 60.0))
                row = {"row": name, "status": "failed", "error": f"{fault} did not kill the run"}
            except LaunchError as exc:
                row = {"row": name, "status": "ok", "note": "killed, as injected", "losses": read_losses(exp_dir)}
                if max((step for step, _ in row["losses"]), default=0) < kill_step:
                    row = {"row": name, "status": "failed", "error": f"stopped before step {kill_step}: {exc}"[-300:]}
    row["launch_s"] = time.perf_counter() - start
    ctx.longest_launch_s = max(ctx.longest_launch_s, row["launch_s"])
    if row["status"] == "ok":
        row["last_loss"] = row["losses"][-1][1] if row["losses"] else None
    print(f"  {name}: {row['status']}, {len(row.get('losses', []))} steps logged", flush=True)
    return row


def section_fp8(ctx: Context) -> SectionResult:
    """bf16 against --fp8 on the mfu section's 1B setting: without document masking (fp8's tensorwise scales,
    weights all-gathered in float8) and with it (rowwise scales, so packed documents never share one)."""
    p = ctx.plan["fp8"]
    common = {k: p[k] for k in ("steps", "log_freq", "ac", "compile")}
    fp8 = ["--fp8", p["mode"]]
    kernel = best_kernel(ctx)
    specs = [
        ("bf16, masking off", Setting(p["seq"], p["batch"], **common, masking="off")),
        ("fp8 tensorwise, masking off", Setting(p["seq"], p["batch"], **common, masking="off", extra=fp8)),
        ("bf16, masking on", Setting(p["seq"], p["batch"], **common, attn=kernel)),
        ("fp8 rowwise, masking on", Setting(p["seq"], p["batch"], **common, attn=kernel, extra=fp8)),
    ]
    rows = run_rows(ctx, "fp8", specs, ctx.text_inputs)
    claims = [
        ratio_claim("FP8 faster than bf16", rows[1], rows[0], "tokens_per_s", ">=", 1.2, "tokens/s"),
        ratio_claim("FP8 (rowwise) with documents apart", rows[3], rows[2], "tokens_per_s", ">=", 1.0, "tokens/s"),
        losses_claim("FP8 trains like bf16", rows[1], rows[0], 0.05),
    ]
    return rows, claims


def grpo_inputs(ctx: Context, p: dict[str, Any]) -> tuple[Path, Path]:
    """Prompts cut from the generated corpus (p["prompt_words"] words each, an `answer` column of "7": the accuracy
    reward is mostly 0 for a random model) and a model with weights (bench_peft's 1B on a GPU, the dry run's Llama),
    which the baseline loads as it is."""
    import datasets

    if ctx.dry:
        _, model = ctx.text_inputs()
    else:
        model = ctx.cached(
            "peft model", lambda: bench_peft.init_model(ctx.work, ctx.corpus(), ctx.plan["peft"], "model_peft")
        )
    words = " ".join(make_corpus(200_000)).split()
    n, k = p["prompts"], p["prompt_words"]
    prompts = [" ".join(words[i * k : (i + 1) * k]) + "\nAnswer:" for i in range(n)]
    folder = ctx.work / "grpo_prompts"
    if not folder.exists():
        datasets.Dataset.from_dict({"prompt": prompts, "answer": ["7"] * n}).save_to_disk(str(folder))
    return folder, model


def generate_baseline(model_dir: Path, prompts: list[str], p: dict[str, Any], dry: bool) -> Row:
    """transformers' generate on an unsharded copy of the model (bf16 on the GPU; fp32 in the dry run), the same
    sampling (temperature 1, top-p 1, no top-k) and lengths, -b prompts x the group per call, as TRL generates
    with a gathered model: generated tokens (to the first end token) per second, after one warm-up call."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device("cpu" if dry else "cuda")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    dtype = torch.float32 if dry else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    eos = tokenizer.eos_token_id
    times, tokens = [], 0
    batches = [prompts[i : i + p["batch"]] for i in range(0, p["batch"] * p["steps"], p["batch"])]
    for i, batch in enumerate(batches):
        enc = tokenizer(batch, return_tensors="pt", padding=True).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                **enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=p["new"],
                num_return_sequences=p["group"], pad_token_id=eos,
            )  # fmt: skip
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i == 0:
            continue  # warm-up
        times.append(time.perf_counter() - start)
        for row in out[:, enc["input_ids"].shape[1] :].tolist():
            tokens += next((j + 1 for j, t in enumerate(row) if t == eos), len(row))
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "row": "transformers generate, unsharded copy",
        "status": "ok",
        "generation_tokens_per_s": tokens / sum(times),
    }


def section_grpo(ctx: Context) -> SectionResult:
    """--objective grpo (the accuracy reward, --max-new-tokens p["new"], --num-generations p["group"], -b p["batch"]
    prompts, activation checkpointing on): step time, generation tokens/s and the CUDA peak, against transformers'
    generate on an unsharded copy (generation tokens/s)."""
    p = ctx.plan["grpo"]
    name = "GRPO, generation on the sharded model"
    if (reason := ctx.skip_reason("grpo", "grpo")) is not None:
        ours = not_run(name, "not measured", reason)
    else:
        prompts, model = ctx.cached("grpo inputs", lambda: grpo_inputs(ctx, p))
        s = Setting(p["seq"], p["batch"], p["steps"], 1, extra=[
            "--objective", "grpo", "--reward", "accuracy", "--max-new-tokens", str(p["new"]),
            "--num-generations", str(p["group"]),
        ])  # fmt: skip
        ours = train(ctx, name, "grpo", (prompts, model), s)
    print(f"  {name}: {summary(ours)}", flush=True)
    base_name = "transformers generate, unsharded copy"
    if ctx.dry:
        base = not_run(base_name, "not measured", "not launched in --dry-run")
    elif ours["status"] != "ok":
        base = not_run(base_name, "not measured", "ours did not run")
    else:
        import datasets

        texts = datasets.load_from_disk(str(prompts))["prompt"]
        base = generate_baseline(model, texts, p, ctx.dry)
    print(f"  {base_name}: {base.get('generation_tokens_per_s', base.get('reason'))}", flush=True)
    claims = [
        ratio_claim(
            "GRPO generation vs generate", ours, base, "generation_tokens_per_s", ">=", 1.0, "generation tokens/s"
        ),
        reported("GRPO generation tokens/s", ours, "generation_tokens_per_s", "tokens/s"),
    ]
    return [ours, base], claims


def long_inputs(ctx: Context) -> tuple[Path, Path]:
    """A corpus of p["corpus_chars"] (the longest sequence's tokens at least twice over) and the text model with
    positions for the longest sequence (rotary: no weights involved); the text inputs as they are in the dry run."""
    p = ctx.plan["longctx"]
    if ctx.dry:
        return ctx.text_inputs()
    _, model = ctx.text_inputs()

    def make() -> tuple[Path, Path]:
        folder = ctx.work / "1B_long"
        shutil.copytree(model, folder, dirs_exist_ok=True)
        corpus = save_text_dataset(make_corpus(p["corpus_chars"], seed=1), ctx.work / "long_corpus")
        return corpus, long_positions(folder, max(p["offload"]))

    return ctx.cached("long inputs", make)


def section_longctx(ctx: Context) -> SectionResult:
    """The longest sequence the text model trains at on this GPU (issue 33): -b 1, activation checkpointing on,
    document masking on with the best kernel, 2 steps, plain and with `--activation-offload on --tiled-mlp N`; each
    setting tries its lengths in increasing order and stops at the first that does not fit (an out-of-memory exit
    is the expected end here, recorded as "does not fit", not as a failed launch). Reported, no goal: the issue's
    goal (ALST's 500k tokens) is for an 8B model, which one GPU's memory cannot hold for full fine-tuning."""
    p = ctx.plan["longctx"]
    kernel = best_kernel(ctx)
    settings = (
        ("plain", p["plain"], []),
        ("offload", p["offload"], ["--activation-offload", "on", "--tiled-mlp", str(p["tiles"])]),
    )
    rows, claims = [], []
    for label, lengths, extra in settings:
        longest, stop = 0, "every length tried fits"
        for seq in lengths:
            name = f"{label}, seq {seq}"
            if (reason := ctx.skip_reason(name, "longctx")) is not None:
                rows.append(not_run(name, "not measured", reason))
                stop = f"{seq:,}: {reason}"
                break
            row = train(
                ctx, name, f"longctx_{len(rows)}", long_inputs(ctx), Setting(seq, 1, 2, 1, attn=kernel, extra=extra)
            )
            if row["status"] == "OOM":
                row = {**row, "status": "does not fit", "reason": row.get("error", "")}
            rows.append(row)
            print(f"  {name}: {summary(row)}", flush=True)
            if row["status"] != "ok":
                stop = f"{seq:,}: {row['status']}"
                break
            longest = seq
        measured = f"{longest:,} tokens train" if longest else "none of the lengths tried"
        crashed = next((r for r in rows if r["row"].startswith(label) and r["status"] in FAILED), None)
        claims.append(Claim(
            f"longest sequence, {label}", "reported (no goal for this model size)", f"{measured}; next: {stop}",
            False if crashed else None, "" if crashed else "no goal: the figure is reported", value=float(longest),
        ))  # fmt: skip
    return rows, claims


def section_scale(ctx: Context) -> SectionResult:
    """fp8's and peft's speed claims where the matmuls are larger: Llama-3-8B's layer shapes (the 7B preset with 8
    layers, 8 KV heads and a 14,336-wide MLP; bf16 weights, a tokenizer trained on the corpus), seq 2048 x 8,
    compile on, activation checkpointing off, document masking off, 5 warm-up steps: bf16 full fine-tuning, `--fp8 on`
    (tensorwise) and LoRA (rank 16, all seven projections), one launch each."""
    p = ctx.plan["scale"]
    warmup = ["--warmup-steps", str(p["warmup"])]
    common = Setting(p["seq"], p["batch"], p["steps"], p["log_freq"], p["ac"], p["compile"], "off", extra=warmup)

    def inputs() -> tuple[Path, Path]:
        corpus = ctx.corpus()
        model = ctx.cached("8B-shaped model", lambda: bench_peft.init_model(ctx.work, corpus, p, "scale"))
        return corpus, model

    specs = [
        ("bf16", common),
        ("fp8 tensorwise", replace(common, extra=[*warmup, "--fp8", p["fp8"]])),
        ("LoRA", replace(common, extra=[*warmup, "--peft", "lora", "--lora-rank", "16"])),
    ]
    rows = run_rows(ctx, "scale", specs, inputs)
    bf16, fp8, lora = rows
    claims = [
        ratio_claim("FP8 faster than bf16, 8B layers", fp8, bf16, "tokens_per_s", ">=", 1.2, "tokens/s"),
        ratio_claim("LoRA faster than full, 8B layers", lora, bf16, "tokens_per_s", ">=", 1.3, "tokens/s"),
        losses_claim("FP8 trains like bf16, 8B layers", fp8, bf16, 0.05),
    ]
    return rows, claims


SECTION_FUNCTIONS: dict[str, Callable[[Context], SectionResult]] = {
    "kernels": section_kernels,
    "mfu": section_mfu,
    "peft": section_peft,
    "dpo": section_dpo,
    "resume": section_resume,
    "fp8": section_fp8,
    "grpo": section_grpo,
    "longctx": section_longctx,
    "scale": section_scale,
}


def run_section(ctx: Context, name: str) -> dict[str, Any]:
    """One section; an exception is its result (a failed claim with the error), so the next section still runs."""
    print(f"== {name} ==", flush=True)
    ctx.section_start, ctx.longest_launch_s = time.perf_counter(), 0.0
    try:
        rows, claims = SECTION_FUNCTIONS[name](ctx)
        claims.append(launches_claim(name, rows))
        error = None
    except Exception as exc:  # noqa: BLE001 - reported as the section's failure; the others still run
        error = f"{type(exc).__name__}: {exc}"[-2000:]
        traceback.print_exc()
        rows, claims = [], [Claim(f"{name}: launches", "the section runs", f"crashed: {error[-300:]}", False)]
    seconds = time.perf_counter() - ctx.section_start
    print(f"== {name}: {seconds:.0f} s ==", flush=True)
    return {"rows": rows, "claims": [asdict(c) for c in claims], "seconds": seconds, "error": error}


# --- Machine, outputs, exit code ------------------------------------------------------------------------------


def trainer_flags() -> dict[str, Any]:
    """fsdp_train.py's flags as its own parser declares them: dest -> choices (None for a free value)."""
    from fsdp_lib.config import build_arg_parser

    return {a.dest: a.choices for a in build_arg_parser()._actions}


def commit() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True, text=True)
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def machine(dry: bool) -> dict[str, Any]:
    import torch
    import transformers

    info = machine_info()
    gpu = torch.cuda.is_available() and not dry
    info |= {
        "gpu": torch.cuda.get_device_name() if gpu else None,
        "gpu_count": torch.cuda.device_count() if gpu else 0,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "commit": commit(),
    }
    return info


CELLS: list[tuple[str, str, Callable[[Any], str]]] = [  # header, row key, format
    ("tokens/s", "tokens_per_s", lambda v: f"{v:,.0f}"),
    ("pairs/s", "pairs_per_s", lambda v: f"{v:,.3g}"),
    ("MFU", "mfu", lambda v: f"{100 * v:.1f}%"),
    ("generation tokens/s", "generation_tokens_per_s", lambda v: f"{v:,.0f}"),
    ("step (ms)", "step_ms", lambda v: f"{v:,.0f}"),
    ("generation (ms)", "generate_ms", lambda v: f"{v:,.0f}"),
    ("peak (GiB)", "peak_gib", lambda v: f"{v:.2f}"),
    ("attention", "attention", str),
    (
        "losses (logged steps)",
        "losses",
        lambda v: ", ".join("n/a" if loss is None else f"{loss:.4g}" for _, loss in v[-6:]),
    ),
    ("launch (s)", "launch_s", lambda v: f"{v:.0f}"),
]


def section_table(rows: list[Row]) -> str:
    """The section's rows; a column only where some row has a figure in it."""
    cells = [c for c in CELLS if any(r.get(c[1]) is not None for r in rows)]
    body = []
    for r in rows:
        note = r.get("error") or r.get("reason") or r.get("note") or ""
        values = [fmt(r[key]) if r.get(key) is not None else "-" for _, key, fmt in cells]
        body.append([r["row"], r["status"], *values, note.replace("|", "/")[:200]])
    return format_table(["row", "status", *(c[0] for c in cells), "note"], body)


def verdict(c: dict[str, Any], dry: bool) -> str:
    text = {True: "PASS", False: "**FAIL**", None: f"not measured: {c['reason']}"}[c["passed"]]
    if c["passed"] is None and c["reason"].startswith("no goal"):
        text = "reported"
    return f"{text} (dry run)" if dry else text


def markdown(payload: dict[str, Any]) -> str:
    m, dry = payload["machine"], payload["dry_run"]
    device = m["gpu"] or f"CPU ({m['cpu']})"
    lines = [f"# gpu_check: {device}, torch {m['torch']}, transformers {m['transformers']}, commit {m['commit']}", ""]
    lines += [
        f"{m['date']}; `{' '.join(payload['argv'])}`" + ("; **dry run**: plumbing only, no figures" if dry else "")
    ]
    for name, s in payload["sections"].items():
        lines += ["", f"## {name} ({s['seconds']:.0f} s)", ""]
        lines += [f"Crashed: `{s['error']}`"] if s["error"] else [section_table(s["rows"])] if s["rows"] else []
    claims = [[name, c["name"], c["goal"], c["measured"], verdict(c, dry)] for name, c in all_claims(payload)]
    lines += ["", "## Claims", "", format_table(["section", "claim", "goal", "measured", "result"], claims), ""]
    return "\n".join(lines)


def all_claims(payload: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(name, c) for name, s in payload["sections"].items() for c in s["claims"]]


def exit_code(payload: dict[str, Any]) -> int:
    """1 if a claim failed; in a dry run only the launches' claims count (a crash, not a figure)."""
    counted = [c for _, c in all_claims(payload) if not payload["dry_run"] or c["name"].endswith(": launches")]
    return 1 if any(c["passed"] is False for c in counted) else 0


# --- Command line ------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--section", action="append", default=[], help=f"one of {', '.join(SECTIONS)}, or a comma "
                        "list; repeatable (default: all)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for gpu_check.json and .md")
    parser.add_argument("--dry-run", action="store_true", help="CPU, a small model: the plumbing (5 launches, ~45 s)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="seconds per section (launches "
                        "that would not fit are skipped; default: %(default)s)")  # fmt: skip
    parser.add_argument("--total-budget-s", type=float, default=0.0, help="seconds for the whole command (0: no "
                        "limit); e.g. 540 within a 10-minute device call, so the outputs are written in time")  # fmt: skip
    parser.add_argument("--workdir", type=Path, default=None, help="folder for inputs and runs (default: a temporary "
                        "folder in /dev/shm when it has 32 GB free, else in $TMPDIR; removed)")  # fmt: skip
    args = parser.parse_args(argv)
    names = [n.strip() for item in args.section for n in item.split(",") if n.strip()] or list(SECTIONS)
    if unknown := sorted(set(names) - set(SECTIONS)):
        parser.error(f"unknown --section {', '.join(unknown)} (choose from {', '.join(SECTIONS)})")
    args.section = list(dict.fromkeys(names))
    return args


@contextlib.contextmanager
def work_dir(args: argparse.Namespace) -> Iterator[Path]:
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
        yield args.workdir
        return
    shm = Path("/dev/shm")
    fast = not args.dry_run and shm.is_dir() and shutil.disk_usage(shm).free > 32e9
    with tempfile.TemporaryDirectory(prefix="gpu_check_", dir=shm if fast else None) as tmp:
        yield Path(tmp)


def write_outputs(out: Path, payload: dict[str, Any]) -> int:
    """gpu_check.json and gpu_check.md as they stand (after every section, so a command cut short keeps the
    finished sections); returns the exit code they imply."""
    payload["claims"] = [{"section": name, **c, "dry_run": payload["dry_run"]} for name, c in all_claims(payload)]
    payload["exit_code"] = code = exit_code(payload)
    payload["written"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    (out / "gpu_check.md").write_text(markdown(payload))
    return code


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check.py: no GPU here; --dry-run runs the plumbing on CPU", file=sys.stderr)
        return 2
    started = time.perf_counter()
    deadline = started + args.total_budget_s if args.total_budget_s else float("inf")
    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    with work_dir(args) as work, gpus_hidden(args.dry_run):
        ctx = Context(work, plan, args.dry_run, args.budget_s, trainer_flags(), deadline)
        payload = {"machine": machine(args.dry_run), "dry_run": args.dry_run, "argv": sys.argv, "sections": {}}
        payload["budget_s"], payload["total_budget_s"] = args.budget_s, args.total_budget_s
        for name in args.section:
            payload["sections"][name] = run_section(ctx, name)
            payload["seconds"] = time.perf_counter() - started
            code = write_outputs(args.out, payload)
    print(markdown(payload))
    print(f"wrote {args.out / 'gpu_check.json'} and gpu_check.md in {payload['seconds']:.0f} s; exit {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
