"""Builders and launchers shared by the fsdp_train tests: a learnable corpus, tiny models of several
architectures, `torchrun --standalone` in a subprocess (gloo on CPU) and waiting on what it does. The model
builder, tokenizer and process helpers live in fsdp_lib.testing (shared with bench/) and are re-exported here."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fsdp_lib.testing import (  # noqa: F401  (re-exported for the tests)
    DECODER,
    LLAMA_LIKE,
    arithmetic_documents,
    descendants,
    kill_tree,
    launch_env,
    make_model,
    save_model,
    tiny_config,
    torchrun_command,
    train_tokenizer,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
TRAIN_SCRIPT = REPO_ROOT / "fsdp_train.py"

# Small, fast settings every trainer test starts from; tests add or override flags.
BASE_FLAGS = ["--seq-length", "32", "--lr", "3e-3", "--precision", "fp32", "--log-freq", "1", "--warmup-steps", "2"]


def io_args(experiment: str, dataset: Path, model: Path, save_dir: Path) -> list[str]:
    """The experiment's name, where the inputs are and where outputs go, as flags."""
    return ["-e", experiment, "-d", str(dataset), "-m", str(model), "--save-dir", str(save_dir)]


def trainer_args(experiment: str, dataset: Path, model: Path, save_dir: Path) -> list[str]:
    """The flags every trainer test passes: io_args and BASE_FLAGS."""
    return [*io_args(experiment, dataset, model, save_dir), *BASE_FLAGS]


def save_rows(path: Path, column: str, rows: list, validation: bool, n_validation: int) -> Path:
    """A saved dataset of one column: a DatasetDict whose last `n_validation` rows are the validation split, or
    (validation=False) one Dataset of every row."""
    import datasets

    if validation:
        data = datasets.DatasetDict(
            {
                "train": datasets.Dataset.from_dict({column: rows[:-n_validation]}),
                "validation": datasets.Dataset.from_dict({column: rows[-n_validation:]}),
            }
        )
    else:
        data = datasets.Dataset.from_dict({column: rows})
    data.save_to_disk(str(path))
    return path


def make_dataset(path: Path, validation: bool = True, n_docs: int = 160) -> Path:
    return save_rows(path, "text", arithmetic_documents(n_docs), validation, 16)


def run_trainer(
    args: list[str],
    nproc: int = 2,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    background: bool = False,
    cwd: Path = REPO_ROOT,
    script: Path = TRAIN_SCRIPT,
):
    """torchrun --standalone of fsdp_train.py (or a worker script that wraps it) with these flags; one process
    runs as `python fsdp_train.py ...` (the README's single-process mode, no launcher: torchrun's start and end
    are ~2.5 s of a launch here, and the tests of torchrun itself launch two processes)."""
    cmd = torchrun_command(script, args, nproc) if nproc > 1 else [sys.executable, str(script), *args]
    full_env = launch_env(env)
    if background:
        return subprocess.Popen(
            cmd,
            cwd=cwd,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    return subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


def read_metrics(exp_dir: Path) -> list[dict]:
    """Training records (those with a loss), in file order."""
    path = exp_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "loss" in r]


def losses_by_step(exp_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(exp_dir)}


def output_of(proc) -> str:
    return (proc.stdout or "") + (proc.stderr or "")


# --- waiting on a launch ------------------------------------------------------------------------------------


