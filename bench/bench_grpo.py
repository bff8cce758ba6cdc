"""GRPO (`fsdp_train.py --objective grpo`) against a TRL-style GRPO written here: step time, generation tokens/s and
peak memory per rank, on CPU with 2 processes; ours generating on the sharded model with its layers kept gathered
(--rollout-unshard auto, which is on on a CPU) and, as a second variant, gathered again for every token (off).

    python bench/bench_grpo.py            # CPU: hidden 384, 4 layers, bf16, 2 processes, 2 repetitions of 3 runs
    python bench/bench_grpo.py --reps 3   # more repetitions (~1.5 minutes more)
    python bench/bench_grpo.py --quick    # hidden 64, 2 layers, 3 steps: proves the benchmark still runs
    python bench/bench_grpo.py --vocab 32000 --precision fp32   # a real model's vocabulary (~8 minutes; fp32: see
                                          # BENCHMARKS.md on bf16 matmuls over the vocabulary on a CPU)
    python bench/bench_grpo.py --vocab 32000 --precision fp32 --max-new-tokens 256   # TRL's completion length
                                          # (~27 minutes; --goal-sides-only: ours and the baseline alone, ~9 with --reps 1)

Inputs are made here, nothing is downloaded. The model is a Llama of fsdp_lib.testing's `llama_sizes` (hidden 384, 4
layers, 6 heads, SwiGLU 1024, tied embeddings, random fp32 weights: 8,654,208 parameters with the 4096-token
vocabulary) with a byte-level BPE tokenizer trained on generated pseudo-prose and templated sums (<|eos|> ends and
pads). The prompt dataset (a saved `datasets.Dataset` of `prompt` strings and an `answer` column) holds --prompts
prompts "<4-40 words of pseudo-prose>\\nQuestion: what is A plus B? Answer:" (25-93 tokens) with answer A + B. The
model is random, so it answers right by chance (a number among its random tokens): the rewards are mostly 0, a few
1, on both sides alike; the completions mostly run to --max-new-tokens (the end token is 1 of 4096).

Runs (each one `torchrun --nproc_per_node 2` launch, gloo, one OpenMP thread per process, bf16 compute with fp32
weights, AdamW(0.9, 0.95, eps 1e-8, no weight decay) at a constant --lr, clipping at 1.0, activation checkpointing
off; per step every process takes the same 2 prompts on both sides (our data plan's order, seed 0) and samples 8
completions of each, of at most 64 tokens, temperature 1.0, top-p 1.0; the accuracy reward (the last number of the
completion equals the answer), advantages normalised within each prompt's group (std + 1e-4), the clipped objective
(epsilon 0.2) normalised over all completion tokens of the global batch (DAPO's; TRL's loss_type "dapo"), one
optimizer step per generation batch; --steps steps; the three alternate in ABBA order, medians of --reps):

1. ours: `fsdp_train.py --objective grpo --reward accuracy` unchanged, from a worker that only notes its RSS (and
   keeps samples.jsonl, to check the prompts). Generation on the FSDP-sharded model with a KV cache, every rank in
   lockstep; --rollout-unshard auto keeps the decoder layers gathered for the whole generation on a CPU.
2. ours, --rollout-unshard off: the layers gathered again for every generated token, one at a time.
3. baseline, TRL-style (grpo_baseline.py: written, not imported): the same HF model under FSDP2 (fully_shard per
   decoder layer, then the root; bf16 MixedPrecisionPolicy; weights loaded shard by shard) and on every rank a
   plain, unsharded copy in the compute dtype for generation, its weights gathered from the shards (full_tensor per
   parameter) before every generation, as TRL's unwrap_model_for_generation does under ZeRO-3/FSDP; the prompts
   left-padded, `copy.generate(do_sample, temperature, top_p, top_k=0, max_new_tokens, num_return_sequences=8)`,
   the completion mask up to and including the first end token, the completions decoded and scored with the same
   accuracy function (fsdp_lib.train.rewards.accuracy_reward), group advantages, then TRL's loss: one forward of
   prompt + completion with its attention mask, the completion's logits (logits_to_keep) / temperature ->
   selective_log_softmax -> ratio exp(logp - logp.detach()), clipped, summed over the completion tokens and
   divided by the global batch's (all-reduced) over the processes; backward, clipping, AdamW.

Measures (per run; a window is one optimizer step, --log-freq 1; the first step is warm-up and left out):

- step time: the median steady window (ours: from metrics.jsonl, completion tokens / trained_tokens_per_s; the
  baseline: timed by its worker from the weight refresh to the end of the step's metric all-reduce).
- generation per step and generation tokens/s: generated tokens (up to and including the first end token, or
  --max-new-tokens) of all ranks over the ranks' mean generation time, as fsdp_train.py's
  `generation_tokens_per_s`; ours: the time of `rollout.generate` (gathering the layers, prompt and decoding
  forwards, sampling, the lockstep all-reduces), the baseline: the weight refresh plus `generate`. Ours' whole
  rollout phase (`time_generate_ms`: generation, decoding the texts, the rewards, the ranks' agreement) is reported.
- peak per rank: the highest steady window's peak, maximum over the ranks: the process's VmHWM (peak RSS), reset
  at every window start (/proc/self/clear_refs), as fsdp_train.py's `mem_peak_alloc_gb` does. "above runtime":
  less the ranks' RSS after imports. whole-run: the highest VmHWM over the launch (loading and, for ours, the final
  checkpoint and export included).
- sanity: each step's loss, mean reward and gradient norm (the first ones printed), and that both sides trained
  the same prompts at every step (ours' samples.jsonl shows rank 0's first prompt of each step).

Goals (issue 34): ours / baseline step time <= 1.0 on CPU; peak memory per rank <= 0.7x the baseline's; generation
tokens/s >= 1.0x the baseline's. The --rollout-unshard off variant's ratios are reported, not goals. The default run
takes ~3 minutes on a quiet 2-core machine (6 launches, each ~12 s of start-up and 8 steps of 2-3.5 s); --quick
~20 s (one launch of ours and one of the baseline; the off variant is not run). GPU rows: not measured (this benchmark has CPU rows only).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import (
    REPO_ROOT,
    bench_arg_parser,
    interleaved,
    machine_info,
    median,
    print_table,
    work_folder,
    write_results,
)
from inputs import make_corpus, make_llama_folder
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
    "hidden": 384,
    "layers": 4,
    "vocab": 4096,
    "corpus_chars": 400_000,
    "tokenizer_docs": 150,  # the tokenizer learns from these first documents (None: all)
    "nproc": 2,
    "seq": 256,  # --seq-length: the longest prompt + --max-new-tokens fits
    "prompts_per_rank": 2,  # -b
    "num_generations": 8,
    "max_new_tokens": 64,
    "context_words": (4, 40),  # pseudo-prose before each question
    "prompts": 64,
    "steps": 8,
    "precision": "bf16",
    "lr": 1e-5,
    "reps": 2,
    "modes": ("ours", "ours_off", "baseline"),
}
CPU_QUICK = {
    **CPU_FULL,
    "label": "CPU, 2 processes (quick)",
    "hidden": 64,
    "layers": 2,
    "vocab": 512,
    "corpus_chars": 100_000,
    "seq": 64,
    "prompts_per_rank": 1,
    "num_generations": 4,
    "max_new_tokens": 16,
    "context_words": (0, 4),
    "prompts": 16,
    "steps": 3,
    "lr": 1e-4,
    "reps": 1,
    "modes": ("ours", "baseline"),  # the smoke test proves both sides run; --rollout-unshard off is ours again
}
SEED = 0  # fsdp_train.py's --seed: its data plan's order, which the baseline follows
EPSILON = 0.2
MODES = ("ours", "ours_off", "baseline")
NAMES = {
    "ours": "ours, --rollout-unshard auto (on)",
    "ours_off": "ours, --rollout-unshard off",
    "baseline": "TRL-style: generate() on an unsharded copy",
}
GOALS = {  # ratio key -> (comparison, bound, description)
    "ours_over_baseline_step_s": ("<=", 1.0, "ours / baseline, step time"),
    "ours_over_baseline_peak": ("<=", 0.7, "ours / baseline, peak memory per rank"),
    "ours_over_baseline_generation_tokens_per_s": (">=", 1.0, "ours / baseline, generation tokens/s"),
}
GATHERED_LINE = re.compile(r"generation keeps the layers gathered: (yes|no)")
GPU_NOTE = "not measured (this benchmark has CPU rows only)"


# --- Inputs ------------------------------------------------------------------------------------------------------


def with_completions(p: dict[str, Any], new_tokens: int) -> dict[str, Any]:
    """The settings for completions of `new_tokens`: --seq-length grown by as much, so the same prompts fit."""
    return {
        "max_new_tokens": new_tokens,
        "seq": p["seq"] - p["max_new_tokens"] + new_tokens,
        "label": f"{p['label']}, {new_tokens}-token completions",
    }


def with_vocab(p: dict[str, Any], vocab: int) -> dict[str, Any]:
    """The settings for a `vocab`-token vocabulary: above the default's, a corpus large enough for the tokenizer to
    learn that many (~125 characters per token) and every document of it to train on."""
    if vocab < 256 + 64:
        raise SystemExit(f"--vocab {vocab}: at least 320 (the 256 bytes and some merges)")
    more = vocab > p["vocab"]
    return {
        "vocab": vocab,
        "label": f"{p['label']}, vocabulary {vocab:,}",
        "corpus_chars": max(p["corpus_chars"], 125 * vocab) if more else p["corpus_chars"],
        "tokenizer_docs": None if more else p["tokenizer_docs"],
    }


def make_prompts(docs: list[str], p: dict[str, Any], seed: int = 1) -> list[dict[str, str]]:
    """p["prompts"] questions "what is A plus B?" after a few words of pseudo-prose, with their answers."""
    rng = random.Random(seed)
    rows = []
    for i in range(p["prompts"]):
        a, b = rng.randrange(10), rng.randrange(10)
        words = docs[-1 - i % len(docs)].split()[: rng.randint(*p["context_words"])]
        context = " ".join(words) + "\n" if words else ""
        rows.append({"prompt": f"{context}Question: what is {a} plus {b}? Answer:", "answer": str(a + b)})
    return rows


def prompt_schedule(n_prompts: int, p: dict[str, Any]) -> list[list[list[int]]]:
    """[step][rank] -> the prompt indices ours trains at that step on that rank: our DataPlan's own order."""
    from fsdp_lib.data.plan import DataPlan

    class Indices(list):  # the plan's "blocks": gather returns the indices themselves
        def gather(self, indices: list[int]) -> list[int]:
            return list(indices)

    b, world = p["prompts_per_rank"], p["nproc"]
    plans = [DataPlan(Indices(range(n_prompts)), SEED, b * world, b, world, rank) for rank in range(world)]
    if plans[0].steps_per_epoch < p["steps"]:
        raise ValueError(f"{n_prompts} prompts make {plans[0].steps_per_epoch} steps, fewer than {p['steps']}")
    order = plans[0].epoch_order(0)
    return [[plan.micro_batches(order, step)[0] for plan in plans] for step in range(p["steps"])]


