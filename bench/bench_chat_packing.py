"""What packing conversations whole buys: fsdp_train.py's chat fine-tune with --packing whole (each conversation in
one block, the rest padding) against --packing stream (one token stream cut into blocks: a conversation that
crosses a block boundary trains its end without its start), the same data, model, steps and positions per step.

    python bench/bench_chat_packing.py            # CPU, 2 processes, seq 128 and 256, 300 steps each: ~4 minutes
    python bench/bench_chat_packing.py --quick    # 20 steps at seq 128: proves it still runs

The data are make_demo_corpus.py's conversations (the demo's ~600, through data_hf.py --format chat, 10% held out);
the model is the demo's base: model_download.py --init tiny with a tokenizer trained on the demo's text corpus,
trained on that corpus with configs/demo_tiny.yaml (500 steps), as a fine-tune starts from a pretrained model; each
run fine-tunes it with the demo's chat settings (ChatML template, lr 6e-3, 4,096 positions per step). Measured per run:
the held-out conversations' assistant-token loss after training (scripts/demo.py's assistant_loss; the held-out
conversations ask the training facts in the same words, so this measures recall, not generalisation), the share of
conversations the stream cuts and the whole blocks' fill (both from the trainer's log), tokens/s and trained
tokens/s (metrics.jsonl, the first window skipped). Result: the ratio whole / stream of each. No goal: it reports
what the default (whole for conversations since 2026-11-28) costs in padding and buys in loss.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from common import REPO_ROOT, bench_arg_parser, last_loss, machine_info, median, print_table, work_folder, write_results
from inputs import init_model_folder
from launch import torchrun

sys.path.insert(0, str(REPO_ROOT / "scripts"))
from demo import assistant_loss  # noqa: E402  (the demo's own measure of a chat fine-tune)

FULL = {"seqs": (128, 256), "steps": 300, "base_steps": 500}
QUICK = {"seqs": (128,), "steps": 20, "base_steps": 10}
POSITIONS_PER_STEP = 4096  # 2 processes x -b x --seq-length


def make_inputs(work: Path, base_steps: int) -> tuple[Path, Path]:
    """work/chat_dataset (the demo's conversations, 10% held out) and the base: the tiny model trained on the
    demo's text corpus for base_steps (exported to work/out/base/final)."""
    py = sys.executable
    run = lambda *cmd: subprocess.run([py, *map(str, cmd)], cwd=REPO_ROOT, check=True, capture_output=True)  # noqa: E731
    run("scripts/make_demo_corpus.py", "--out", work / "raw", "--chat-out", work / "chat", "--no-bad-files")
    run("data_hf.py", "--data-folder", work / "raw", "--save-dir", work / "text_dataset")
    run("data_hf.py", "--data-folder", work / "chat", "--save-dir", work / "chat_dataset", "--format", "chat",
        "--val-fraction", "0.1")  # fmt: skip
    model = init_model_folder(work / "model", "tiny", ["--tokenizer-from", str(work / "text_dataset")])
    args = ["--config", "configs/demo_tiny.yaml", "-e", "base", "-d", work / "text_dataset", "-m", model]
    args += ["--save-dir", work / "out", "--max-steps", base_steps, "--eval-freq", "0", "--ckpt-freq", "0"]
    args += ["--tensorboard", "off"]
    torchrun(REPO_ROOT / "fsdp_train.py", [str(a) for a in args], 2)
    return work / "chat_dataset", work / "out" / "base" / "final"


def fine_tune(work: Path, dataset: Path, model: Path, packing: str, seq: int, steps: int, seed: int) -> dict[str, Any]:
    """One fsdp_train.py chat fine-tune; its log's packing line, its throughput and its export's held-out loss."""
    from fsdp_lib.records.dataset import load_text_dataset

    name = f"{packing}_{seq}"
    args = ["--config", "configs/demo_tiny.yaml", "-e", name, "-d", dataset, "-m", model, "--save-dir", work / "out"]
    args += ["--chat-template", "configs/chatml.jinja", "--max-steps", steps, "--lr", "6e-3", "--min-lr", "3e-4"]
    args += ["--warmup-steps", "5", "--eval-freq", "0", "--ckpt-freq", "0", "--log-freq", "10"]
    args += ["--seq-length", seq, "-b", POSITIONS_PER_STEP // (2 * seq), "--packing", packing, "--seed", seed]
    proc = torchrun(REPO_ROOT / "fsdp_train.py", [str(a) for a in args], 2)
    log = proc.stdout + proc.stderr
    experiment = work / "out" / name
    windows = [json.loads(line) for line in (experiment / "metrics.jsonl").read_text().splitlines()]
    windows = [w for w in windows if "tokens_per_s" in w][1:]
    _, validation = load_text_dataset(str(dataset))
    loss = assistant_loss(experiment / "final", [list(c) for c in validation["messages"]])
    shutil.rmtree(experiment, ignore_errors=True)
    cut = re.search(r"\((\d+\.\d)%\) start in one block and end in the next", log)
    fill = re.search(r"\((\d+\.\d)% of their positions used", log)
    return {
        "held_out_assistant_loss": loss,
        "straddling_pct": float(cut.group(1)) if cut else 0.0,
        "fill_pct": float(fill.group(1)) if fill else 100.0,
        "tokens_per_s": median([w["tokens_per_s"] for w in windows]),
        "trained_tokens_per_s": median([w["trained_tokens_per_s"] for w in windows]),
        "final_train_loss": last_loss(windows),
    }


def main(argv: list[str] | None = None) -> int:
    parser = bench_arg_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="the fine-tunes' --seed (data order; the base is seed 0)")
    args = parser.parse_args(argv)
    p = QUICK if args.quick else FULL
    runs: dict[str, dict[str, Any]] = {}
    with work_folder(args, "bench_chat_packing_") as work:
        dataset, model = make_inputs(work, p["base_steps"])
        for seq in p["seqs"]:
            for packing in ("stream", "whole"):
                runs[f"{packing} {seq}"] = fine_tune(work, dataset, model, packing, seq, p["steps"], args.seed)
                print(f"  {packing} at {seq}: {runs[f'{packing} {seq}']}", flush=True)
    rows, ratios = [], {}
    for key, r in runs.items():
        rows.append([key, r["held_out_assistant_loss"], r["straddling_pct"], r["fill_pct"], r["tokens_per_s"],
                     r["trained_tokens_per_s"]])  # fmt: skip
    for seq in p["seqs"]:
        whole, stream = runs[f"whole {seq}"], runs[f"stream {seq}"]
        ratios[str(seq)] = {
            k: whole[k] / stream[k] for k in ("held_out_assistant_loss", "tokens_per_s", "trained_tokens_per_s")
        }
    headers = ["packing, seq", "held-out assistant loss", "conversations cut (%)", "positions used (%)", "tokens/s",
               "trained tokens/s"]  # fmt: skip
    print_table(headers, rows)
    for seq, r in ratios.items():
        print(
            f"seq {seq}: whole / stream held-out loss {r['held_out_assistant_loss']:.3f}, tokens/s "
            f"{r['tokens_per_s']:.2f}, trained tokens/s {r['trained_tokens_per_s']:.2f}"
        )
    write_results(args.results_dir, "chat_packing", {"machine": machine_info(), "params": {**p, "seed": args.seed}, "runs": runs,
                                                     "ratios": ratios})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