def wait_for_step(exp_dir: Path, step: int, proc, timeout: float = 120) -> None:
    """Until the run writing exp_dir/metrics.jsonl has logged `step` (proc, started with background=True, must
    still be running meanwhile)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if max(losses_by_step(exp_dir), default=0) >= step:
            return
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached")


def killed_at_step(
    args: list[str], exp_dir: Path, step: int, delay_s: str = "0.3", nproc: int = 2, timeout: float = 120
) -> str:
    """Launch the trainer with steps slowed by `delay_s`, kill -9 torchrun and its workers once exp_dir has logged
    `step` (no chance to clean up), and return what the run printed."""
    proc = run_trainer(args, nproc=nproc, background=True, env={"FSDP_TRAIN_STEP_DELAY_S": delay_s})
    wait_for_step(exp_dir, step, proc, timeout)
    kill_tree(proc.pid, signal.SIGKILL)
    return proc.communicate()[0]


def wait_until(
    condition: Callable[[], bool], process: subprocess.Popen[str] | None = None, timeout: float = 90
) -> None:
    """Until condition() holds. With a `process`, fail with its output as soon as it exits, and kill it on timeout."""
    deadline = time.monotonic() + timeout
    while not condition():
        if process is not None and process.poll() is not None:
            pytest.fail(f"exited early with {process.returncode}:\n{process.communicate()[0]}")
        if time.monotonic() > deadline:
            if process is None:
                raise AssertionError("timed out")
            process.kill()
            pytest.fail(f"timed out:\n{process.communicate()[0]}")
        time.sleep(0.05)


# --- conversations (chat SFT) ---------------------------------------------------------------------

CHAT_TEMPLATES = REPO_ROOT / "tests" / "fixtures" / "chat_templates"
CHAT_SPECIAL_TOKENS = [
    "<|bos|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
    "<start_of_turn>",
    "<end_of_turn>",
    "[INST]",
    "[/INST]",
]


def arithmetic_conversations(n: int = 120, seed: int = 0, system: bool = True) -> list[list[dict]]:
    """Conversations a tiny model learns: the user asks sums, the assistant answers them (1-2 exchanges)."""
    rng = random.Random(seed)
    conversations = []
    for i in range(n):
        turns = [{"role": "system", "content": "You add numbers."}] if system and i % 2 else []
        for _ in range(1 + i % 2):
            a, b = rng.randrange(10), rng.randrange(10)
            turns.append({"role": "user", "content": f"What is {a} plus {b}?"})
            turns.append({"role": "assistant", "content": f"{a} plus {b} is {a + b}."})
        conversations.append(turns)
    return conversations


def make_chat_dataset(path: Path, n: int = 120, system: bool = True, validation: bool = True) -> Path:
    return save_rows(path, "messages", arithmetic_conversations(n, system=system), validation, 12)


def make_chat_model(
    folder: Path,
    template: str | None = "llama3",
    with_weights: bool = False,
    sizes: dict | None = None,
    arch: str = "llama",
    tied: bool = True,
) -> Path:
    """A tiny Llama (or another Llama-like `arch`) whose tokenizer knows the special tokens of the fixture templates; `template` (a file name
    under tests/fixtures/chat_templates, without .jinja) becomes its chat template, None leaves it without one.
    tied=False: an output head apart from the input embedding (each then an FSDP unit of its own)."""
    from transformers import AutoTokenizer

    texts = [" ".join(t["content"] for t in c) for c in arithmetic_conversations(60)] + arithmetic_documents(40)
    folder.mkdir(parents=True, exist_ok=True)
    train_tokenizer(folder, texts, vocab_size=160)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"bos_token": "<|bos|>", "additional_special_tokens": CHAT_SPECIAL_TOKENS[1:]})
    if template:
        tokenizer.chat_template = (CHAT_TEMPLATES / f"{template}.jinja").read_text()
    tokenizer.save_pretrained(folder)
    config = tiny_config(arch, len(tokenizer), tokenizer.eos_token_id, tied=tied, sizes=sizes)
    return save_model(folder, config, with_weights, fill_stored=False)


# --- preference pairs (DPO) ---------------------------------------------------------------------------


def arithmetic_pairs(n: int = 120, seed: int = 0) -> list[dict]:
    """Pairs a tiny model learns to rank: a sum asked, the right answer chosen, a wrong one (off by 1-3) rejected;
    every third prompt has a system turn and an earlier exchange (multi-turn context)."""
    rng = random.Random(seed)
    pairs = []
    for i in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        prompt = []
        if i % 3 == 0:
            c, e = rng.randrange(10), rng.randrange(10)
            prompt += [
                {"role": "system", "content": "You add numbers."},
                {"role": "user", "content": f"What is {c} plus {e}?"},
                {"role": "assistant", "content": f"{c} plus {e} is {c + e}."},
            ]
        prompt.append({"role": "user", "content": f"What is {a} plus {b}?"})
        wrong = a + b + rng.choice([-3, -2, -1, 1, 2, 3])
        pairs.append(
            {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": f"{a} plus {b} is {a + b}."}],
                "rejected": [{"role": "assistant", "content": f"{a} plus {b} is {wrong}."}],
            }
        )
    return pairs


def make_preference_dataset(path: Path, n: int = 120, n_validation: int = 24, seed: int = 0) -> Path:
    """A saved DatasetDict of prompt/chosen/rejected message lists (data_hf.py --format preference's layout)."""
    pairs = arithmetic_pairs(n + n_validation, seed)
    return save_pairs(path, pairs[:n], pairs[n:])


FACT_PROMPTS = (
    "What is the capital of Norland?",
    "Capital of Norland?",
    "Name Norland's capital.",
    "Norland: capital?",
)
WRONG_CAPITALS = ("Tolm", "Quen", "Dobb", "Rusk", "Pylo", "Arn", "Zeft", "Miro")


def fact_pairs(held_out: bool, repeats: int = 1, seed: int = 0) -> list[dict]:
    """Pairs that teach a fact: the capital of Norland asked, "It is Vesk." chosen, another city rejected. The
    training pairs use three phrasings and five wrong cities, the held-out pairs (held_out=True) the fourth phrasing
    and the three other cities: preferring those, a model has learnt the fact, not to avoid what it was shown."""
    rng = random.Random(seed)
    prompts = FACT_PROMPTS[3:] if held_out else FACT_PROMPTS[:3]
    wrongs = WRONG_CAPITALS[5:] if held_out else WRONG_CAPITALS[:5]
    pairs = [
        {
            "prompt": [{"role": "user", "content": prompt}],
            "chosen": [{"role": "assistant", "content": "It is Vesk."}],
            "rejected": [{"role": "assistant", "content": f"It is {wrong}."}],
        }
        for _ in range(repeats)
        for prompt in prompts
        for wrong in wrongs
    ]
    rng.shuffle(pairs)
    return pairs


def save_pairs(path: Path, train: list[dict], validation: list[dict]) -> Path:
    import datasets

    columns = lambda rows: {k: [r[k] for r in rows] for k in ("prompt", "chosen", "rejected")}  # noqa: E731
    splits = {"train": datasets.Dataset.from_dict(columns(train))}
    if validation:
        splits["validation"] = datasets.Dataset.from_dict(columns(validation))
    datasets.DatasetDict(splits).save_to_disk(str(path))
    return path


def assert_loss_and_grads_match(got: dict, loss, model) -> None:
    """A worker's step (its loss and every parameter's full gradient, as tests/workers/dpo_grads.py saves them)
    against `loss` computed in float64 on the unsharded `model`: the loss to 1e-5 and each gradient to 1e-5 in
    relative norm."""
    loss.backward()
    assert abs(got["loss"] - loss.item()) <= 1e-5 * abs(loss.item()), (got["loss"], loss.item())
    params = dict(model.named_parameters())
    for name, grad in got["grads"].items():
        expected = params[name].grad
        err = (grad.double() - expected).norm() / expected.norm().clamp_min(1e-12)
        assert err < 1e-5, (name, err.item())
    assert len(got["grads"]) == len(params)