def prepare(work: Path, p: dict[str, Any], name: str) -> dict[str, Any]:
    """The model folder, the prompt dataset, the baseline's tokenised prompts and the per-step schedule."""
    import datasets
    from transformers import AutoTokenizer

    from fsdp_lib.testing import arithmetic_documents

    start = time.perf_counter()
    folder = work / name
    docs = make_corpus(p["corpus_chars"])
    texts = docs[: p["tokenizer_docs"]] + arithmetic_documents(200)
    model_dir = make_llama_folder(
        folder / "model", texts, p["hidden"], p["layers"], p["vocab"], weights_dtype="float32"
    )
    rows = make_prompts(docs, p)
    datasets.disable_progress_bars()
    dataset = folder / "prompts"
    datasets.Dataset.from_list(rows).save_to_disk(str(dataset))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # a string prompt is tokenised as fsdp_train.py's prompt loader does it (special tokens as the tokenizer adds them)
    prompts = [{"ids": tokenizer(r["prompt"])["input_ids"], "text": r["prompt"], "answer": r["answer"]} for r in rows]
    lengths = [len(r["ids"]) for r in prompts]
    if max(lengths) > p["seq"] - p["max_new_tokens"]:
        raise RuntimeError(
            f"a prompt of {max(lengths)} tokens does not fit --seq-length {p['seq']} less the completion"
        )
    prompts_file = folder / "baseline_prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    stats = {
        "prompts": len(rows),
        "prompt_tokens_min_median_max": [min(lengths), median(lengths), max(lengths)],
        "vocab": len(tokenizer),
        "parameters": model_parameters(model_dir),
        "seconds": time.perf_counter() - start,
    }
    if stats["vocab"] < p["vocab"]:
        print(
            f"WARNING: the tokenizer learned {stats['vocab']} tokens of the {p['vocab']} asked (a larger corpus needed)"
        )
    print(
        f"{p['label']}: {stats['parameters']:,} parameters, vocabulary {stats['vocab']}, {len(rows)} prompts of "
        f"{stats['prompt_tokens_min_median_max']} tokens; inputs made in {stats['seconds']:.0f}s",
        flush=True,
    )
    return {
        "dataset": dataset,
        "model": model_dir,
        "prompts": prompts,
        "prompts_file": prompts_file,
        "schedule": prompt_schedule(len(rows), p),
        "tokenizer": tokenizer,
        "data": stats,
        "work": folder,
    }


