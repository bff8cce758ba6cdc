"""Tiny models, tokenizers and process helpers for the tests and benchmarks (like torch.testing); the trainer
never imports it.

One builder makes every model folder the tests and bench/ use: a byte-level BPE tokenizer trained on given texts,
a config of one of several architectures (tiny by default, any Llama-like size on request) and, on request, random
weights as safetensors. One command line launches `torchrun --standalone` on CPU, and one killer ends a launch with
every process below it. Nothing here imports torch at module level, so importing it costs nothing.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path
from typing import Any

# --- corpus and tokenizer -------------------------------------------------------------------------------------


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


def train_tokenizer(folder: Path, texts: list[str], vocab_size: int = 128) -> None:
    """A byte-level BPE tokenizer trained on `texts`, with <|eos|> as its end and padding token, saved to folder."""
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


# --- configs ----------------------------------------------------------------------------------------------------

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


def llama_sizes(hidden: int, layers: int, max_positions: int = 2048) -> dict[str, int]:
    """The decoder sizes of a Llama `hidden` wide and `layers` deep: SwiGLU width 8/3 x hidden rounded down to a
    multiple of 64, 64-wide heads; they replace DECODER's tiny ones in `tiny_config(..., sizes=...)`."""
    heads = max(1, hidden // 64)
    return dict(
        hidden_size=hidden,
        intermediate_size=int(hidden * 8 / 3) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
    )


def tiny_config(arch: str, vocab_size: int, eos_id: int, tied: bool = True, sizes: dict[str, Any] | None = None):
    """Tiny configs of several architectures; the trainer must handle each without code changes. `sizes`
    (e.g. llama_sizes()) replaces the tiny decoder sizes of a Llama-like family."""
    import transformers as tf

    common = dict(vocab_size=vocab_size, eos_token_id=eos_id, bos_token_id=eos_id, tie_word_embeddings=tied)
    if arch in LLAMA_LIKE:
        name, extra = LLAMA_LIKE[arch]
        return getattr(tf, name)(**{**DECODER, **(sizes or {})}, **extra, **common)
    if sizes:
        raise ValueError(f"sizes are for the Llama-like families, not {arch}")
    if arch == "gpt2":
        return tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128, **common)
    # GPT-NeoX and OPT: DECODER's sizes but their own names for the MLP width, and no grouped-query heads
    shared = {
        k: DECODER[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings")
    }
    if arch == "gpt_neox":
        return tf.GPTNeoXConfig(**shared, intermediate_size=64, **common)
    if arch == "opt":
        return tf.OPTConfig(**shared, ffn_dim=64, word_embed_proj_dim=32, pad_token_id=eos_id, **common)
    raise ValueError(arch)


# --- model folders ------------------------------------------------------------------------------------------------


def save_model(
    folder: Path,
    config,
    with_weights: bool = False,
    dtype: str = "float32",
    seed: int = 1234,
    fill_stored: bool = True,
) -> Path:
    """config.json alone (the trainer then initialises from scratch) or, `with_weights`, random weights of `dtype`
    as safetensors, initialised after torch.manual_seed(seed). With `fill_stored`, every floating state_dict entry
    that named_parameters() does not list gets fixed random values (values no loader computes itself): stored
    buffers, and also a tied lm_head.weight, so a tied model's shared embedding is overwritten too."""
    if not with_weights:
        config.save_pretrained(folder)
        return folder
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    if fill_stored:
        params = dict(model.named_parameters())
        for name, tensor in model.state_dict().items():
            if name not in params and tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=torch.Generator().manual_seed(7)))
    model.save_pretrained(folder)
    return folder


def make_model(
    folder: Path,
    arch: str = "llama",
    with_weights: bool = False,
    tied: bool = True,
    dtype: str = "float32",
    texts: list[str] | None = None,
    vocab_size: int = 128,
    sizes: dict[str, Any] | None = None,
    seed: int = 1234,
    fill_stored: bool = True,
) -> Path:
    """A model folder: a tokenizer trained on `texts` (default: arithmetic_documents()) with up to `vocab_size`
    tokens, a tiny config of `arch` (or one of `sizes`) and, `with_weights`, random `dtype` weights (save_model)."""
    from transformers import AutoTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    train_tokenizer(folder, texts or arithmetic_documents(), vocab_size=vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = tiny_config(arch, len(tokenizer), tokenizer.eos_token_id, tied, sizes=sizes)
    return save_model(folder, config, with_weights, dtype, seed, fill_stored)


# --- launching and ending processes ---------------------------------------------------------------------------


# torchrun's own main (torch.distributed.run), unchanged, ended as the tools end (exit_without_teardown: atexit
# handlers, flush, os._exit with its status): the launcher skips the interpreter's teardown with torch loaded,
# ~0.45 s of each of the suite's ~230 launches (2 cores, 2026-11-27). Output, signals, restarts and exit status are
# torchrun's; an exception it raises propagates as under torchrun itself.
TORCHRUN = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
from fsdp_lib.interrupts import exit_without_teardown
from torch.distributed.run import main
try:
    main()
except SystemExit as exc:
    exit_without_teardown(exc.code)
exit_without_teardown(0)
"""


def torchrun_command(script: Path | str, args: list[str], nproc: int = 2) -> list[str]:
    """`torchrun --standalone` of `script` with `nproc` processes, through this interpreter (TORCHRUN above)."""
    return [sys.executable, "-c", TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", str(script), *args]


def launch_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a launch on CPU: one OpenMP thread per process (processes x threads =
    cores), unbuffered output, then `extra`."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(extra or {})}


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


def worker_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of the training process of global `rank` below a torchrun launcher, or None (not started yet)."""
    for pid in descendants(launcher_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"torch.distributed.run" not in cmdline:
            return pid
    return None
