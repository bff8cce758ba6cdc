"""`make demo`: the whole pipeline, offline, on a corpus the project generates, with a tiny model.

raw files (scripts/make_demo_corpus.py) -> organize_data.py -> data_hf.py (with a validation split)
-> model_download.py --init tiny (tokenizer trained on the corpus) -> fsdp_train.py under torchrun,
interrupted once with SIGTERM and resumed by rerunning the same command -> export -> generations from the
exported model next to the same prompts before training, and a loss plot. Then a chat fine-tune of that model:
the demo's conversations (make_demo_corpus.py --chat-out) -> data_hf.py --format chat -> fsdp_train.py with
configs/chatml.jinja as the chat template (loss on the assistant turns only) -> the held-out conversations' loss
and answers before vs after.

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
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(1, str(REPO))

from make_demo_corpus import DEMO_CHAT_ANSWERS, DEMO_COMPLETIONS, DEMO_PROMPTS  # noqa: E402

# The demo tokenizer has no chat template and no ChatML special tokens: the markers are plain text to it.
CHAT_TEMPLATE = REPO / "configs" / "chatml.jinja"


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


def load_model(model_dir: Path) -> tuple[Any, Any]:
    """(tokenizer with configs/chatml.jinja as its chat template, fp32 model in eval mode)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    tokenizer.chat_template = CHAT_TEMPLATE.read_text()
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).eval()
    return tokenizer, model


def generate(model_dir: Path, prompts: list[str], max_new_tokens: int = 16, chat: bool = False) -> list[str]:
    """Greedy completions of `prompts`; with chat, each prompt is a user turn rendered with the chat template
    (as the trainer renders conversations: no BOS) and the answer ends at the end-of-turn marker."""
    import torch

    tokenizer, model = load_model(model_dir)
    outputs = []
    for prompt in prompts:
        if chat:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
        else:
            ids = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(
                **ids,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            )
        text = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
        if chat:  # up to the end-of-turn marker, which the tiny model learns as text and may only half spell
            outputs.append(text.split("<|")[0].replace("\n", " ").strip())
        else:
            outputs.append(text.split("\n")[0].strip())
    return outputs


def assistant_loss(model_dir: Path, conversations: list[list[dict]]) -> float:
    """Mean cross-entropy over the assistant tokens of `conversations`, labelled as the trainer labels them
    (ChatEncoder with configs/chatml.jinja)."""
    import torch

    from fsdp_lib.data.chat import ChatEncoder

    tokenizer, model = load_model(model_dir)
    loss_sum, targets = 0.0, 0
    for ids, trained in ChatEncoder(tokenizer, "assistant").encode(conversations, {}):
        inputs = torch.tensor([ids])
        labels = inputs.masked_fill(torch.from_numpy(trained == 0)[None], -100)
        count = int((labels[:, 1:] != -100).sum())  # the model shifts labels: position i predicts token i+1
        with torch.no_grad():
            loss_sum += model(input_ids=inputs, labels=labels).loss.item() * count
        targets += count
    return loss_sum / targets


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


def chat_fine_tune(
    args: argparse.Namespace,
    env: dict[str, str],
    nproc: int,
    base: Path,
    chat_raw: Path,
    chat_dataset: Path,
    outputs: Path,
) -> int:
    """Steps 7-8: the conversations into a `messages` dataset, a short SFT run of the text-trained model with
    the loss on the assistant turns, then the held-out conversations' loss and the demo questions' answers before
    and after. Returns the steps trained."""
    from fsdp_lib.records.dataset import load_text_dataset

    py = sys.executable
    banner("7/8 data_hf.py --format chat: the conversations into a 'messages' dataset (two bad records are counted)")
    run(
        [py, "data_hf.py", "--data_folder", chat_raw, "--save_dir", chat_dataset, "--format", "chat"]
        + ["--val-fraction", "0.1"],
        env,
    )
    banner(f"8/8 chat fine-tune of outputs/demo/final: loss on the assistant turns, template {CHAT_TEMPLATE.name}")
    _, validation = load_text_dataset(chat_dataset)
    held_out = [list(conversation) for conversation in validation["messages"]]
    questions = list(DEMO_CHAT_ANSWERS)
    loss_before, answers_before = assistant_loss(base, held_out), generate(base, questions, 24, chat=True)
    run(
        [py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "fsdp_train.py"]
        + ["--config", "configs/demo_tiny.yaml", "-e", "demo_chat", "-d", chat_dataset, "-m", base]
        + ["--save-dir", outputs, "--chat-template", CHAT_TEMPLATE.relative_to(REPO)]
        # the text run's rate: at 1e-3 (100-200 steps) the tiny model learnt the answer format but answered 1 of the
        # 4 questions with its fact; at 6e-3, 250-400 steps answered all 4 (measured on the 2-core VM)
        + ["--max-steps", str(args.chat_steps), "--lr", "6e-3", "--min-lr", "3e-4", "--warmup-steps", "5"]
        + ["--eval-freq", "0", "--ckpt-freq", "0", "--log-freq", "10"]
        # each conversation whole in one block (--packing whole): at 128 tokens 11% of them were cut into pieces;
        # -b 4 keeps the 2,048 positions per step of the text run
        + ["--seq-length", "256", "-b", "4"],
        env,
    )
    tuned = outputs / "demo_chat" / "final"
    loss_after, answers_after = assistant_loss(tuned, held_out), generate(tuned, questions, 24, chat=True)
    for question, before, after in zip(questions, answers_before, answers_after):
        print(
            f"user: {question!r}   (data: {DEMO_CHAT_ANSWERS[question]!r})\n  before: {before!r}\n  after:  {after!r}"
        )
    right = sum(after.strip().startswith(DEMO_CHAT_ANSWERS[q]) for q, after in zip(questions, answers_after))
    print(
        f"\n{right}/{len(questions)} questions answered with the fact the conversations teach after the chat fine-tune"
    )
    print(
        f"\nassistant-token loss on {len(held_out)} held-out conversations: base (the text model) {loss_before:.3f}"
        f" -> fine-tuned {loss_after:.3f}"
    )
    return args.chat_steps