def model_parameters(model_dir: Path) -> int:
    """The parameters in the folder's safetensors (a tied head stored once)."""
    from safetensors import safe_open

    total = 0
    for file in model_dir.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            total += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    return total


def end_tokens(model_dir: Path, tokenizer: Any) -> list[int]:
    """The tokens that end a completion, by the rule ours uses (samples.stop_ids: EOS and the generation config's end
    tokens), for the baseline's generate and completion mask."""
    from types import SimpleNamespace

    from transformers import AutoConfig, GenerationConfig

    from fsdp_lib.train.samples import stop_ids

    config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_dir))
    return sorted(stop_ids(SimpleNamespace(generation_config=config), tokenizer))


# --- One run ---------------------------------------------------------------------------------------------------


def window_figures(windows: list[dict[str, Any]], idle: float) -> dict[str, Any]:
    """A run's figures from its per-step windows (seconds, generation_s, generation_tokens_per_s, tokens_per_s,
    mem_peak_alloc_gb, loss, reward, grad_norm, completion_length); the first step is warm-up."""
    steady = windows[1:]
    if not steady:
        raise RuntimeError(f"{len(windows)} windows: need at least 2 optimizer steps")
    peak = max(w["mem_peak_alloc_gb"] for w in steady)
    step_s = median([w["seconds"] for w in steady])
    generation_s = median([w["generation_s"] for w in steady])
    tokens = sum(w["trained_tokens"] for w in steady)
    return {
        "status": "ok",
        "steps": len(windows),
        "step_s": step_s,
        "generation_s": generation_s,
        "generation_share": median([w["generation_s"] / w["seconds"] for w in steady]),
        "generation_tokens_per_s": median([w["generation_tokens_per_s"] for w in steady]),
        "generation_tokens_per_s_aggregate": tokens / sum(w["generation_s"] for w in steady),
        "tokens_per_s": median([w["tokens_per_s"] for w in steady]),
        "generated_tokens_per_step": tokens / len(steady),
        "completion_length": median([w["completion_length"] for w in steady]),
        "peak_gib": peak,
        "idle_rss_gib": idle,
        "peak_above_runtime_gib": peak - idle,
        "windows_s": [w["seconds"] for w in windows],
        "windows_generation_s": [w["generation_s"] for w in windows],
        "windows_peak_gib": [w["mem_peak_alloc_gb"] for w in windows],
        "losses": [w["loss"] for w in windows],
        "rewards": [w["reward"] for w in windows],
        "grad_norms": [w["grad_norm"] for w in windows],
        "mean_reward": sum(w["reward"] for w in windows) / len(windows),
    }


