"""`make demo`: the whole pipeline, offline, on a corpus the project generates, with a tiny model.

raw files (scripts/make_demo_corpus.py) -> organize_data.py -> data_hf.py (with a validation split)
-> model_download.py --init tiny (tokenizer trained on the corpus) -> fsdp_train.py under torchrun,
interrupted once with SIGTERM and resumed by rerunning the same command -> export -> generations from the
exported model next to the same prompts before training, and a loss plot.

Runs on every GPU when there are some, else on 2 CPU processes (gloo). Everything lands in demo_workspace/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from make_demo_corpus import DEMO_COMPLETIONS, DEMO_PROMPTS  # noqa: E402


def banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    print("$ " + " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], cwd=REPO, env=env, check=True)


def offline_env() -> dict[str, str]:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }


def generate(model_dir: Path, prompts: list[str], max_new_tokens: int = 16) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).eval()
    outputs = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(
                **ids,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            )
        text = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
        outputs.append(text.split("\n")[0].strip())
    return outputs


def train_with_one_interruption(train_cmd: list[str], metrics: Path, interrupt_at: int, env: dict[str, str]) -> None:
    """Start training, send SIGTERM once the run passes `interrupt_at` (as a preemption would), then rerun
    the very same command, which resumes from the checkpoint written on the signal."""
    print("$ " + " ".join(train_cmd), flush=True)
    proc = subprocess.Popen(train_cmd, cwd=REPO, env=env)
    while proc.poll() is None:
        rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
        if any(r.get("step", 0) >= interrupt_at for r in rows):
            print(
                f"\n>>> demo: sending SIGTERM to the trainers at step >= {interrupt_at}, as a preemption would",
                flush=True,
            )
            # Signal the workers (as SLURM does to every task); torchrun then sees them exit 0 after saving.
            workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
            for pid in workers:
                os.kill(int(pid), signal.SIGTERM)
            break
        time.sleep(0.2)
    proc.wait()
    banner("rerunning the same command: it resumes from the newest complete checkpoint")
    run(train_cmd, env=env)


def plot_losses(metrics: Path, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*train), label="train loss (global batch)")
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("make demo: tiny Llama on the demo corpus")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workspace", default="demo_workspace", help="folder for everything the demo writes")
    parser.add_argument("--interrupt-at", type=int, default=200, help="step after which the demo sends SIGTERM")
    parser.add_argument("--max-steps", type=int, help="override configs/demo_tiny.yaml's max-steps (a quicker run)")
    parser.add_argument("--nproc", type=int, default=0, help="processes (0 = every GPU, else 2 on CPU)")
    args = parser.parse_args(argv)

    import torch

    ws = (REPO / args.workspace).resolve()
    if ws.exists():
        shutil.rmtree(ws)  # the demo's own folder: every run starts clean
    raw, splits, dataset, model = ws / "raw", ws / "splits", ws / "hf_datasets" / "demo", ws / "models" / "tiny"
    outputs = ws / "outputs"
    env = offline_env()
    py = sys.executable
    nproc = args.nproc or (torch.cuda.device_count() or 2)

    banner("1/6 generate the demo corpus (a mix of txt, md, json, jsonl and yaml, plus two bad files)")
    run([py, "scripts/make_demo_corpus.py", "--out", raw], env)
    banner("2/6 organize_data.py: spread the raw files over balanced split folders")
    run([py, "organize_data.py", "--src_dir", raw, "--dst_root", splits, "--num_dirs", "4"], env)
    banner("3/6 data_hf.py: extract every string into an Arrow dataset with a validation split")
    run([py, "data_hf.py", "--data_folder", splits, "--save_dir", dataset, "--val-fraction", "0.05"], env)
    banner("4/6 model_download.py --init tiny: a new Llama-architecture model with a tokenizer trained on the corpus")
    run(
        [
            py,
            "model_download.py",
            "--init",
            "tiny",
            "--tokenizer-from",
            dataset,
            "--local-dir",
            model,
            "--with-weights",
            "--seed",
            "0",
        ],
        env,
    )
    before = generate(model, DEMO_PROMPTS)

    banner(
        f"5/6 fsdp_train.py on {nproc} {'GPU' if torch.cuda.is_available() else 'CPU'} process(es), "
        f"interrupted once and resumed"
    )
    train_cmd = [
        py,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "fsdp_train.py",
        "--config",
        "configs/demo_tiny.yaml",
        "-e",
        "demo",
        "-d",
        str(dataset),
        "-m",
        str(model),
        "--save-dir",
        str(outputs),
        *(["--max-steps", str(args.max_steps)] if args.max_steps else []),
    ]
    exp = outputs / "demo"
    train_with_one_interruption(train_cmd, exp / "metrics.jsonl", args.interrupt_at, env)

    banner("6/6 generations from the exported model (outputs/demo/final), before vs after training")
    after = generate(exp / "final", DEMO_PROMPTS)
    correct = 0
    for prompt, b, a in zip(DEMO_PROMPTS, before, after):
        want = DEMO_COMPLETIONS[prompt].strip()
        correct += a.startswith(want)
        print(f"prompt: {prompt!r}   (corpus answer: {want!r})\n  before: {b!r}\n  after:  {a!r}")
    print(f"\n{correct}/{len(DEMO_PROMPTS)} prompts answered as the corpus teaches after training")
    plot = exp / "loss.png"
    plot_losses(exp / "metrics.jsonl", plot)
    rows = [json.loads(x) for x in (exp / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train_losses = [r["loss"] for r in rows if "loss" in r]
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    print(
        f"\ntrain loss {train_losses[0]:.3f} -> {train_losses[-1]:.3f}"
        + (f"; validation loss {vals[0]:.3f} -> {vals[-1]:.3f}" if vals else "")
    )
    print(f"""
Where everything is:
  raw corpus            {raw}
  split folders         {splits} (.organize_manifest.json lists destination -> source)
  Arrow dataset         {dataset}
  tiny model            {model}
  checkpoints           {exp / "checkpoint"} (state.json names the newest)
  metrics               {exp / "metrics.jsonl"}  (TensorBoard: {exp / "tensorboard"})
  loss plot             {plot}
  exported HF model     {exp / "final"}""")
    return 0


if __name__ == "__main__":
    sys.exit(main())