# The demo's mark on its workspace: a folder without it (and not empty) is not the demo's to delete.
WORKSPACE_MARKER = ".demo_workspace"


def workspace_problem(ws: Path) -> str | None:
    """Why the demo may not delete `ws` and start clean in it (None: it may): every run deletes its workspace, so
    that must be a folder the demo made (its marker), an empty one, or none. Names alone prove nothing: a project
    folder holds raw/, hf_datasets/, models/ and outputs/ too."""
    if not ws.exists() and not ws.is_symlink():
        return None
    if not ws.is_dir() or ws.is_symlink():
        return "is not a folder; choose a new folder for --workspace"
    if ws == REPO or REPO.is_relative_to(ws):
        return "holds this repository; choose a new folder for --workspace"
    entries = {entry.name for entry in ws.iterdir()}
    if WORKSPACE_MARKER in entries or not entries:
        return None
    shown = ", ".join(sorted(entries)[:3])
    return (
        f"holds files the demo did not mark as its own ({shown}); every demo run deletes its workspace and starts "
        "clean, so choose a new or empty folder for --workspace (a workspace of an older demo: make clean-demo)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--workspace",
        default="demo_workspace",
        help="folder for everything the demo writes, deleted at the start of each run (a folder the demo made, or a new or empty one)",
    )
    parser.add_argument("--interrupt-at", type=int, default=200, help="step after which the demo sends SIGTERM")
    parser.add_argument("--max-steps", type=int, help="override configs/demo_tiny.yaml's max-steps (a quicker run)")
    parser.add_argument("--nproc", type=int, default=0, help="processes (0 = every GPU, else 2 on CPU)")
    parser.add_argument("--chat-steps", type=int, default=300, help="optimizer steps of the chat fine-tune")
    args = parser.parse_args(argv)

    ws = (REPO / args.workspace).resolve()
    if problem := workspace_problem(ws):
        print(f"demo.py: --workspace {ws} {problem}", file=sys.stderr)
        return 2
    if ws.exists():
        shutil.rmtree(ws)  # the demo's own folder: every run starts clean
    ws.mkdir(parents=True)
    (ws / WORKSPACE_MARKER).write_text("made by scripts/demo.py: deleted and made again by every demo run\n")

    import torch

    raw, splits, dataset, model = ws / "raw", ws / "splits", ws / "hf_datasets" / "demo", ws / "models" / "tiny"
    chat_raw, chat_dataset = ws / "chat", ws / "hf_datasets" / "demo_chat"
    outputs = ws / "outputs"
    env = offline_env()
    py = sys.executable
    nproc = args.nproc or (torch.cuda.device_count() or 2)

    banner("1/8 generate the demo corpus (a mix of txt, md, json, jsonl and yaml, plus two bad files; conversations)")
    run([py, "scripts/make_demo_corpus.py", "--out", raw, "--chat-out", chat_raw], env)
    banner("2/8 organize_data.py: spread the raw files over balanced split folders")
    run([py, "organize_data.py", "--src_dir", raw, "--dst_root", splits, "--num_dirs", "4"], env)
    banner("3/8 data_hf.py: extract every string into an Arrow dataset with a validation split")
    run([py, "data_hf.py", "--data_folder", splits, "--save_dir", dataset, "--val-fraction", "0.05"], env)
    banner("4/8 model_download.py --init tiny: a new Llama-architecture model with a tokenizer trained on the corpus")
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
        f"5/8 fsdp_train.py on {nproc} {'GPU' if torch.cuda.is_available() else 'CPU'} process(es), "
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

    banner("6/8 generations from the exported model (outputs/demo/final), before vs after training")
    after = generate(exp / "final", DEMO_PROMPTS)
    correct = 0
    for prompt, b, a in zip(DEMO_PROMPTS, before, after):
        want = DEMO_COMPLETIONS[prompt].strip()
        correct += a.startswith(want)
        print(f"prompt: {prompt!r}   (corpus answer: {want!r})\n  before: {b!r}\n  after:  {a!r}")
    print(f"\n{correct}/{len(DEMO_PROMPTS)} prompts answered as the corpus teaches after training")
    plot = exp / "loss.png"  # written by fsdp_train.py at the end of the run
    rows = [json.loads(x) for x in (exp / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train_losses = [r["loss"] for r in rows if r.get("loss") is not None]
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    print(
        f"\ntrain loss {train_losses[0]:.3f} -> {train_losses[-1]:.3f}"
        + (f"; validation loss {vals[0]:.3f} -> {vals[-1]:.3f}" if vals else "")
    )

    chat_steps = chat_fine_tune(args, env, nproc, exp / "final", chat_raw, chat_dataset, outputs)
    print(f"""
Where everything is:
  raw corpus            {raw}
  split folders         {splits} (.organize_manifest.json lists destination -> source)
  Arrow dataset         {dataset}
  tiny model            {model}
  checkpoints           {exp / "checkpoint"} (state.json names the newest)
  metrics               {exp / "metrics.jsonl"}  (TensorBoard: {exp / "tensorboard"})
  loss plot             {plot}
  exported HF model     {exp / "final"}
  conversations         {chat_raw} -> {chat_dataset}
  chat fine-tune        {outputs / "demo_chat"} ({chat_steps} steps; metrics.jsonl, exported model in final/)""")
    return 0


if __name__ == "__main__":
    sys.exit(main())