def ours_window(r: dict[str, Any]) -> dict[str, Any]:
    """One metrics.jsonl record of ours as a window: its seconds from the completion tokens and their rate, its
    generation seconds (the ranks' mean) from the generated tokens and generation_tokens_per_s."""
    seconds = r["trained_tokens"] / r["trained_tokens_per_s"]
    phases = {k: r[k] / 1000 for k in ("time_generate_ms", "time_forward_ms", "time_backward_ms", "time_update_ms")}
    return {
        "seconds": seconds,
        "generation_s": r["trained_tokens"] / r["generation_tokens_per_s"],
        "generation_tokens_per_s": r["generation_tokens_per_s"],
        "rollout_s": phases["time_generate_ms"],
        "forward_s": phases["time_forward_ms"],
        "backward_s": phases["time_backward_ms"],
        "update_s": phases["time_update_ms"],
        "tokens_per_s": r["tokens_per_s"],
        "trained_tokens": r["trained_tokens"],
        "completion_length": r["completion_length"],
        "mem_peak_alloc_gb": r["mem_peak_alloc_gb"],
        "loss": r["loss"],
        "reward": r["reward"],
        "grad_norm": r["grad_norm"],
    }


def ours_args(inputs: dict[str, Any], p: dict[str, Any], exp: str, save_dir: Path, unshard: str) -> list[str]:
    args = ["-e", exp, "-d", str(inputs["dataset"]), "-m", str(inputs["model"]), "--save-dir", str(save_dir)]
    args += ["--objective", "grpo", "--reward", "accuracy", "--grpo-loss", "dapo", "--epsilon", str(EPSILON)]
    args += ["--num-generations", str(p["num_generations"]), "--max-new-tokens", str(p["max_new_tokens"])]
    args += ["--temperature", "1.0", "--top-p", "1.0", "--rollout-unshard", unshard]
    args += ["-b", str(p["prompts_per_rank"]), "--max-steps", str(p["steps"]), "--seq-length", str(p["seq"])]
    args += ["--precision", p["precision"], "--lr", str(p["lr"]), "--lr-schedule", "constant", "--warmup-steps", "0"]
    args += ["--seed", str(SEED), "--log-freq", "1", "--ckpt-freq", "0", "--activation-checkpointing", "off"]
    return args


