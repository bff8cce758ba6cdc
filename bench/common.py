"""Helpers shared by the bench/ scripts: command line, interleaved repetitions, machine facts, the results
table and JSON, a generated corpus, model folders and a torchrun launcher.

Every benchmark reports a ratio against a baseline measured in the same run on the same machine, because the
machines these run on are shared and noisy: baseline and candidate repetitions alternate (ABBA order) and the
median of the repetitions is what is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
if str(REPO_ROOT) not in sys.path:  # so workers can import fsdp_train and tests.fsdp_helpers
    sys.path.insert(0, str(REPO_ROOT))
DEFAULT_RESULTS_DIR = BENCH_DIR / "results"


# --- Command line and results -----------------------------------------------------------------------------


def bench_arg_parser(description: str) -> argparse.ArgumentParser:
    """The flags every benchmark takes; each script adds its own."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few repetitions: proves it still runs")
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=DEFAULT_RESULTS_DIR,
        help="where <name>.json is written (default: %(default)s)",
    )
    parser.add_argument("--reps", type=int, default=0, help="repetitions per side (0 = the benchmark's default)")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="folder for generated data (default: a temporary folder, removed)"
    )
    return parser


def machine_info() -> dict[str, Any]:
    """What a reader needs to judge a figure: when, where, which versions, and how busy the machine was."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "load_avg_1m_at_start": os.getloadavg()[0],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "argv": sys.argv,
    }


def write_results(results_dir: Path, name: str, payload: dict[str, Any]) -> Path:
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    return path


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A markdown table, so it pastes into BENCHMARKS.md as it is."""

    def cell(value: Any) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += ["| " + " | ".join(v.ljust(w) for v, w in zip(row, widths)) + " |" for row in cells]
    return "\n".join(lines)


def print_table(headers: list[str], rows: list[list[Any]]) -> None:
    print(format_table(headers, rows))


# --- Interleaved repetitions --------------------------------------------------------------------------------


def interleaved(
    reps: int, sides: dict[str, Callable[[], Any]], summary: Callable[[Any], str] = str
) -> dict[str, list[Any]]:
    """Run every side `reps` times in ABBA order (A B, B A, A B, ...), so a slow spell of the shared
    machine lands on both sides rather than on one. Returns each side's results in run order;
    prints `summary(result)` after each run."""
    results: dict[str, list[Any]] = {name: [] for name in sides}
    names = list(sides)
    for rep in range(reps):
        for name in names if rep % 2 == 0 else reversed(names):
            results[name].append(sides[name]())
            print(f"  rep {rep + 1}/{reps} {name}: {summary(results[name][-1])}", flush=True)
    return results


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def drop_page_cache() -> bool:
    """Write dirty pages and drop the page cache, so a read is from the disk. Needs root; False if refused."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


# --- Generated inputs ---------------------------------------------------------------------------------------


def make_corpus(total_chars: int, seed: int = 0, mean_doc_chars: int = 3000) -> list[str]:
    """Pseudo-prose documents: words of a 30k-word synthetic vocabulary drawn with Zipf frequencies (as in
    natural text), capitalised sentences, commas and some numbers; document lengths are log-normal."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    letter_p = 1.0 / np.arange(1, 27) ** 0.8
    lengths = rng.integers(2, 11, size=30_000)
    vocab = ["".join(rng.choice(letters, size=n, p=letter_p / letter_p.sum())) for n in lengths]
    vocab[:20] = ["the", "of", "and", "to", "in", "a", "is", "that", "for", "it"] + [str(i) for i in range(10)]
    word_cdf = np.cumsum(1.0 / np.arange(1, len(vocab) + 1))
    word_cdf /= word_cdf[-1]
    docs, total = [], 0
    while total < total_chars:
        n_words = max(8, int(rng.lognormal(np.log(mean_doc_chars / 6.5), 0.8)))
        words = [vocab[i] for i in np.searchsorted(word_cdf, rng.random(n_words))]
        sentences, start = [], 0
        for end in np.cumsum(rng.integers(6, 25, size=n_words // 6 + 1)):
            chunk = words[start : min(end, n_words)]
            if not chunk:
                break
            if len(chunk) > 8:
                chunk[len(chunk) // 2] += ","
            sentences.append(chunk[0].capitalize() + " " + " ".join(chunk[1:]) + ".")
            start = end
        doc = " ".join(sentences)
        docs.append(doc)
        total += len(doc)
    return docs


def save_text_dataset(docs: list[str], folder: Path) -> Path:
    """A saved `datasets.Dataset` with a `text` column: the layout data_hf.py writes and fsdp_train.py reads."""
    import datasets

    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(folder))
    return folder


def make_llama_folder(
    folder: Path,
    texts: list[str],
    hidden: int,
    layers: int,
    vocab: int,
    max_positions: int = 2048,
    weights_dtype: str | None = None,
) -> Path:
    """A Llama model folder: a byte-level BPE tokenizer trained on `texts`, config.json, and with
    `weights_dtype` ("bfloat16", "float32") random weights as safetensors (else fsdp_train.py initialises
    from scratch)."""
    import torch
    import transformers as tf

    from tests.fsdp_helpers import train_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    train_tokenizer(folder, texts, vocab_size=vocab)
    tokenizer = tf.AutoTokenizer.from_pretrained(folder)
    config = tf.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=int(hidden * 8 / 3) // 64 * 64,  # Llama's SwiGLU width, rounded
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=max_positions,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    if weights_dtype:
        torch.manual_seed(0)
        tf.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, weights_dtype)).save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    return folder


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


# --- Launching ------------------------------------------------------------------------------------------------


class LaunchError(RuntimeError):
    """A torchrun launch that failed or ran past its time limit; `output` holds the end of its log."""

    def __init__(self, message: str, output: str):
        super().__init__(f"{message}:\n{output}")
        self.output = output


def torchrun(script: Path, args: list[str], nproc: int, timeout: float = 900) -> subprocess.CompletedProcess:
    """`torchrun --standalone` on CPU (gloo), one OpenMP thread per process so processes x threads = cores.
    Raises LaunchError when the run fails or hangs (then every process below it is killed), so a broken
    benchmark never reports a figure and a hung one never outlives the benchmark."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script)]
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    return run_launcher([*cmd, *args], env, timeout, script.name)


def multinode_launch(args: list[str], nnodes: int, nproc: int, rdzv_id: str, timeout: float = 900) -> Any:
    """fsdp_train.py on this node of an `nnodes`-node run through scripts/multinode_launch.sh (c10d rendezvous at
    MASTER_ADDR:MASTER_PORT from the environment): the same call must run on every node, with the same `rdzv_id`."""
    cmd = ["bash", str(REPO_ROOT / "scripts" / "multinode_launch.sh"), *args]
    env = {"NNODES": str(nnodes), "NPROC_PER_NODE": str(nproc), "RDZV_ID": rdzv_id, "PYTHON": sys.executable}
    env |= {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    return run_launcher(cmd, env, timeout, "fsdp_train.py")


def run_launcher(cmd: list[str], env: dict[str, str], timeout: float, name: str) -> subprocess.CompletedProcess:
    """Run a launcher command from the repository root with `env` added; LaunchError on failure or timeout."""
    from tests.fsdp_helpers import kill_tree

    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise LaunchError(f"{name} hung: killed after {timeout:.0f}s", (stdout + stderr)[-4000:]) from None
    if proc.returncode != 0:
        raise LaunchError(
            f"{name} exited {proc.returncode} after {time.perf_counter() - start:.0f}s", (stdout + stderr)[-4000:]
        )
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
