"""Builders and launchers shared by the fsdp_train tests: a learnable corpus, tiny models of several
architectures, and `torchrun --standalone` in a subprocess (gloo on CPU)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
TRAIN_SCRIPT = REPO_ROOT / "fsdp_train.py"

# Small, fast settings every trainer test starts from; tests add or override flags.
BASE_FLAGS = ["--seq-length", "32", "--lr", "3e-3", "--precision", "fp32", "--log-freq", "1", "--warmup-steps", "2"]


def trainer_args(experiment: str, dataset: Path, model: Path, save_dir: Path) -> list[str]:
    """The flags every trainer test passes: where the inputs are, where outputs go, and BASE_FLAGS."""
    return ["-e", experiment, "-d", str(dataset), "-m", str(model), "--save-dir", str(save_dir), *BASE_FLAGS]


def arithmetic_documents(n_docs: int = 160, seed: int = 0) -> list[str]:
    """A corpus a tiny model learns within a few dozen steps: templated sums."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        facts = []
        for _ in range(6):
            a, b = rng.randrange(10), rng.randrange(10)
            facts.append(f"{a} plus {b} is {a + b}.")
        docs.append(" ".join(facts))
    return docs


def make_dataset(path: Path, validation: bool = True, n_docs: int = 160) -> Path:
    import datasets

    docs = arithmetic_documents(n_docs)
    if validation:
        split = datasets.DatasetDict(
            {
                "train": datasets.Dataset.from_dict({"text": docs[:-16]}),
                "validation": datasets.Dataset.from_dict({"text": docs[-16:]}),
            }
        )
    else:
        split = datasets.Dataset.from_dict({"text": docs})
    split.save_to_disk(str(path))
    return path


def train_tokenizer(folder: Path, texts: list[str], vocab_size: int = 128) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|eos|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>", pad_token="<|eos|>").save_pretrained(folder)


# Tiny decoder settings shared by the Llama-like families; each entry adds what its family needs.
DECODER = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
LLAMA_LIKE = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "mistral": ("MistralConfig", {"sliding_window": 16}),  # shorter than --seq-length, so the window matters
    "gemma": ("GemmaConfig", {"head_dim": 8}),
    "gemma2": ("Gemma2Config", {"head_dim": 8, "sliding_window": 16}),
    "gemma3_text": ("Gemma3TextConfig", {"head_dim": 8, "sliding_window": 16}),
    "phi3": ("Phi3Config", {"pad_token_id": None}),  # its default pad id 32000 is outside a tiny vocab
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 32,
        },
    ),
    "olmoe": ("OlmoeConfig", {"num_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}),
    "glm4_moe": (  # layer 0 dense, layer 1 MoE with a stored router buffer (e_score_correction_bias)
        "Glm4MoeConfig",
        {
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "head_dim": 8,
        },
    ),
}


def tiny_config(arch: str, vocab_size: int, eos_id: int, tied: bool = True):
    """Tiny configs of several architectures; the trainer must handle each without code changes."""
    import transformers as tf

    common = dict(vocab_size=vocab_size, eos_token_id=eos_id, bos_token_id=eos_id, tie_word_embeddings=tied)
    if arch in LLAMA_LIKE:
        name, extra = LLAMA_LIKE[arch]
        return getattr(tf, name)(**DECODER, **extra, **common)
    if arch == "gpt2":
        return tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128, **common)
    if arch == "gpt_neox":
        return tf.GPTNeoXConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=128,
            **common,
        )
    if arch == "opt":
        return tf.OPTConfig(
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            word_embed_proj_dim=32,
            max_position_embeddings=128,
            pad_token_id=eos_id,
            **common,
        )
    raise ValueError(arch)


def make_model(
    folder: Path,
    arch: str = "llama",
    with_weights: bool = False,
    tied: bool = True,
    dtype: str = "float32",
    texts: list[str] | None = None,
) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    train_tokenizer(folder, texts or arithmetic_documents())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = tiny_config(arch, len(tokenizer), tokenizer.eos_token_id, tied)
    if with_weights:
        torch.manual_seed(1234)
        model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
        params = dict(model.named_parameters())
        for name, tensor in model.state_dict().items():  # stored buffers get values no loader computes itself
            if name not in params and tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=torch.Generator().manual_seed(7)))
        model.save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    return folder


def run_trainer(
    args: list[str],
    nproc: int = 2,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    background: bool = False,
    cwd: Path = REPO_ROOT,
    script: Path = TRAIN_SCRIPT,
):
    """torchrun --standalone of fsdp_train.py (or a worker script that wraps it) with these flags."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(script),
        *args,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
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


def descendants(pid: int) -> list[int]:
    """All processes below pid (torchrun puts its workers in their own sessions, so killpg misses them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int, sig: int) -> None:
    """Signal pid and every process below it at once, like a node losing power (SIGKILL)."""
    for target in [pid, *descendants(pid)]:
        try:
            os.kill(target, sig)
        except ProcessLookupError:
            pass


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
    import datasets

    conversations = arithmetic_conversations(n, system=system)
    if validation:
        data = datasets.DatasetDict(
            {
                "train": datasets.Dataset.from_dict({"messages": conversations[:-12]}),
                "validation": datasets.Dataset.from_dict({"messages": conversations[-12:]}),
            }
        )
    else:
        data = datasets.Dataset.from_dict({"messages": conversations})
    data.save_to_disk(str(path))
    return path


def make_chat_model(folder: Path, template: str | None = "llama3", with_weights: bool = False) -> Path:
    """A tiny Llama whose tokenizer knows the special tokens of the fixture templates; `template` (a file name
    under tests/fixtures/chat_templates, without .jinja) becomes its chat template, None leaves it without one."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    texts = [" ".join(t["content"] for t in c) for c in arithmetic_conversations(60)] + arithmetic_documents(40)
    folder.mkdir(parents=True, exist_ok=True)
    train_tokenizer(folder, texts, vocab_size=160)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"bos_token": "<|bos|>", "additional_special_tokens": CHAT_SPECIAL_TOKENS[1:]})
    if template:
        tokenizer.chat_template = (CHAT_TEMPLATES / f"{template}.jinja").read_text()
    tokenizer.save_pretrained(folder)
    config = tiny_config("llama", len(tokenizer), tokenizer.eos_token_id)
    if with_weights:
        torch.manual_seed(1234)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    return folder