def run_ours(inputs: dict[str, Any], p: dict[str, Any], mode: str, rep: int) -> dict[str, Any]:
    """One fsdp_train.py launch, in a fresh save folder."""
    work = inputs["work"]
    exp = f"{mode}_{rep}"
    save_dir = work / f"outputs_{exp}"
    prefix = work / f"{exp}.rss"
    args = ours_args(inputs, p, exp, save_dir, "off" if mode == "ours_off" else "auto")
    start = time.perf_counter()
    run = run_trainer(Path(__file__), ["--worker", str(prefix), str(save_dir / exp), *args], p["nproc"], save_dir / exp)
    shutil.rmtree(save_dir, ignore_errors=True)
    if run.failure:
        return run.failure
    windows = [ours_window(r) for r in run.windows]
    idle, run_peak = rank_figures(work, prefix.name, p["nproc"])
    out = window_figures(windows, idle)
    out |= {"launch_s": time.perf_counter() - start, "run_peak_rss_gib": run_peak}
    for key in ("rollout_s", "forward_s", "backward_s", "update_s"):
        out[key] = median([w[key] for w in windows[1:]])
    gathered = GATHERED_LINE.search(run.log)
    out["layers_kept_gathered"] = gathered.group(1) if gathered else None
    samples = Path(f"{prefix}.samples.jsonl")
    rows = [json.loads(line) for line in samples.read_text().splitlines()] if samples.is_file() else []
    out["sample_prompts"] = {row["step"]: row["prompt"] for row in rows}
    return out


def run_baseline(inputs: dict[str, Any], p: dict[str, Any], rep: int) -> dict[str, Any]:
    """One torchrun launch of the TRL-style worker."""
    work = inputs["work"]
    prefix = work / f"baseline_{rep}.rss"
    tokenizer = inputs["tokenizer"]
    config = {
        "model": str(inputs["model"]),
        "prompts": str(inputs["prompts_file"]),
        "schedule": inputs["schedule"],
        "num_generations": p["num_generations"],
        "max_new_tokens": p["max_new_tokens"],
        "temperature": 1.0,
        "top_p": 1.0,
        "epsilon": EPSILON,
        "precision": p["precision"],
        "lr": p["lr"],
        "seed": SEED,
        "pad_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        "stops": end_tokens(inputs["model"], tokenizer),
        "out": str(prefix),
    }
    config_file = work / f"baseline_{rep}.json"
    config_file.write_text(json.dumps(config))
    first_failure = None
    for attempt in (1, 2):  # a failed baseline launch is rerun once, loudly (CI saw one fail once, cause unknown)
        start = time.perf_counter()
        try:
            torchrun(Path(__file__).with_name("grpo_baseline.py"), [str(config_file)], p["nproc"], timeout=1800)
            break
        except LaunchError as exc:
            if attempt == 2:
                return failed_launch(exc)
            first_failure = failed_launch(exc)
            tail = "\n".join(f"  | {line}" for line in first_failure.get("log_tail", "").splitlines()[-40:])
            print(f"baseline rep {rep} failed, rerunning it once: {first_failure.get('error', 'OOM')}\n{tail}")
    windows = json.loads(Path(f"{prefix}.windows.json").read_text())
    idle, run_peak = rank_figures(work, prefix.name, p["nproc"])
    out = window_figures(windows, idle)
    out |= {"launch_s": time.perf_counter() - start, "run_peak_rss_gib": run_peak}
    if first_failure is not None:
        out["first_attempt_failed"] = first_failure.get("error", "OOM")
    out["refresh_s"] = median([w["refresh_s"] for w in windows[1:]])
    out["first_prompts"] = {w["step"]: inputs["prompts"][w["first_prompt"]]["text"] for w in windows}
    return out


def worker(prefix: str, exp_dir: str, argv: list[str]) -> int:
    """Ours, launched by torchrun from run_ours: fsdp_train.main through trainer_worker (which notes the RSS), then
    rank 0 keeps samples.jsonl (the run's folder is removed once its metrics are read)."""
    code = trainer_worker(prefix, argv)
    samples = Path(exp_dir) / "samples.jsonl"
    if os.environ.get("RANK", "0") == "0" and samples.is_file():
        shutil.copyfile(samples, f"{prefix}.samples.jsonl")
    return code


def summary(r: dict[str, Any]) -> str:
    if (failed := failure_text(r)) is not None:
        return failed
    return (
        f"step {r['step_s']:.2f}s (windows {', '.join(f'{t:.2f}' for t in r['windows_s'])}), generation "
        f"{r['generation_s']:.2f}s/step at {r['generation_tokens_per_s']:.0f} tokens/s, peak {r['peak_gib']:.3f} "
        f"GiB/rank (whole run {r['run_peak_rss_gib']:.3f}), launch {r['launch_s']:.0f}s, rewards "
        f"{', '.join(f'{x:.3g}' for x in r['rewards'])}"
        + (f" (its first launch failed: {r['first_attempt_failed']})" if "first_attempt_failed" in r else "")
    )


# --- The comparison ----------------------------------------------------------------------------------------------

FIGURE_KEYS = (
    "step_s",
    "generation_s",
    "generation_share",
    "generation_tokens_per_s",
    "generation_tokens_per_s_aggregate",
    "tokens_per_s",
    "generated_tokens_per_step",
    "completion_length",
    "rollout_s",
    "forward_s",
    "backward_s",
    "update_s",
    "refresh_s",
    "peak_gib",
    "peak_above_runtime_gib",
    "idle_rss_gib",
    "run_peak_rss_gib",
    "launch_s",
    "mean_reward",
)
FIRST_KEYS = ("steps", "layers_kept_gathered", "losses", "rewards", "grad_norms")
RATIOS = {  # key -> (numerator mode, denominator mode, figure)
    "ours_over_baseline_step_s": ("ours", "baseline", "step_s"),
    "ours_over_baseline_peak": ("ours", "baseline", "peak_gib"),
    "ours_over_baseline_generation_tokens_per_s": ("ours", "baseline", "generation_tokens_per_s"),
    "ours_over_baseline_generation_s": ("ours", "baseline", "generation_s"),
    "ours_over_baseline_peak_above_runtime": ("ours", "baseline", "peak_above_runtime_gib"),
    "ours_over_baseline_whole_run_peak": ("ours", "baseline", "run_peak_rss_gib"),
    "ours_off_over_baseline_step_s": ("ours_off", "baseline", "step_s"),
    "ours_off_over_baseline_peak": ("ours_off", "baseline", "peak_gib"),
    "ours_off_over_baseline_generation_tokens_per_s": ("ours_off", "baseline", "generation_tokens_per_s"),
    "ours_off_over_ours_generation_s": ("ours_off", "ours", "generation_s"),
}


def prompt_check(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Both sides' rank-0 first prompt at every step: ours from samples.jsonl, the baseline from its schedule."""
    ours = next((r for r in runs["ours"] if r["status"] == "ok"), None)
    baseline = next((r for r in runs["baseline"] if r["status"] == "ok"), None)
    if ours is None or baseline is None:
        return {"steps": 0, "equal": 0}
    theirs = {int(k): v for k, v in baseline["first_prompts"].items()}
    mine = {int(k): v for k, v in ours["sample_prompts"].items()}
    return {"steps": len(theirs), "ours_steps": len(mine), "equal": sum(mine.get(k) == v for k, v in theirs.items())}


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians per mode, the ratios of the medians, the per-repetition ratios and the prompt check."""
    figures = mode_figures(runs, FIGURE_KEYS, FIRST_KEYS)
    ratios, per_rep = mode_ratios(figures, runs, RATIOS)
    return {"figures": figures, "ratios": ratios, "ratios_per_rep": per_rep, "prompts": prompt_check(runs)}


HEADERS = [
    "device",
    "run",
    "step s (median)",
    "step s per rep",
    "generation s/step (share)",
    "generation tokens/s",
    "tokens/s",
    "peak per rank (GiB)",
    "peak above runtime (GiB)",
    "whole-run peak (GiB)",
    "reward per step",
]


def table_rows(label: str, s: dict[str, Any], runs: dict[str, list[dict[str, Any]]]) -> list[list[Any]]:
    rows = []
    for mode in MODES:
        f = s["figures"][mode]
        if "step_s" not in f:
            status = ", ".join(r["status"] for r in runs[mode]) or "not run (--quick)"
            rows.append([label, NAMES[mode], status, *["-"] * 8])
            continue
        rows.append(
            [
                label,
                NAMES[mode],
                f["step_s"],
                ", ".join(f"{r['step_s']:.2f}" for r in runs[mode] if r["status"] == "ok"),
                f"{f['generation_s']:.2f} ({f['generation_share']:.0%})",
                f["generation_tokens_per_s"],
                f["tokens_per_s"],
                f["peak_gib"],
                f["peak_above_runtime_gib"],
                f["run_peak_rss_gib"],
                ", ".join(f"{x:.2g}" for x in f["rewards"]),
            ]
        )
    return rows


def print_ratios(label: str, s: dict[str, Any]) -> None:
    print_goal_ratios(label, s, GOALS)
    print_reported_ratios(label, s, RATIOS, GOALS)
    f = s["figures"]
    if "step_s" in f["ours"]:
        o = f["ours"]
        print(
            f"{label}: ours per step: rollout {o['rollout_s']:.2f}s (generation {o['generation_s']:.2f}s), forward "
            f"{o['forward_s']:.2f}s, backward {o['backward_s']:.2f}s, update {o['update_s']:.3f}s; layers kept "
            f"gathered: {o['layers_kept_gathered']}"
        )
    if "step_s" in f["baseline"]:
        b = f["baseline"]
        print(
            f"{label}: baseline per step: generation {b['generation_s']:.2f}s (of which the weight refresh "
            f"{b['refresh_s']:.3f}s), the rest {b['step_s'] - b['generation_s']:.2f}s"
        )
    for mode in MODES:
        if "losses" in f[mode]:
            first = ", ".join(f"{x:.3g}" for x in f[mode]["losses"][:3])
            norms = ", ".join(f"{x:.3g}" for x in f[mode]["grad_norms"][:3])
            print(
                f"{label}: {NAMES[mode]}: first losses {first}; grad norms {norms}; mean reward {f[mode]['mean_reward']:.3f}"
            )
    check = s["prompts"]
    print(f"{label}: the same prompts on both sides at {check['equal']} of {check['steps']} steps (rank 0's first)")


def measure(inputs: dict[str, Any], p: dict[str, Any], reps: int) -> tuple[dict, dict]:
    print(
        f"{p['label']}: {p['prompts_per_rank']} prompts x {p['num_generations']} completions of <= "
        f"{p['max_new_tokens']} tokens per process per step, {p['steps']} steps, {p['precision']}, {reps} repetitions:",
        flush=True,
    )
    counters = {mode: iter(range(reps)) for mode in MODES}
    sides = {
        "ours": lambda: run_ours(inputs, p, "ours", next(counters["ours"])),
        "ours_off": lambda: run_ours(inputs, p, "ours_off", next(counters["ours_off"])),
        "baseline": lambda: run_baseline(inputs, p, next(counters["baseline"])),
    }
    with gpus_hidden(True):
        runs = interleaved(reps, {mode: sides[mode] for mode in p["modes"]}, summary=summary)
    runs = {mode: runs.get(mode, []) for mode in MODES}  # a mode not run (--quick: ours_off) has no runs
    return runs, summarise(runs)


def code_state() -> dict[str, Any]:
    """The commit measured and the files that differ from it (uncommitted work is measured as it stands)."""

    def git(*args: str) -> str:
        proc = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    return {"commit": git("rev-parse", "HEAD"), "uncommitted": git("status", "--porcelain").splitlines()}


def main(argv: list[str] | None = None) -> int:
    parser = bench_arg_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="", help="compute dtype (default: bf16)")
    parser.add_argument("--steps", type=int, default=0, help="optimizer steps per run (default 8; 3 with --quick)")
    parser.add_argument(
        "--vocab",
        type=int,
        default=0,
        help="vocabulary size (default 4096; 32000 is Llama 2's and Mistral's: the logits then weigh as in a real model)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=0,
        help="tokens generated per completion (default 64; 16 with --quick; TRL's GRPO default is 256): the "
        "completions' logits grow with it",
    )
    parser.add_argument(
        "--goal-sides-only",
        action="store_true",
        help="run ours and the baseline only, not the --rollout-unshard off variant (a third less time)",
    )
    args = parser.parse_args(argv)
    if args.max_new_tokens < 0:
        parser.error(f"--max-new-tokens {args.max_new_tokens}: give a positive number of tokens (0: the default)")
    started = time.perf_counter()
    p = dict(CPU_QUICK if args.quick else CPU_FULL)
    p["precision"] = args.precision or p["precision"]
    p["steps"] = args.steps or p["steps"]
    if args.vocab:
        p.update(with_vocab(p, args.vocab))
    if args.max_new_tokens:
        p.update(with_completions(p, args.max_new_tokens))
    if args.goal_sides_only:
        p["modes"] = tuple(m for m in p["modes"] if m != "ours_off")
    reps = args.reps or p["reps"]
    results: dict[str, Any] = {"machine": machine_info(), "code": code_state(), "params": {"cpu": {**p, "reps": reps}}}
    with work_folder(args, "bench_grpo_") as work:
        inputs = prepare(work, p, "cpu")
        results["data"] = {"cpu": inputs["data"]}
        runs, summary_ = measure(inputs, p, reps)
        results["cpu"] = device_results(runs, summary_, GOALS)
        results["gpu"] = GPU_NOTE
    print_table(HEADERS, table_rows(p["label"], summary_, runs))
    print_ratios(p["label"], summary_)
    print(f"1 GPU: {GPU_NOTE}")
    results["seconds"] = time.perf_counter() - started
    print(f"benchmark time: {results['seconds'] / 60:.1f} minutes")
    write_results(args.results_dir, "grpo", results)
    return report_failures(numbered_runs("cpu", runs))


if __name__ == "__main__":
    from fsdp_lib.interrupts import exit_without_teardown  # a worker skips the interpreter teardown

    if sys.argv[1:2] == ["--worker"]:  # ours, launched by torchrun from run_ours
        exit_without_teardown(worker(sys.argv[2], sys.argv[3], sys.argv[4:]))
    sys.exit(main())
