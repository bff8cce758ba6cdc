"""fsdp_train.py: fine-tune any Hugging Face causal LM with PyTorch FSDP2, offline, in one command.

CPU smoke run (gloo, two processes, a tiny model from `model_download.py --init tiny`):

    torchrun --standalone --nproc_per_node 2 fsdp_train.py -e smoke -d hf_datasets/demo -m models/tiny \
        --precision fp32 --seq-length 128 -b 4 --max-steps 50 --log-freq 5

Multi-GPU run (nccl, bf16 compute with fp32 master weights, activation checkpointing):

    torchrun --standalone --nproc_per_node 8 fsdp_train.py -e llama3b-sft -d hf_datasets/my_corpus \
        -m meta-llama/Llama-3.2-3B-Instruct --precision bf16 -b 2 --seq-length 2048 --lr 2e-5 --num-epochs 3

A dataset with a `messages` column (`data_hf.py --format chat`) trains as chat SFT: rendered with the tokenizer's
chat template (or --chat-template FILE), loss on the assistant turns only (--loss-on all for every token).

Rerunning the same command resumes from the newest complete checkpoint in `outputs/EXP/checkpoint/`, also on
another number of GPUs (with --global-batch-size the accumulation adapts).
Sections below follow the data flow: Config, Distributed, Data, Model and sharding, Checkpoints,
Metrics, Train step, main().
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import datetime as dt
import hashlib
import json
import math
import mmap
import os
import random
import re
import shutil
import signal
import socket
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
import yaml

# -----------------------------------------------------------------------------------------------
# Config
# -----------------------------------------------------------------------------------------------

ON_OFF = ("on", "off")


def _opt(default: Any, help: str, choices: tuple[str, ...] | None = None, short: str | None = None) -> Any:
    """A dataclass field whose metadata drives argparse (one declaration, one help text)."""
    return field(default=default, metadata={"help": help, "choices": choices, "short": short})


@dataclass
class TrainConfig:
    """Every setting of a run. YAML keys (--config) are these names, with dashes or underscores."""

    experiment_name: str = _opt("", "folder name under --save-dir for checkpoints, metrics and export", short="-e")
    dataset_name: str = _opt(
        "",
        "folder written by data_hf.py (Dataset or DatasetDict with train/validation), or a hub dataset ORG/NAME "
        "already in the offline cache (model_download.py --dataset ORG/NAME)",
        short="-d",
    )
    text_column: str = _opt("", "use this column of the dataset as the text (default: 'text' or 'messages')")
    model_name: str = _opt("", "local model folder, or a hub id already in the offline cache (HF_HOME)", short="-m")
    save_dir: str = _opt("outputs", "root folder for experiments")
    seed: int = _opt(0, "seed for data order, initialisation and dropout")
    num_epochs: int = _opt(1, "passes over the packed training blocks")
    max_steps: int = _opt(0, "stop after this many optimizer steps in total (0 = run all epochs)")
    lr: float = _opt(3e-5, "peak AdamW learning rate")
    min_lr: float = _opt(0.0, "learning rate at the end of the schedule")
    warmup_steps: int = _opt(0, "linear warmup steps from 0 to --lr")
    lr_schedule: str = _opt("cosine", "decay after warmup", choices=("cosine", "linear", "constant"))
    weight_decay: float = _opt(0.0, "AdamW weight decay (never applied to norms and biases)")
    grad_clip: float = _opt(1.0, "clip the global gradient norm to this value (0 = no clipping)")
    batch_size: int = _opt(1, "sequences per process per micro-batch", short="-b")
    grad_accum_steps: int = _opt(1, "micro-batches per optimizer step")
    global_batch_size: int = _opt(
        0, "sequences per optimizer step over all processes; sets --grad-accum-steps to N / (processes x -b) (0 = off)"
    )
    data_slice: str = _opt("", "train on rows START:END of the train split (either may be empty), e.g. 0:50000")
    seq_length: int = _opt(1024, "tokens per packed training block")
    document_masking: str = _opt(
        "on", "packed documents never attend to each other (position ids restart per document)", choices=ON_OFF
    )
    loss_on: str = _opt(
        "assistant",
        "conversation data (a 'messages' column): train on the assistant turns only, or on every token; "
        "text data always trains on every token",
        choices=("assistant", "all"),
    )
    chat_template: str = _opt("", "Jinja chat template file, for a tokenizer without one (conversation data)")
    loss_chunk_tokens: int = _opt(
        1024, "tokens per chunk of the output head + loss, so full [tokens x vocab] logits never exist (0 = full)"
    )
    precision: str = _opt(
        "auto", "compute dtype; auto = bf16 on CUDA, fp32 on CPU", choices=("auto", "bf16", "fp16", "fp32")
    )
    sharding: str = _opt(
        "full",
        "full = reshard after forward (ZeRO-3); grad-op = keep gathered until backward (ZeRO-2); "
        "hybrid = shard within a node, replicate across nodes; none = replicate (DDP-like)",
        choices=("full", "grad-op", "hybrid", "none"),
    )
    hybrid_shard_size: int = _opt(0, "processes per shard group for --sharding hybrid (0 = processes per node)")
    cpu_offload: str = _opt(
        "off", "keep parameter shards, gradients and optimizer state in host memory", choices=ON_OFF
    )
    activation_checkpointing: str = _opt("on", "recompute decoder-layer activations in backward", choices=ON_OFF)
    ac_every_n_layers: int = _opt(1, "with activation checkpointing: checkpoint every Nth decoder layer (1 = all)")
    compile: str = _opt("off", "torch.compile each decoder layer", choices=ON_OFF)
    accum_grad_sync: str = _opt(
        "per-micro-batch",
        "with --grad-accum-steps > 1: reduce-scatter gradients after every micro-batch (sharded gradient memory), "
        "or only after the last (one reduce-scatter per step, but unsharded gradients held across micro-batches)",
        choices=("per-micro-batch", "last"),
    )
    attn_implementation: str = _opt(
        "auto",
        "attention kernel; auto = flash_attention_2 on a GPU with document masking when installed, else sdpa where "
        "the architecture supports it, else eager",
        choices=("auto", "sdpa", "eager", "flash_attention_2", "flex_attention"),
    )
    log_freq: int = _opt(10, "optimizer steps between metric lines")
    ckpt_freq: int = _opt(500, "optimizer steps between checkpoints (0 = only at the end)")
    eval_freq: int = _opt(0, "optimizer steps between validation passes (0 = only at the end)")
    eval_max_blocks: int = _opt(0, "cap on validation blocks per pass (0 = all)")
    eval_at_start: str = _opt(
        "on", "evaluate the base model before the first step (step 0); not on resume", choices=ON_OFF
    )
    keep_last: int = _opt(3, "complete checkpoints to keep (the newest is never deleted)")
    async_ckpt: str = _opt("off", "write checkpoints in the background while training continues", choices=ON_OFF)
    tensorboard: str = _opt("off", "also write TensorBoard event files to outputs/EXP/tensorboard", choices=ON_OFF)
    wandb: str = _opt(
        "off",
        "also log to Weights & Biases, offline unless WANDB_MODE says otherwise (files in outputs/EXP/wandb)",
        choices=ON_OFF,
    )
    peak_tflops: float = _opt(0.0, "accelerator peak TFLOP/s per GPU for MFU (0 = built-in table)")
    max_bad_steps: int = _opt(25, "stop after this many consecutive steps with a non-finite loss or gradient")
    collective_timeout_s: int = _opt(1800, "timeout of collectives (checkpoint agreement, tokenisation wait)")
    force_resume: bool = _opt(False, "resume even if model/data/batch/seed/tokenizer changed since the checkpoint")
    export_dtype: str = _opt(
        "auto",
        "dtype of the exported model (auto = the model's original dtype)",
        choices=("auto", "bf16", "fp16", "fp32"),
    )
    export_only: bool = _opt(False, "export outputs/EXP/final from the newest checkpoint and exit")
    dry_run: bool = _opt(False, "print the resolved config, model size, sharding plan and memory estimate; exit")

    @property
    def experiment_dir(self) -> Path:
        return Path(self.save_dir) / self.experiment_name


# Settings that change the math or the data: a resume with a different value is refused.
RESUME_PINNED = ("model", "dataset", "seq_length", "global_batch_size", "seed", "tokenizer", "data_format")


class _ArgParser(argparse.ArgumentParser):
    """Bad flags raise ConfigError (reported once, by rank 0, like every other config problem); --help is
    printed by rank 0 only, not once per process."""

    def error(self, message: str) -> Any:
        raise ConfigError([f"{message} (see {self.prog} --help)"])

    def _print_message(self, message: str, file: Any = None) -> None:
        if int(os.environ.get("RANK", "0")) == 0:
            super()._print_message(message, file)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """One spelling per flag: `-e, --experiment-name NAME`; the --snake_case aliases are only mentioned once."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings or action.nargs == 0:
            names = [o for o in action.option_strings if "_" not in o]
            return ", ".join(names) or super()._format_action_invocation(action)
        names = [o for o in action.option_strings if "_" not in o]
        return ", ".join(names) + " " + self._format_args(action, self._get_default_metavar_for_optional(action))


REQUIRED_FLAGS = ("experiment_name", "dataset_name", "model_name")


def build_arg_parser() -> argparse.ArgumentParser:
    parser = _ArgParser(
        prog="fsdp_train.py",
        usage="torchrun [...] %(prog)s -e EXPERIMENT_NAME -d DATASET_NAME -m MODEL_NAME [options]",
        description="FSDP2 fine-tuning of Hugging Face causal LMs. Launch with torchrun. Every --flag-name is "
        "also accepted as --flag_name; abbreviations are not.",
        formatter_class=_HelpFormatter,
        argument_default=argparse.SUPPRESS,  # so we can tell flags given on the command line from defaults
        allow_abbrev=False,  # --max-step must not silently mean --max-steps
    )
    required = parser.add_argument_group("required (on the command line or in --config)")
    parser.add_argument("--config", help="YAML file whose keys are flag names; the command line overrides it")
    for f in dataclasses.fields(TrainConfig):
        names = list(dict.fromkeys([f"--{f.name.replace('_', '-')}", f"--{f.name}"]))
        if f.metadata.get("short"):
            names.insert(0, f.metadata["short"])
        group = required if f.name in REQUIRED_FLAGS else parser
        help_text = f.metadata["help"] + ("" if f.name in REQUIRED_FLAGS else f" (default: {f.default})")
        if f.type in ("bool", bool):
            group.add_argument(*names, dest=f.name, action="store_true", help=help_text)
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            group.add_argument(*names, dest=f.name, type=kind, choices=f.metadata.get("choices"), help=help_text)
    return parser


def _normalise_yaml_value(name: str, value: Any, errors: list[str], source: str) -> Any:
    """YAML 1.1 reads on/off as booleans; map them back, and check types of the file's values."""
    f = {x.name: x for x in dataclasses.fields(TrainConfig)}[name]
    if f.metadata.get("choices") == ON_OFF and isinstance(value, bool):
        return "on" if value else "off"
    expected = {"int": int, "float": (int, float), "bool": bool, "str": (str, int, float)}[str(f.type)]
    if not isinstance(value, expected) or (str(f.type) == "int" and isinstance(value, bool)):
        errors.append(f"{source}: key '{name}' has value {value!r}; expected {str(f.type)}")
        return f.default
    if str(f.type) == "float":
        return float(value)
    if str(f.type) == "str":
        return str(value)
    return value


def load_config(argv: list[str] | None) -> TrainConfig:
    """Defaults < YAML file < command line. Raises ConfigError listing every problem."""
    args = vars(build_arg_parser().parse_args(argv))
    values: dict[str, Any] = {}
    errors: list[str] = []
    config_file = args.pop("config", None)
    if config_file:
        path = Path(config_file)
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError([f"--config {config_file}: cannot read it as YAML ({exc})"]) from exc
        if not isinstance(loaded, dict):
            raise ConfigError([f"--config {config_file}: expected a mapping of flag names to values"])
        known = {f.name for f in dataclasses.fields(TrainConfig)}
        for key, value in loaded.items():
            name = str(key).replace("-", "_")
            if name not in known:
                errors.append(f"--config {config_file}: unknown key '{key}' (keys are the flag names, e.g. seq-length)")
                continue
            values[name] = _normalise_yaml_value(name, value, errors, f"--config {config_file}")
    values.update(args)
    if errors:
        raise ConfigError(errors)
    return TrainConfig(**values)


class TrainError(RuntimeError):
    """A problem the user can fix; reported as one clear message without a traceback."""


class ConfigError(ValueError):
    """Every problem with the flags, reported together."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


def validate_config(cfg: TrainConfig, world_size: int) -> list[str]:
    """Check everything that can be checked before any process group or model exists."""
    problems: list[str] = []
    for flag, value in (
        ("--experiment-name/-e", cfg.experiment_name),
        ("--dataset-name/-d", cfg.dataset_name),
        ("--model-name/-m", cfg.model_name),
    ):
        if not value:
            problems.append(f"{flag} is required")
    if cfg.experiment_name and (os.sep in cfg.experiment_name or cfg.experiment_name in (".", "..")):
        problems.append(f"--experiment-name '{cfg.experiment_name}' must be a plain folder name, not a path")
    positive = {
        "--num-epochs": cfg.num_epochs,
        "--batch-size": cfg.batch_size,
        "--grad-accum-steps": cfg.grad_accum_steps,
        "--seq-length": cfg.seq_length,
        "--log-freq": cfg.log_freq,
        "--keep-last": cfg.keep_last,
        "--ac-every-n-layers": cfg.ac_every_n_layers,
        "--max-bad-steps": cfg.max_bad_steps,
        "--collective-timeout-s": cfg.collective_timeout_s,
    }
    problems += [f"{flag} must be at least 1 (got {value})" for flag, value in positive.items() if value < 1]
    non_negative = {
        "--max-steps": cfg.max_steps,
        "--loss-chunk-tokens": cfg.loss_chunk_tokens,
        "--warmup-steps": cfg.warmup_steps,
        "--ckpt-freq": cfg.ckpt_freq,
        "--eval-freq": cfg.eval_freq,
        "--eval-max-blocks": cfg.eval_max_blocks,
        "--weight-decay": cfg.weight_decay,
        "--grad-clip": cfg.grad_clip,
        "--min-lr": cfg.min_lr,
        "--peak-tflops": cfg.peak_tflops,
        "--hybrid-shard-size": cfg.hybrid_shard_size,
        "--global-batch-size": cfg.global_batch_size,
    }
    problems += [f"{flag} must not be negative (got {value})" for flag, value in non_negative.items() if value < 0]
    for f in dataclasses.fields(TrainConfig):  # argparse checks choices on the command line; this covers --config
        choices = f.metadata.get("choices")
        if choices and getattr(cfg, f.name) not in choices:
            flag = "--" + f.name.replace("_", "-")
            problems.append(f"{flag} {getattr(cfg, f.name)!r} is not one of {', '.join(choices)}")
    if not cfg.lr > 0 or not math.isfinite(cfg.lr):
        problems.append(f"--lr must be a positive number (got {cfg.lr})")
    elif cfg.min_lr > cfg.lr:
        problems.append(f"--min-lr {cfg.min_lr} is above --lr {cfg.lr}; lower --min-lr")
    if cfg.precision == "fp16" and not torch.cuda.is_available():
        problems.append(
            "--precision fp16 needs a CUDA GPU (CPU fp16 kernels are slow and incomplete); use fp32 or bf16"
        )
    if cfg.sharding == "hybrid":
        shard = cfg.hybrid_shard_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if shard < 1 or world_size % shard:
            problems.append(
                f"--sharding hybrid: world size {world_size} is not a multiple of the shard group size "
                f"{shard}; set --hybrid-shard-size to a divisor of {world_size}"
            )
    problems += _batch_problems(cfg, world_size)
    if cfg.data_slice and parse_data_slice(cfg.data_slice) is None:
        problems.append(
            f"--data-slice {cfg.data_slice!r}: expected START:END with whole numbers, e.g. 0:50000 or 1000:"
        )
    if cfg.wandb == "on":
        problems += _wandb_problems()
    if cfg.chat_template and not Path(cfg.chat_template).is_file():
        problems.append(f"--chat-template {cfg.chat_template}: no such file (a Jinja chat template)")
    if cfg.dataset_name:
        problems += _dataset_problems(cfg.dataset_name)
    if cfg.model_name:
        problems += _model_problems(cfg)
    return problems


def _batch_problems(cfg: TrainConfig, world_size: int) -> list[str]:
    """--global-batch-size must split evenly over the processes and micro-batches; then it sets the accumulation."""
    if cfg.global_batch_size <= 0 or cfg.batch_size < 1:
        return []
    per_step = world_size * cfg.batch_size
    accum, rest = divmod(cfg.global_batch_size, per_step)
    if rest or accum < 1:
        return [
            f"--global-batch-size {cfg.global_batch_size} is not a multiple of processes x --batch-size "
            f"({world_size} x {cfg.batch_size} = {per_step}); choose a multiple of {per_step} or change -b"
        ]
    if cfg.grad_accum_steps not in (1, accum):
        return [
            f"--grad-accum-steps {cfg.grad_accum_steps} contradicts --global-batch-size {cfg.global_batch_size} "
            f"({world_size} processes x -b {cfg.batch_size} needs {accum}); pass only one of them"
        ]
    cfg.grad_accum_steps = accum
    return []


def _wandb_problems() -> list[str]:
    """wandb is optional: a missing (or broken) install is a flag problem, not a traceback on rank 0 later."""
    try:
        import wandb  # noqa: F401
    except ImportError as exc:
        return [f"--wandb on needs the wandb package ({exc}); pip install wandb, or leave --wandb off"]
    return []


def parse_data_slice(text: str) -> tuple[int, int | None] | None:
    """'START:END' -> (start, end or None); None when malformed."""
    start, sep, end = text.partition(":")
    if not sep or not all(part.strip().isdigit() for part in (start, end) if part.strip()):
        return None
    return int(start or 0), (int(end) if end.strip() else None)


def _dataset_problems(name: str) -> list[str]:
    from data_hf import hub_dataset_snapshot, is_hub_dataset_id

    if is_hub_dataset_id(name):  # resolved from the HF_HOME cache only, never the network
        try:
            hub_dataset_snapshot(name)
        except ValueError as exc:
            return [f"--dataset-name/-d {exc}"]
        return []
    path = Path(name)
    if not path.is_dir():
        return [f"--dataset-name {path}: no such folder; create it with data_hf.py --save_dir {path}"]
    if not any((path / marker).exists() for marker in ("dataset_dict.json", "dataset_info.json", "state.json")):
        return [f"--dataset-name {path}: not a dataset written by data_hf.py (no dataset_dict.json or state.json)"]
    return []


def _model_problems(cfg: TrainConfig) -> list[str]:
    try:
        model_dir = resolve_model_dir(cfg.model_name)
    except FileNotFoundError as exc:
        return [str(exc)]
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a bad config
        return [f"--model-name {cfg.model_name}: cannot read config.json in {model_dir} ({exc})"]
    max_positions = getattr(config, "max_position_embeddings", None)
    if max_positions and cfg.seq_length > max_positions:
        return [
            f"--seq-length {cfg.seq_length} exceeds the model's max_position_embeddings {max_positions}; "
            f"lower --seq-length"
        ]
    return []


def resolve_model_dir(model_name: str) -> Path:
    """A local folder, or a hub id resolved from the offline cache; never touches the network."""
    path = Path(model_name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"--model-name {model_name}: folder has no config.json")
        return path
    if path.exists():
        raise FileNotFoundError(f"--model-name {model_name}: not a folder")
    no_such_folder = (
        f"--model-name {model_name}: no such folder (relative to {Path.cwd()}); check the path, or give a hub id "
        f"as org/name"
    )
    if model_name.startswith((".", "~", "/")) or model_name.count("/") != 1:
        raise FileNotFoundError(no_such_folder)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model_name, local_files_only=True))
    except Exception as exc:  # noqa: BLE001 - LocalEntryNotFoundError and friends
        if path.parent.is_dir():  # e.g. models/typo while models/ exists: a mistyped folder, not a hub id
            raise FileNotFoundError(no_such_folder) from exc
        raise FileNotFoundError(
            f"--model-name {model_name}: not in the local cache (HF_HOME={os.environ.get('HF_HOME', '~/.cache/huggingface')}). "
            f"Run `python model_download.py --model-name {model_name}` on a machine with internet and copy HF_HOME here."
        ) from exc


def resolve_precision(cfg: TrainConfig) -> str:
    if cfg.precision != "auto":
        return cfg.precision
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"


# -----------------------------------------------------------------------------------------------
# Distributed
# -----------------------------------------------------------------------------------------------


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    mesh: Any  # DeviceMesh: 1-D ("shard",) or 2-D ("replicate", "shard")
    cpu_group: Any  # gloo group for host-side agreement (signals, checkpoint bookkeeping): never syncs the GPU
    async_ckpt_group: Any  # gloo group used only by background checkpoint writes (see Checkpointer.save)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_RANK_FOR_LOGS = int(os.environ.get("RANK", "0"))


def log(message: str, all_ranks: bool = False) -> None:
    """Every line carries a timestamp and the rank; by default only rank 0 prints."""
    if all_ranks or _RANK_FOR_LOGS == 0:
        stamp = dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        print(f"[{stamp}][rank{_RANK_FOR_LOGS}] {message}", flush=True)


def _ensure_launcher_env() -> None:
    """Allow `python fsdp_train.py ...` as a single process, as if launched by torchrun."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


def setup_distributed(cfg: TrainConfig) -> Dist:
    from torch.distributed.device_mesh import init_device_mesh

    _ensure_launcher_env()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    timeout = dt.timedelta(seconds=cfg.collective_timeout_s)
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    async_ckpt_group = dist.new_group(backend="gloo", timeout=timeout)
    if cfg.sharding in ("hybrid", "none"):
        shard = 1 if cfg.sharding == "none" else (cfg.hybrid_shard_size or local_world)
        mesh = init_device_mesh(device.type, (world // shard, shard), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    return Dist(rank, world, local_rank, local_world, device, mesh, cpu_group, async_ckpt_group)


def all_ranks_agree(flag: bool, d: Dist) -> bool:
    """True if any rank raised the flag. Runs on the gloo CPU group, so it never waits on the GPU."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=d.cpu_group)
    return bool(t.item())


def broadcast_object(obj: Any, d: Dist) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=d.cpu_group)
    return box[0]


def fault_point(name: str, d: Dist | None = None, step: int | None = None) -> None:
    """Fault injection for the crash-safety tests: FSDP_TRAIN_FAULT=name[@rank][:step], comma-separated.
    Names starting with "kill" SIGKILL this process; others raise an ENOSPC OSError. No effect when unset."""
    spec = os.environ.get("FSDP_TRAIN_FAULT", "")
    for item in filter(None, spec.split(",")):
        item, _, at_step = item.partition(":")
        point, _, rank = item.partition("@")
        if point != name or (rank and d is not None and int(rank) != d.rank):
            continue
        if at_step and step is not None and int(at_step) != step:
            continue
        if name.startswith("kill"):
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(28, f"injected fault at {name} (No space left on device)")


# -----------------------------------------------------------------------------------------------
# Data
# -----------------------------------------------------------------------------------------------


def tokenizer_hash(model_dir: Path) -> str:
    """A hash of the tokenizer files: a changed tokenizer changes the data."""
    h = hashlib.sha256()
    for name in sorted(
        (
            "tokenizer.json",
            "tokenizer_config.json",
            "tokenizer.model",
            "vocab.json",
            "merges.txt",
            "special_tokens_map.json",
        )
    ):
        if (model_dir / name).is_file():
            h.update(name.encode())
            h.update((model_dir / name).read_bytes())
    return h.hexdigest()[:16]


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def encode_batch(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids with the tokenizer's own special tokens (e.g. BOS). The Rust backend's encode_batch_fast gives
    the same ids as tokenizer(texts) without computing character offsets: ~15% faster (bench/bench_tokenize.py)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):
        return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=True)]
    return tokenizer(texts, add_special_tokens=True)["input_ids"]


class ChatFormatError(ValueError):
    """A conversation the chat template cannot render, or renders inconsistently; the row is skipped and counted."""


@dataclass
class ChatEncoder:
    """Renders conversations with the tokenizer's chat template and marks the tokens that carry loss.

    With loss_on="assistant", the trained tokens are those of each assistant turn: its content and the template's
    end-of-turn marker. Templates rarely mark those spans (`{% generation %}`), so they are derived by rendering
    prefixes: turn i's span runs from the end of render(turns[:i], add_generation_prompt=True) to the end of
    render(turns[:i+1]). A template that renders a prefix differently from the start of the whole conversation
    (e.g. one that rewrites earlier turns) makes that conversation a counted skip, never a wrong mask.

    A row batch is rendered in two apply_chat_template calls (every prefix without, then with, the generation
    prompt): one call per render costs ~40% more (bench/bench_chat_tokenize.py). When a batched call raises,
    the batch is rendered conversation by conversation, so a conversation the template refuses is one counted skip.
    """

    tokenizer: Any
    loss_on: str  # "assistant" or "all"

    def render(self, conversations: list[list[dict]], generation_prompt: bool) -> list[str]:
        try:
            return self.tokenizer.apply_chat_template(
                conversations, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as exc:  # noqa: BLE001 - jinja raises TemplateError, templates raise their own messages
            raise ChatFormatError(f"the chat template refused it ({str(exc)[:120]})") from exc

    def prefixes(self, messages: list[dict]) -> list[tuple[int, bool]]:
        """The renders that place a conversation's assistant turns: (number of leading turns, generation prompt)."""
        needed = {(len(messages), False)}
        if self.loss_on == "assistant":
            for i, turn in enumerate(messages):
                if turn.get("role") == "assistant":
                    needed |= {(i, True), (i + 1, False)}
        needed.discard((0, True))  # nothing before a first-turn answer: rendered as ""
        return sorted(needed)

    def render_prefixes(self, conversations: list[list[dict]]) -> list[dict[tuple[int, bool], str]]:
        """Every prefix render of every conversation, batched; per conversation (a ChatFormatError in its place)
        when the template refuses one of them."""
        wanted = [
            (row, n, prompt) for row, messages in enumerate(conversations) for n, prompt in self.prefixes(messages)
        ]
        rendered: list[dict[tuple[int, bool], str] | ChatFormatError] = [{(0, True): ""} for _ in conversations]
        try:
            for prompt in (False, True):
                keys = [(row, n) for row, n, p in wanted if p == prompt]
                if keys:
                    texts = self.render([conversations[row][:n] for row, n in keys], prompt)
                    for (row, n), text in zip(keys, texts):
                        rendered[row][(n, prompt)] = text
        except ChatFormatError:
            for row, messages in enumerate(conversations):
                try:
                    for n, prompt in self.prefixes(messages):
                        rendered[row][(n, prompt)] = self.render([messages[:n]], prompt)[0]
                except ChatFormatError as exc:
                    rendered[row] = exc
        return rendered

    def assistant_spans(self, messages: list[dict], renders: dict[tuple[int, bool], str]) -> list[tuple[int, int]]:
        """The character spans of a conversation's assistant turns in its full render."""
        full, spans = renders[(len(messages), False)], []
        for i, turn in enumerate(messages):
            if turn.get("role") != "assistant" or self.loss_on == "all":
                continue
            before, through = renders[(i, True)], renders[(i + 1, False)]
            if not (full.startswith(through) and through.startswith(before)):
                raise ChatFormatError("the chat template renders a conversation's start differently from the whole")
            spans.append((len(before), len(through)))
        return spans

    def encode(self, conversations: list[list[dict]], skipped: dict[str, int]) -> list[tuple[list[int], np.ndarray]]:
        """(token ids, trained mask) per conversation; a conversation that cannot be encoded is counted in skipped."""
        conversations = [list(messages) for messages in conversations]
        texts, all_spans = [], []
        for messages, renders in zip(conversations, self.render_prefixes(conversations)):
            try:
                if isinstance(renders, ChatFormatError):
                    raise renders
                all_spans.append(self.assistant_spans(messages, renders))
                texts.append(renders[(len(messages), False)])
            except ChatFormatError as exc:
                skipped[str(exc)] = skipped.get(str(exc), 0) + 1
        encodings = self.tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
        return [(encoding.ids, self.trained_mask(encoding, spans)) for encoding, spans in zip(encodings, all_spans)]

    def trained_mask(self, encoding: Any, spans: list[tuple[int, int]]) -> np.ndarray:
        """1 for the tokens whose first character lies in an assistant span. Token start offsets never decrease,
        so each span's tokens are one run, found by binary search on the offsets without listing them all
        (building encoding.offsets costs more than the rest of the mask)."""
        n = len(encoding)
        if self.loss_on == "all":
            return np.ones(n, dtype=np.uint8)
        mask = np.zeros(n, dtype=np.uint8)
        start_of = lambda t: encoding.token_to_chars(t)[0]  # noqa: E731
        for a, b in spans:
            mask[bisect.bisect_left(range(n), a, key=start_of) : bisect.bisect_left(range(n), b, key=start_of)] = 1
        return mask


def chat_template_hash(tokenizer: Any) -> str:
    template = json.dumps(getattr(tokenizer, "chat_template", None), sort_keys=True)
    return hashlib.sha256(template.encode()).hexdigest()[:16]


def _stream_paths(tokens_path: Path) -> dict[str, Path]:
    """A token stream's files: token ids, document end offsets, and (chat) the per-token trained mask."""
    return {"tokens": tokens_path, "docs": tokens_path.with_suffix(".docs"), "mask": tokens_path.with_suffix(".mask")}


def tokenize_to_file(
    dataset: Any, tokenizer: Any, out_path: Path, batch_rows: int = 1000, chat: ChatEncoder | None = None
) -> int:
    """Tokenise a split into one flat token stream plus its document end offsets (and, for conversations, a
    trained-token mask). Text rows get EOS after each document; conversations end as their template ends them.

    Streams in row batches (memory stays flat) and writes under temporary names, renamed at the end with the
    token file last, so a reader that sees the token file sees complete side files. Returns the number of tokens.
    """
    eos = tokenizer.eos_token_id
    dtype = _token_dtype(len(tokenizer))
    tokenizer.model_max_length = sys.maxsize  # documents are packed into blocks later; silence the length warning
    paths = _stream_paths(out_path)
    names = ("docs", "mask", "tokens") if chat is not None else ("docs", "tokens")
    tmp = {k: paths[k].with_name(f"{paths[k].name}.tmp{os.getpid()}.{socket.gethostname()}") for k in names}
    handles = {k: open(tmp[k], "wb") for k in names}
    total, skipped = 0, {}
    try:
        for batch in dataset.iter(batch_size=batch_rows):
            if chat is not None:
                encoded = chat.encode(batch["messages"], skipped)
                pieces = [np.asarray(ids, dtype=dtype) for ids, _ in encoded]
                if encoded:
                    np.concatenate([mask for _, mask in encoded]).tofile(handles["mask"])
            else:
                encoded_text = encode_batch(tokenizer, batch["text"])
                pieces = [
                    np.asarray(ids + [eos] if not ids or ids[-1] != eos else ids, dtype=dtype) for ids in encoded_text
                ]
            if pieces:
                np.concatenate(pieces).tofile(handles["tokens"])
                (total + np.cumsum([p.size for p in pieces], dtype=np.int64)).tofile(handles["docs"])
                total += sum(p.size for p in pieces)
        for fh in handles.values():
            fh.flush()
            os.fsync(fh.fileno())
    finally:
        for fh in handles.values():
            fh.close()
    for reason, count in sorted(skipped.items()):
        log(f"skipped {count} conversation(s) of {out_path.stem}: {reason}")
    for k in names:  # the token file last: its presence means the stream is complete
        os.replace(tmp[k], paths[k])
    return total


@dataclass
class Batch:
    """One micro-batch: inputs, targets (-100 = no loss) and, with document masking, per-document positions."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None

    def to(self, device: torch.device) -> Batch:
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return Batch(move(self.input_ids), move(self.labels), move(self.position_ids))


@dataclass
class PackedBlocks:
    """Blocks of seq_length+1 tokens over a flat token stream, with stride seq_length.

    Block i gives inputs tokens[i*L : i*L+L] and targets tokens[i*L+1 : i*L+L+1], so every token
    transition in the stream is trained on exactly once per epoch. `trained` (conversations) marks the tokens
    that carry loss as targets. With `doc_ends` (document masking), position ids restart at 0 at each document
    start and at the block start, so the attention of one document never sees another, and the transition into
    a new document's first token (unpredictable from the previous document) carries no loss.
    """

    tokens: np.ndarray
    seq_length: int
    trained: np.ndarray | None = None  # uint8 per token: 1 = a target that carries loss (None = all)
    doc_ends: np.ndarray | None = None  # end offset (exclusive) of every document; None = no document masking

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_length)

    def block(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(inputs, labels, position ids or None) of block i."""
        L, start = self.seq_length, i * self.seq_length
        window = np.asarray(self.tokens[start : start + L + 1], dtype=np.int64)
        labels = window[1:].copy()
        if self.trained is not None:
            labels[np.asarray(self.trained[start + 1 : start + L + 1]) == 0] = -100
        if self.doc_ends is None:
            return window[:-1], labels, None
        lo, hi = np.searchsorted(self.doc_ends, [start, start + L], side="right")
        doc_starts = np.asarray(self.doc_ends[lo:hi], dtype=np.int64) - start  # in (0, L]: where a new doc begins
        labels[doc_starts - 1] = -100
        restart = np.zeros(L, dtype=np.int64)
        inside = doc_starts[doc_starts < L]
        restart[inside] = inside
        positions = np.arange(L, dtype=np.int64) - np.maximum.accumulate(restart)
        return window[:-1], labels, positions

    def gather(self, indices: list[int]) -> Batch:
        parts = [self.block(i) for i in indices]
        inputs, labels = (torch.from_numpy(np.stack([p[k] for p in parts])) for k in (0, 1))
        positions = None if self.doc_ends is None else torch.from_numpy(np.stack([p[2] for p in parts]))
        return Batch(inputs, labels, positions)

    def trained_tokens(self, indices: list[int]) -> int:
        """Targets that carry loss in these blocks: what the loss of a global batch is averaged over."""
        if self.trained is None and self.doc_ends is None:
            return len(indices) * self.seq_length
        return int(sum((self.block(i)[1] != -100).sum() for i in indices))


def load_token_stream(
    split: Any, split_name: str, tokenizer: Any, cache_key: str, cfg: TrainConfig, d: Dist, chat: ChatEncoder | None
) -> PackedBlocks:
    """Tokenise once per node into a cache keyed by dataset fingerprint, tokenizer and chat settings, then
    memory-map it as packed blocks of --seq-length.

    The cache holds the flat token stream, so any --seq-length reuses it. Local rank 0 builds it;
    the others poll for the file instead of waiting in a collective, which would time out on a large corpus.
    """
    fingerprint = getattr(split, "_fingerprint", None) or str(len(split))
    key = hashlib.sha256(f"{fingerprint}|{cache_key}|docs-v2".encode()).hexdigest()[:20]
    cache_dir = Path(cfg.save_dir) / ".token_cache" / key
    paths = _stream_paths(cache_dir / f"{split_name}.tokens")
    failed_path = cache_dir / f"{split_name}.failed"
    if d.local_rank == 0 and not paths["tokens"].exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        failed_path.unlink(missing_ok=True)
        log(f"tokenising {split_name} split ({len(split)} rows) into {paths['tokens']}")
        start = time.perf_counter()
        try:
            count = tokenize_to_file(split, tokenizer, paths["tokens"], chat=chat)
        except BaseException as exc:
            failed_path.write_text(repr(exc))
            raise
        log(f"tokenised {count:,} tokens in {time.perf_counter() - start:.1f}s")
    deadline = time.monotonic() + cfg.collective_timeout_s
    while not paths["tokens"].exists():
        if failed_path.exists():
            raise TrainError(f"tokenisation failed on local rank 0: {failed_path.read_text()}")
        if time.monotonic() > deadline:
            raise TrainError(f"waited {cfg.collective_timeout_s}s for {paths['tokens']}; raise --collective-timeout-s")
        time.sleep(0.5)

    def mapped(path: Path, dtype: Any) -> np.ndarray:
        return np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.zeros(0, dtype=dtype)

    tokens = mapped(paths["tokens"], _token_dtype(len(tokenizer)))
    trained = mapped(paths["mask"], np.uint8) if chat is not None else None
    doc_ends = mapped(paths["docs"], np.int64) if cfg.document_masking == "on" else None
    return PackedBlocks(tokens, cfg.seq_length, trained, doc_ends)


@dataclass
class DataPlan:
    """Where every global batch comes from. Independent of the number of processes.

    Epoch e is a permutation of the packed blocks seeded by (seed, e); the global batch at step k of
    an epoch is blocks perm[k*G : (k+1)*G], G = world x batch x grad-accum. So the data position is
    just (epoch, samples consumed), and a final partial global batch is always dropped.
    """

    blocks: PackedBlocks
    seed: int
    global_batch: int
    micro_batch: int
    world_size: int
    rank: int

    @property
    def steps_per_epoch(self) -> int:
        return len(self.blocks) // self.global_batch

    def epoch_order(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.blocks), generator=g)

    def step_blocks(self, order: torch.Tensor, step_in_epoch: int) -> list[int]:
        start = step_in_epoch * self.global_batch
        return order[start : start + self.global_batch].tolist()

    def micro_batches(self, order: torch.Tensor, step_in_epoch: int) -> list[Batch]:
        """This rank's micro-batches for one optimizer step: slot (a * world + rank) of the global batch."""
        step_blocks = self.step_blocks(order, step_in_epoch)
        accum = self.global_batch // (self.world_size * self.micro_batch)
        out = []
        for a in range(accum):
            slot = (a * self.world_size + self.rank) * self.micro_batch
            out.append(self.blocks.gather(step_blocks[slot : slot + self.micro_batch]))
        return out

    def trained_tokens(self, order: torch.Tensor, step_in_epoch: int) -> int:
        """Targets carrying loss in the whole global batch (all ranks): every rank computes the same number from
        the deterministic plan, so the loss can be normalised by it without a collective."""
        return self.blocks.trained_tokens(self.step_blocks(order, step_in_epoch))


class Prefetcher:
    """Gathers the micro-batches of step k+1 in a background thread while step k runs. On CUDA they are put in
    pinned memory, so Batch.to(device) copies them asynchronously. Any (epoch, step) can be asked for (a resume,
    the first step); a step that was not the prefetched one is gathered on the spot, so the batches are always
    exactly those of DataPlan."""

    def __init__(self, plan: DataPlan, pin: bool):
        self.plan, self.pin = plan, pin
        self.pending: tuple[tuple[int, int], Any] | None = None
        self.orders: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self.orders:
            self.orders = {e: o for e, o in self.orders.items() if e >= epoch - 1}  # at most the current two
            self.orders[epoch] = self.plan.epoch_order(epoch)
        return self.orders[epoch]

    def _load(self, epoch: int, step: int) -> tuple[list[Batch], int]:
        order = self._order(epoch)
        batches = self.plan.micro_batches(order, step)
        if self.pin:
            batches = [Batch(*(None if t is None else t.pin_memory() for t in dataclasses.astuple(b))) for b in batches]
        return batches, self.plan.trained_tokens(order, step)

    def get(self, epoch: int, step: int) -> tuple[list[Batch], int]:
        """This rank's micro-batches of (epoch, step in epoch) and the global batch's trained-token count."""
        if self.pending is not None and self.pending[0] == (epoch, step):
            result = self.pending[1].result()
        else:
            if self.pending is not None:
                self.pending[1].result()  # never two threads in _load at once
            result = self._load(epoch, step)
        following = (epoch, step + 1) if step + 1 < self.plan.steps_per_epoch else (epoch + 1, 0)
        self.pending = (following, self._in_background(*following))
        return result

    def _in_background(self, epoch: int, step: int) -> Any:
        """A daemon thread (an exit or a crash never waits for it) whose result is a Future."""
        import threading
        from concurrent.futures import Future

        future: Future = Future()

        def work() -> None:
            try:
                future.set_result(self._load(epoch, step))
            except BaseException as exc:  # noqa: BLE001 - re-raised by get() in the training thread
                future.set_exception(exc)

        threading.Thread(target=work, name="prefetch", daemon=True).start()
        return future


@dataclass
class TrainData:
    train: DataPlan
    validation: PackedBlocks | None
    tokenizer: Any
    tokenizer_hash: str
    dataset_fingerprint: str
    data_format: str  # what turns rows into trained tokens: text or chat (template, --loss-on), document masking


def chat_encoder(cfg: TrainConfig, tokenizer: Any, columns: list[str]) -> ChatEncoder | None:
    """A ChatEncoder when the dataset holds conversations (a `messages` column), after checking the template."""
    if "messages" not in columns:
        return None
    if cfg.chat_template:
        tokenizer.chat_template = Path(cfg.chat_template).read_text()
    if not getattr(tokenizer, "chat_template", None):
        raise TrainError(
            f"--dataset-name {cfg.dataset_name} holds conversations, but the tokenizer of --model-name "
            f"{cfg.model_name} has no chat template; pass --chat-template FILE (a Jinja chat template, e.g. the one "
            f"of the model's instruct version)"
        )
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise TrainError(f"--model-name {cfg.model_name}: chat training needs a fast (Rust) tokenizer, tokenizer.json")
    return ChatEncoder(tokenizer, cfg.loss_on)


def slice_rows(split: Any, text: str) -> Any:
    """Rows START:END of the train split. The slice changes the split's fingerprint, hence the token cache key and
    the resume check."""
    start, end = parse_data_slice(text) or (0, None)
    end = len(split) if end is None else min(end, len(split))
    if start >= end:
        raise TrainError(f"--data-slice {text}: the train split has {len(split)} rows, so it selects none")
    log(f"--data-slice {text}: training on rows {start}..{end - 1} of {len(split)}")
    return split.select(range(start, end))


def build_data(cfg: TrainConfig, model_dir: Path, d: Dist) -> TrainData:
    from transformers import AutoTokenizer

    from data_hf import load_text_dataset

    try:
        train_split, val_split = load_text_dataset(cfg.dataset_name, cfg.text_column or None)
    except ValueError as exc:
        raise TrainError(f"--dataset-name: {exc}") from exc
    if cfg.data_slice:
        train_split = slice_rows(train_split, cfg.data_slice)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    if tokenizer.eos_token_id is None:
        raise TrainError(
            f"--model-name {cfg.model_name}: the tokenizer has no EOS token, needed between packed documents"
        )
    chat = chat_encoder(cfg, tokenizer, train_split.column_names)
    tok_hash = tokenizer_hash(model_dir)
    data_format = f"chat:{chat_template_hash(tokenizer)}:loss-on-{cfg.loss_on}" if chat else "text"
    train_blocks = load_token_stream(train_split, "train", tokenizer, f"{tok_hash}|{data_format}", cfg, d, chat)
    global_batch = d.world_size * cfg.batch_size * cfg.grad_accum_steps
    plan = DataPlan(train_blocks, cfg.seed, global_batch, cfg.batch_size, d.world_size, d.rank)
    if plan.steps_per_epoch == 0:
        raise TrainError(
            f"--dataset-name {cfg.dataset_name}: {len(plan.blocks)} packed blocks of {cfg.seq_length} tokens are fewer "
            f"than one global batch of {global_batch} (processes x --batch-size x --grad-accum-steps); "
            f"lower --seq-length, --batch-size or --grad-accum-steps"
        )
    validation = None
    if val_split is not None and len(val_split):
        validation = load_token_stream(val_split, "validation", tokenizer, f"{tok_hash}|{data_format}", cfg, d, chat)
        if len(validation) == 0:
            log("validation split is shorter than one block; validation is skipped")
            validation = None
    fingerprint = f"{getattr(train_split, '_fingerprint', '')}/{getattr(val_split, '_fingerprint', '')}"
    log(
        f"data: {len(plan.blocks):,} train blocks of {cfg.seq_length} tokens, global batch {global_batch} "
        f"({d.world_size} x {cfg.batch_size} x {cfg.grad_accum_steps}), {plan.steps_per_epoch} steps/epoch, "
        f"{len(validation) if validation else 0} validation blocks, document masking {cfg.document_masking}"
    )
    if chat is not None:
        share = float(np.mean(train_blocks.trained)) if len(train_blocks.trained) else 0.0
        log(
            f"SFT on conversations (a 'messages' column): chat template {chat_template_hash(tokenizer)}, loss on "
            f"{cfg.loss_on} tokens ({share:.1%} of all tokens carry loss)"
        )
    data_format += f":document-masking-{cfg.document_masking}"
    return TrainData(plan, validation, tokenizer, tok_hash, fingerprint, data_format)


# -----------------------------------------------------------------------------------------------
# Model and sharding
# -----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build a model with parameters on the meta device but real buffers.

    Parameters cost nothing (their init runs on meta), while buffers such as rotary `inv_freq`
    are computed for real, so we can put them back after `to_empty` wipes them.
    """
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":  # meta already: a re-registration (weight tying)
            kwargs = {"requires_grad": param.requires_grad}
            module._parameters[name] = type(param)(param.to("meta"), **kwargs)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def auto_attention_order(packed_documents: bool) -> tuple[str, ...]:
    """--attn-implementation auto. With document masking on a GPU, flash-attention first when installed: it takes
    the packed documents as variable-length sequences (transformers derives them from the position ids), where
    sdpa needs a [batch x 1 x T x T] boolean mask and a slower kernel. Otherwise sdpa, then eager."""
    if packed_documents and torch.cuda.is_available():
        import importlib.util

        if importlib.util.find_spec("flash_attn") is not None:
            return ("flash_attention_2", "sdpa", "eager")
    return ("sdpa", "eager")


def build_model_skeleton(
    model_dir: Path, attn_implementation: str = "auto", packed_documents: bool = False
) -> nn.Module:
    """The model with parameters on meta. auto tries the kernels of auto_attention_order in turn.

    Each attempt starts from a freshly read config: from_config records the requested implementation in
    the config object it is given, so retrying with the same object would ask for sdpa again (Gemma2).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    attempts = auto_attention_order(packed_documents) if attn_implementation == "auto" else (attn_implementation,)
    for attn in attempts:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        config.use_cache = False
        try:
            with parameters_on_meta():
                return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
        except (ValueError, ImportError) as exc:  # no such kernel for this architecture, or not installed
            problem = exc
    raise TrainError(
        f"--attn-implementation {attn_implementation}: cannot build {config.architectures or config.model_type} "
        f"from {model_dir} ({problem}); try --attn-implementation auto or eager"
    )


def find_decoder_layers(model: nn.Module) -> list[nn.Module]:
    """Decoder layers, found from the model's own `_no_split_modules` so any architecture works."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        candidates = sorted(
            {type(m).__name__ for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst}
        )
        raise TrainError(
            f"cannot find decoder layers of {type(model).__name__}: _no_split_modules={sorted(names)} matches no "
            f"submodule. Candidates (children of ModuleLists): {candidates}"
        )
    return layers


def apply_activation_checkpointing(model: nn.Module, layers: list[nn.Module], every_n: int) -> int:
    """Wrap every Nth decoder layer with torch's checkpoint wrapper (non-reentrant).

    We do not use HF's gradient_checkpointing flag: under FSDP it re-runs the layer outside the
    FSDP hooks' view and costs an extra all-gather per layer.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing as wrap,
    )
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    selected = {id(layer) for i, layer in enumerate(layers) if i % every_n == 0}
    wrap(model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda m: id(m) in selected)
    return len(selected)


def shard_model(root: nn.Module, layers: list[nn.Module], cfg: TrainConfig, precision: str, d: Dist) -> None:
    """fully_shard each decoder layer, then the root: the training forward (CausalLMLoss) around the model, whose
    group holds the embeddings, final norm and head (a tied head shares the embedding's parameter)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    compute_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[precision]
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    # Pinned host memory speeds up the GPU copies; without a GPU there is nothing to pin for (and it fails).
    offload = CPUOffloadPolicy(pin_memory=d.device.type == "cuda") if cfg.cpu_offload == "on" else OffloadPolicy()
    reshard = cfg.sharding != "grad-op"
    wrappers = {id(m._checkpoint_wrapped_module): m for m in root.modules() if hasattr(m, "_checkpoint_wrapped_module")}
    for i, layer in enumerate(layers):
        unit = wrappers.get(id(layer), layer)  # shard the checkpoint wrapper, so recompute sees FSDP's hooks
        if cfg.compile == "on":
            unit.compile()
        # The last layer's backward comes right after the loss: resharding it after forward would only regather it.
        last = i == len(layers) - 1
        fully_shard(unit, mesh=d.mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard and not last)
    fully_shard(root, mesh=d.mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)


def clean_fqn(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def materialize(model: nn.Module, d: Dist, cfg: TrainConfig) -> None:
    """Allocate the local shards, then restore the buffers that `to_empty` left as garbage."""
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    model.to_empty(device="cpu" if cfg.cpu_offload == "on" else d.device)
    for name, value in buffers.items():
        module_name, _, buffer_name = name.rpartition(".")
        owner = model.get_submodule(module_name) if module_name else model
        owner._buffers[buffer_name] = value.to(d.device)  # buffers stay on the compute device, even with offload


def init_weights_on_shards(model: nn.Module, config: Any, seed: int, d: Dist) -> None:
    """Initialise from scratch, shard by shard, identically at any number of processes.

    Each parameter is drawn in full from a generator seeded by (seed, name) and sliced to this rank's shard,
    so only one full parameter exists at a time. Rule: matrices ~ N(0, initializer_range), 1-D weights
    (norms) = 1, biases = 0.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    std = getattr(config, "initializer_range", 0.02)
    gen_device = d.device if d.device.type == "cuda" else torch.device("cpu")
    with torch.no_grad():
        for name, param in model.named_parameters():
            name = clean_fqn(name)
            full = torch.empty(param.shape, dtype=torch.float32, device=gen_device)
            if param.ndim >= 2:
                g = torch.Generator(device=gen_device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                full.normal_(0.0, std, generator=g)
            else:
                full.fill_(0.0 if name.endswith("bias") else 1.0)
            if isinstance(param, DTensor):
                local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
                param.to_local().copy_(local)
            else:
                param.copy_(full)


def checkpoint_weight_files(model_dir: Path) -> tuple[dict[str, Path], str]:
    """Each tensor name in the model folder's weight files -> its file, and the format ("safetensors" or "bin")."""
    from safetensors import safe_open

    files: dict[str, Path] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            files.update(dict.fromkeys(fh.keys(), f))
    if files:
        return files, "safetensors"
    for f in sorted(model_dir.glob("pytorch_model*.bin")):
        files.update(dict.fromkeys(torch.load(f, map_location="meta", weights_only=True, mmap=True), f))
    return files, "bin" if files else "none"


@dataclass
class CheckpointPlan:
    """Where each model tensor comes from, routed by transformers' own conversion mapping for this version."""

    files: dict[str, Path]  # checkpoint key -> the file holding it
    renamed: dict[str, str]  # model FQN -> checkpoint key: read slice by slice
    converted: dict[str, Any]  # first target FQN -> transformers WeightConverter holding its source keys
    conversions: list[Any]  # the transforms that matched; the export reverts exactly these (as save_pretrained)


def plan_checkpoint_load(model: nn.Module, files: dict[str, Path]) -> CheckpointPlan:
    """Route every checkpoint key as from_pretrained does (transformers.core_model_loading): all WeightRenamings,
    then at most one WeightConverter, then add or strip the base-model prefix.

    A renamed key is read slice by slice; a converted one (e.g. per-expert `experts.N.gate_proj` stacked into
    `experts.gate_up_proj`) needs its whole source tensors. Keys the architecture does not use are ignored, as
    from_pretrained ignores them; tied copies (lm_head tied to the embedding) are never loaded separately; a
    persistent buffer the checkpoint lacks keeps its computed value.
    """
    import copy

    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", "model")
    tied = _tied_parameter_names(model)
    params = {clean_fqn(n) for n, _ in model.named_parameters(remove_duplicate=False)}
    # Persistent buffers load too where stored, as in from_pretrained (e.g. GLM-4.5's router e_score_correction_bias)
    expected = dict.fromkeys(params | {clean_fqn(n) for n in model.state_dict()}, True)
    renamed: dict[str, str] = {}
    converted: dict[str, Any] = {}
    for key in sorted(files, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, expected)
        if target not in expected:  # as from_pretrained: a name the model already has (maybe prefixed) wins
            target, pattern = rename_source_key(key, [], [], prefix, expected)
        if target not in expected or target in tied:
            continue
        if pattern is None:
            renamed[target] = key
        else:
            converted.setdefault(target, copy.deepcopy(by_pattern[pattern])).add_tensor(target, key, pattern, key)
    produced = set(renamed)
    for first, converter in converted.items():
        produced.update(first.replace(converter.target_patterns[0], t) for t in converter.target_patterns)
    missing = sorted(params - produced - tied)
    if missing:
        raise TrainError(
            f"the model folder's weights lack {len(missing)} tensors the architecture needs (after transformers' "
            f"key conversions), e.g. {missing[:5]}; re-download with model_download.py (it verifies every tensor)"
        )
    return CheckpointPlan(files, renamed, converted, [c for c in conversions if c.was_used()])


def check_still_tied(model: nn.Module) -> None:
    """Tied input/output embeddings must remain one Parameter through sharding, or training unties them."""
    head = model.get_output_embeddings()
    if getattr(model.config, "tie_word_embeddings", False) and head is not None:
        if head.weight is not model.get_input_embeddings().weight:
            raise TrainError("tied input/output embeddings became two tensors during sharding; please report this")


def _tied_parameter_names(model: nn.Module) -> set[str]:
    """Names under which an already-seen Parameter appears again (e.g. lm_head.weight tied to embed_tokens)."""
    seen: set[int] = set()
    tied = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(clean_fqn(name))
        seen.add(id(param))
    return tied


def load_pretrained_sharded(model: nn.Module, model_dir: Path) -> None:
    """Load the checkpoint into the shards, equal bit for bit to from_pretrained.

    Renamed tensors: each rank reads only its own slices (DCP's Hugging Face reader, memory-mapped).
    Converted tensors: each rank reads the whole source tensors of one converter at a time (e.g. every
    expert's gate and up projection of one layer), lets transformers' ops build the full target, and
    keeps its slice, so the extra memory is about twice one layer's fused tensor.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    files, fmt = checkpoint_weight_files(model_dir)
    plan = plan_checkpoint_load(model, files)
    state = get_model_state_dict(model)
    by_file_key = {plan.renamed[k]: v for k, v in state.items() if k in plan.renamed}
    if fmt == "safetensors":
        dcp.load(by_file_key, storage_reader=dcp.HuggingFaceStorageReader(str(model_dir)))
    else:
        _load_bin_slices(by_file_key, model_dir)
    _load_converted(model, plan, state)
    model._weight_conversions = plan.conversions  # what from_pretrained records; save/export revert these


def _load_converted(model: nn.Module, plan: CheckpointPlan, state: dict[str, Any]) -> None:
    import functools

    with torch.no_grad(), contextlib.ExitStack() as open_files:
        read = functools.partial(_read_whole_tensor, plan.files, open_files, {})
        for first, converter in plan.converted.items():
            for pattern, keys in converter.collected_tensors.items():  # load lazily, one converter at a time
                converter.collected_tensors[pattern] = [functools.partial(read, key) for key in keys]
            for name, full in converter.convert(first, model=model, config=model.config).items():
                _copy_into_shard(state[name], full[0] if isinstance(full, list) else full)


def _read_whole_tensor(files: dict[str, Path], open_files: contextlib.ExitStack, handles: dict, key: str) -> Any:
    from safetensors import safe_open

    path = files[key]
    if path not in handles:
        if path.suffix == ".safetensors":
            handles[path] = open_files.enter_context(safe_open(str(path), framework="pt"))
        else:
            handles[path] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    handle = handles[path]
    return handle.get_tensor(key) if path.suffix == ".safetensors" else handle[key]


def _copy_into_shard(target: Any, full: torch.Tensor) -> None:
    """Copy this rank's slice of a full tensor into a parameter (its DTensor shard, or all of it)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):  # src_data_rank=None: every rank holds `full`, so slice locally, no messages
        full = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(full.to_local())
    else:
        target.copy_(full)


def _load_bin_slices(targets: dict[str, Any], model_dir: Path) -> None:
    """Fallback for repos without safetensors: mmap each .bin and copy this rank's slice of each tensor."""
    with torch.no_grad():
        for f in sorted(model_dir.glob("pytorch_model*.bin")):
            stored = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            for key, tensor in stored.items():
                if key in targets:
                    _copy_into_shard(targets[key], tensor)


@dataclass
class ModelBundle:
    model: nn.Module  # the Hugging Face model: its state dict is what checkpoints and the export hold
    train_forward: CausalLMLoss  # the FSDP root around it: batch -> summed loss
    config: Any
    model_dir: Path
    num_params: int
    num_layers_checkpointed: int
    flops_per_token: float
    export_dtype: torch.dtype  # --export-dtype; auto = the dtype the model was shipped in


def export_dtype(cfg: TrainConfig, model_dir: Path) -> torch.dtype:
    if cfg.export_dtype != "auto":
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.export_dtype]
    return original_dtype(model_dir)


def original_dtype(model_dir: Path) -> torch.dtype:
    """The model's own dtype: config.json's dtype/torch_dtype, else that of its weight files, else fp32."""
    config = json.loads((model_dir / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype")
    if isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        from safetensors import safe_open

        with safe_open(str(files[0]), framework="pt") as fh:
            keys = list(fh.keys())
            if keys:
                stored = fh.get_slice(keys[0]).get_dtype()
                return {"BF16": torch.bfloat16, "F16": torch.float16}.get(stored, torch.float32)
    return torch.float32


def flops_per_token(model: nn.Module, config: Any, seq_length: int) -> float:
    """6N + 12*L*H*Q*T (PaLM appendix B): N counts matmul parameters, i.e. all but the input embedding,
    plus the output head even when it is tied to the input embedding (the head matmul still runs)."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    n = sum(p.numel() for p in model.parameters()) - embed.numel()
    if head is not None and head.weight is embed:
        n += embed.numel()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers, heads = text.num_hidden_layers, text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 6 * n + 12 * layers * heads * head_dim * seq_length


def build_model(cfg: TrainConfig, precision: str, d: Dist) -> ModelBundle:
    model_dir = resolve_model_dir(cfg.model_name)
    model = build_model_skeleton(model_dir, cfg.attn_implementation, cfg.document_masking == "on")
    num_params = sum(p.numel() for p in model.parameters())
    fpt = flops_per_token(model, model.config, cfg.seq_length)
    layers = find_decoder_layers(model)
    arch, layer_class = type(model).__name__, type(layers[0]).__name__  # before fully_shard renames the classes
    n_ckpt = (
        apply_activation_checkpointing(model, layers, cfg.ac_every_n_layers)
        if cfg.activation_checkpointing == "on"
        else 0
    )
    train_forward = CausalLMLoss(model, cfg.loss_chunk_tokens)
    if cfg.loss_chunk_tokens and (problem := chunked_loss_problem(model)):
        log(f"--loss-chunk-tokens: full logits instead of the chunked loss for {arch}: {problem}")
        train_forward.chunk = 0
    shard_model(train_forward, layers, cfg, precision, d)
    materialize(model, d, cfg)
    files, _ = checkpoint_weight_files(model_dir)
    if files:
        start = time.perf_counter()
        load_pretrained_sharded(model, model_dir)
        log(f"loaded pretrained weights from {model_dir} (sharded, {time.perf_counter() - start:.1f}s)")
    else:
        init_weights_on_shards(model, model.config, cfg.seed, d)
        log(f"no weight files in {model_dir}: initialised {num_params:,} parameters from scratch on the shards")
    check_still_tied(model)
    model.train()
    log(
        f"model {arch}: {num_params:,} parameters, {len(layers)} decoder layers "
        f"({layer_class}) sharded with --sharding {cfg.sharding} over mesh {tuple(d.mesh.shape)}, "
        f"{n_ckpt} layers checkpointed, compute {precision}, cpu offload {cfg.cpu_offload}, "
        f"attention {model.config._attn_implementation}, loss chunks of {train_forward.chunk or 'all'} tokens"
    )
    return ModelBundle(
        model, train_forward, model.config, model_dir, num_params, n_ckpt, fpt, export_dtype(cfg, model_dir)
    )


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms and biases (1-D tensors). Fused where available: the fused kernel
    also skips a step on device when `found_inf` is set, so skipping a bad step needs no host sync."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    try:
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)


def lr_at(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): a pure function of the step, so resume is exact."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    if cfg.lr_schedule == "linear":
        return cfg.lr - (cfg.lr - cfg.min_lr) * progress
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


# -----------------------------------------------------------------------------------------------
# Checkpoints
# -----------------------------------------------------------------------------------------------


@dataclass
class TrainState:
    """Everything besides model and optimizer that an exact resume needs."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    samples_in_epoch: int = 0  # packed blocks consumed in the current epoch (a multiple of the global batch)
    skipped_steps: int = 0  # steps whose optimizer update was skipped (non-finite loss or gradient)
    bad_streak: int = 0  # consecutive skipped steps up to now
    loss_scale: float = 1.0  # fp16 dynamic loss scale
    scale_good_steps: int = 0

    def advance(self, global_batch: int, steps_per_epoch: int) -> None:
        self.step += 1
        self.samples_in_epoch += global_batch
        if self.samples_in_epoch >= steps_per_epoch * global_batch:
            self.epoch += 1
            self.samples_in_epoch = 0


class CheckpointError(TrainError):
    pass


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, payload: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as fh:
        json.dump(payload, fh, indent=2, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


STEP_DIR = re.compile(r"step_(\d+)")
CHECKSUM_FILE = "checksums.json"  # {"algorithm": "crc32", "files": {name: {"bytes": n, "crc32": hex}}}


def step_dirs(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first: only folders named exactly step_ + digits, so a folder moved aside
    (step_00000020.bad, corrupt_step_00000020) or a temporary (.tmp_step_...) is never resumed from."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.fullmatch(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name[len("step_") :]))


def file_checksum(path: Path) -> dict:
    """Size and CRC-32 of a file. CRC-32 runs at several GB/s (zlib, without the GIL) and the file is mapped,
    not copied: recorded right after writing, while the file is in the page cache, it is a small part of a save
    (bench_checkpoint.py reports the share)."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:  # an empty file cannot be mapped
            return {"bytes": 0, "crc32": f"{zlib.crc32(b''):08x}"}
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return {"bytes": size, "crc32": f"{zlib.crc32(data):08x}"}


def checksum_problems(folder: Path, names: list[str], recorded: dict) -> list[str]:
    """What is wrong with these files of a checkpoint, one line per damaged file."""
    problems = []
    for name in names:
        try:
            actual = file_checksum(folder / name)
        except OSError as exc:
            problems.append(f"{folder / name}: unreadable ({exc.strerror or exc})")
            continue
        expected = recorded[name]
        if actual["bytes"] != expected["bytes"]:
            problems.append(f"{folder / name}: {actual['bytes']} bytes, {expected['bytes']} were written")
        elif actual["crc32"] != expected["crc32"]:
            problems.append(
                f"{folder / name}: checksum mismatch (crc32 {actual['crc32']}, {expected['crc32']} written)"
            )
    return problems


# DCP's CheckpointException derives from BaseException, not Exception.
CHECKPOINT_FAILURES = (Exception, dcp.api.CheckpointException)


def _attempt(fn: Any, *args: Any, **kwargs: Any) -> BaseException | None:
    """Run fn; return its exception instead of raising, so every rank can be told about it first."""
    try:
        fn(*args, **kwargs)
    except CHECKPOINT_FAILURES as exc:
        return exc
    return None


class _CheckpointWriter(dcp.FileSystemWriter):
    """DCP's file writer with fsync on and the fault-injection point inside DCP's write phase. Right after this
    rank wrote its files (in the background with --async-ckpt) it adds their checksums to `checksums`."""

    def __init__(self, path: str, d: Dist, step: int, checksums: dict):
        super().__init__(path, sync_files=True)
        self._dist, self._step, self.checksums = d, step, checksums

    def write_data(self, plan: Any, planner: Any) -> Any:
        fault_point("ckpt_write", self._dist, self._step)
        future = super().write_data(plan, planner)  # FileSystemWriter returns it completed
        start = time.perf_counter()
        for name in sorted({result.storage_data.relative_path for result in future.value()}):
            self.checksums[name] = file_checksum(Path(self.path) / name)
        self.checksums["_seconds"] = time.perf_counter() - start
        return future


class Checkpointer:
    """Atomic DCP checkpoints: each rank writes its shard into `.tmp_step_N/`; only after every rank has
    finished and the training state is written and synced does rank 0 rename it to `step_N/`.
    A run killed at any moment therefore leaves the previous checkpoint as the newest complete one."""

    def __init__(self, cfg: TrainConfig, d: Dist, fingerprint: dict):
        self.cfg, self.d, self.fingerprint = cfg, d, fingerprint
        self.root = cfg.experiment_dir / "checkpoint"
        self.pending: tuple[Any, Path, int, dict] | None = None  # (future, tmp dir, step, checksums), async save
        self.checksum_s = 0.0  # seconds this rank spent on checksums in the last save (bench_checkpoint.py)

    # -- finding ---------------------------------------------------------------------------------
    def latest_complete(self) -> Path | None:
        """The newest complete checkpoint whose files match their checksums. Damaged newer ones are reported and
        moved aside (corrupt_step_N); if every checkpoint is damaged, nothing is moved and the run stops.
        Rank 0 first removes incomplete folders: the experiment lock makes sure no live run is writing them."""
        found = None
        if self.d.is_main and self.root.is_dir():
            for tmp in sorted(self.root.glob(".tmp_step_*")):
                log(f"removing incomplete checkpoint {tmp} (a save was interrupted)")
                shutil.rmtree(tmp, ignore_errors=True)
            found = [str(p) for p in step_dirs(self.root)]
        damaged: list[tuple[Path, list[str]]] = []
        for path in map(Path, reversed(broadcast_object(found, self.d) or [])):
            problems = self.verify(path)
            if not problems:
                self._set_aside(damaged, path)
                return path
            damaged.append((path, problems))
        if damaged:
            details = "\n".join(f"  {p}" for _, problems in damaged for p in problems)
            raise CheckpointError(
                f"no intact checkpoint in {self.root}; damaged files:\n{details}\nNothing was resumed or moved. "
                f"Restore those files, move the damaged checkpoints aside to start over from step 0, or use a new "
                f"--experiment-name."
            )
        return None

    def verify(self, path: Path) -> list[str]:
        """Every rank checks its share of the files against checksums.json, in parallel; all get every problem."""
        try:
            recorded = json.loads((path / CHECKSUM_FILE).read_text())["files"]
        except FileNotFoundError:
            log(f"WARNING: {path} has no {CHECKSUM_FILE} (written by an older version); its files are not verified")
            return []
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return [f"{path / CHECKSUM_FILE}: unreadable ({exc})"]
        mine = sorted(recorded)[self.d.rank :: self.d.world_size]
        found: list[list[str] | None] = [None] * self.d.world_size
        dist.all_gather_object(found, checksum_problems(path, mine, recorded), group=self.d.cpu_group)
        return [problem for part in found for problem in part or []]

    def _set_aside(self, damaged: list[tuple[Path, list[str]]], intact: Path) -> None:
        for path, problems in damaged:
            if self.d.is_main:
                aside = self.root / f"corrupt_{path.name}"
                for n in range(2, 1000):
                    if not aside.exists():
                        break
                    aside = self.root / f"corrupt_{path.name}_{n}"
                os.rename(path, aside)
                files = "\n".join(f"  {p}" for p in problems)
                log(
                    f"WARNING: checkpoint {path.name} is damaged:\n{files}\nMoved it aside to {aside}. "
                    f"RESUMING FROM THE OLDER CHECKPOINT {intact.name}; the steps after it are trained again."
                )
        dist.barrier(group=self.d.cpu_group)

    def read_state(self, path: Path) -> dict:
        state_file = path / "train_state.json"
        try:
            payload = json.loads(state_file.read_text())
            TrainState(**payload["train_state"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(
                f"checkpoint {path} is unreadable: {state_file} ({exc}). Nothing was resumed. Move that folder "
                f"aside to resume from the previous checkpoint, or use a new --experiment-name to start over."
            ) from exc
        if not (path / ".metadata").is_file():
            raise CheckpointError(
                f"checkpoint {path} is unreadable: {path / '.metadata'} is missing. Move that folder "
                f"aside to resume from the previous checkpoint."
            )
        return payload

    def check_compatible(self, saved: dict, path: Path) -> None:
        # A key the checkpoint lacks was added by a later version of this script: not a change of settings.
        changed = [k for k in RESUME_PINNED if k in saved and saved[k] != self.fingerprint.get(k)]
        if not changed:
            return
        details = "; ".join(f"{k}: checkpoint {saved.get(k)!r} vs now {self.fingerprint.get(k)!r}" for k in changed)
        if self.cfg.force_resume:
            log(f"WARNING: resuming from {path} although settings changed ({details}) because of --force-resume")
            return
        raise CheckpointError(
            f"cannot resume from {path}: {details}. These change the math or the data. Restore the original "
            f"settings, pass --force-resume to resume anyway, or use a new --experiment-name."
        )

    # -- loading ---------------------------------------------------------------------------------
    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> TrainState:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_state_dict,
            set_model_state_dict,
            set_state_dict,
        )

        payload = self.read_state(path)
        self.check_compatible(payload["fingerprint"], path)
        try:
            if optimizer is None:
                model_sd = get_model_state_dict(model)
                dcp.load({"model": model_sd}, checkpoint_id=str(path), process_group=self.d.cpu_group)
                set_model_state_dict(model, model_sd)
            else:
                model_sd, optim_sd = get_state_dict(model, optimizer)
                dcp.load(
                    {"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path), process_group=self.d.cpu_group
                )
                set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        except CHECKPOINT_FAILURES as exc:
            raise CheckpointError(
                f"checkpoint {path} could not be loaded ({type(exc).__name__}: {exc}). "
                f"Move that folder aside to resume from the previous checkpoint."
            ) from exc
        rng_file = path / f"rng_rank{self.d.rank:05d}.pt"
        if payload.get("world_size") == self.d.world_size:
            error = _attempt(lambda: _set_rng_state(torch.load(rng_file, weights_only=False)))
            errors: list[str | None] = [None] * self.d.world_size  # every rank stops if any RNG file is bad
            dist.all_gather_object(errors, f"{rng_file}: {error}" if error else None, group=self.d.cpu_group)
            if any(errors):
                raise CheckpointError(
                    "cannot restore the random number generators from "
                    + "; ".join(e for e in errors if e)
                    + ". Move that checkpoint folder aside to resume from the previous one."
                )
        else:
            seed_everything(self.cfg.seed * 1_000_003 + payload["train_state"]["step"] * 101 + self.d.rank)
            log(
                f"world size changed ({payload.get('world_size')} -> {self.d.world_size}): per-rank RNG reseeded "
                f"(only dropout uses it; data order and weights are restored exactly)"
            )
        return TrainState(**payload["train_state"])

    # -- saving ----------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return self.cfg.ckpt_freq > 0 and step % self.cfg.ckpt_freq == 0

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: TrainState, reason: str) -> float:
        """Save (async with --async-ckpt). Returns the seconds training was blocked."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        start = time.perf_counter()
        self.finish_pending()
        final = self.root / step_dir_name(state.step)
        if final.exists():  # already saved at this step (e.g. ckpt-freq step that is also the last)
            return time.perf_counter() - start
        tmp = self.root / f".tmp_{step_dir_name(state.step)}"
        if self.d.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier(group=self.d.cpu_group)
        # Files each rank writes alone: agree on their success before entering DCP's collectives, or a rank
        # that failed here would wait in a different collective than the others (a hang, not an error).
        checksums: dict = {}  # of the files this rank writes; rank 0 records everyone's in _commit
        self._agree_or_fail(_attempt(self._write_side_files, tmp, state, checksums), tmp)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state_dict = {"model": model_sd, "optim": optim_sd}
        writer = _CheckpointWriter(str(tmp), self.d, state.step, checksums)
        fault_point("kill_during_write", self.d, state.step)
        if self.cfg.async_ckpt == "on":
            # Its collectives run in a background thread while the main thread keeps using cpu_group each
            # step; sharing one group would interleave the two streams differently on each rank (a deadlock).
            future = dcp.async_save(state_dict, storage_writer=writer, process_group=self.d.async_ckpt_group)
            self.pending = (future, tmp, state.step, checksums)
            error = None
        else:  # DCP gathers a failure on any rank's write and raises it on every rank
            error = _attempt(dcp.save, state_dict, storage_writer=writer, process_group=self.d.cpu_group)
        self._agree_or_fail(error, tmp)
        if self.pending is None:
            self._commit(tmp, state.step, checksums)
        blocked = time.perf_counter() - start
        log(
            f"checkpoint step {state.step} ({reason}) {'queued' if self.pending else 'saved'} "
            f"in {blocked:.2f}s of blocked training -> {self.root / step_dir_name(state.step)}"
        )
        return blocked

    def finish_pending(self) -> None:
        if self.pending is None:
            return
        future, tmp, step, checksums = self.pending
        self.pending = None
        self._agree_or_fail(_attempt(future.result), tmp)
        self._commit(tmp, step, checksums)

    def _write_side_files(self, tmp: Path, state: TrainState, checksums: dict) -> None:
        fault_point("side_files_write", self.d, state.step)
        rng_file = tmp / f"rng_rank{self.d.rank:05d}.pt"
        with open(rng_file, "wb") as fh:
            torch.save(_rng_state(), fh)
            fh.flush()
            os.fsync(fh.fileno())
        checksums[rng_file.name] = file_checksum(rng_file)
        if self.d.is_main:
            payload = {
                "train_state": dataclasses.asdict(state),
                "fingerprint": self.fingerprint,
                "world_size": self.d.world_size,
                "config": dataclasses.asdict(self.cfg),
                "saved_at": dt.datetime.now().isoformat(timespec="seconds"),
            }
            write_json_atomic(tmp / "train_state.json", payload)
            checksums["train_state.json"] = file_checksum(tmp / "train_state.json")

    def _agree_or_fail(self, error: BaseException | None, tmp: Path) -> None:
        """Every rank learns whether any rank failed, so a failed write never hangs the others."""
        if all_ranks_agree(error is not None, self.d):
            if self.d.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            errors: list[str | None] = [None] * self.d.world_size  # rank 0 reports them all, once
            dist.all_gather_object(errors, None if error is None else str(error), group=self.d.cpu_group)
            where = "; ".join(f"rank {rank}: {text}" for rank, text in enumerate(errors) if text)
            previous = self.latest_complete_name()
            raise CheckpointError(
                f"writing checkpoint {tmp.name} failed on {where}. The previous checkpoint "
                f"({previous or 'none'}) is intact; free disk space or fix permissions and rerun."
            )

    def latest_complete_name(self) -> str | None:
        complete = step_dirs(self.root)
        return complete[-1].name if complete else None

    def _commit(self, tmp: Path, step: int, checksums: dict) -> None:
        self.checksum_s = checksums.pop("_seconds", 0.0)
        gathered: list[dict | None] = [None] * self.d.world_size
        # Also the barrier that every rank's files are written and fsynced.
        dist.all_gather_object(gathered, checksums, group=self.d.cpu_group)
        fault_point("kill_before_rename", self.d, step)
        if self.d.is_main:
            start = time.perf_counter()
            files = {name: value for part in gathered for name, value in (part or {}).items()}
            files[".metadata"] = file_checksum(tmp / ".metadata")
            write_json_atomic(tmp / CHECKSUM_FILE, {"algorithm": "crc32", "files": files})
            self.checksum_s += time.perf_counter() - start
            final = self.root / step_dir_name(step)
            _fsync_dir(tmp)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            fault_point("kill_after_rename", self.d, step)
            write_json_atomic(
                self.cfg.experiment_dir / "state.json",
                {
                    "latest_checkpoint": str(final),
                    "step": step,
                    "world_size": self.d.world_size,
                    "saved_at": dt.datetime.now().isoformat(timespec="seconds"),
                },
            )
            self._prune()
        dist.barrier(group=self.d.cpu_group)

    def _prune(self) -> None:
        complete = step_dirs(self.root)
        for old in complete[: max(0, len(complete) - self.cfg.keep_last)]:
            shutil.rmtree(old, ignore_errors=True)
            log(f"pruned old checkpoint {old.name} (--keep-last {self.cfg.keep_last})")


def export_hf_model(bundle: ModelBundle, tokenizer: Any, out_dir: Path, d: Dist) -> None:
    """Write a standard HF folder (config, safetensors shards + index, tokenizer) from the sharded model,
    in the layout save_pretrained writes (transformers' conversions reverted, e.g. one tensor per expert).

    Tensors that only rename on save: DCP's HF writer has every rank write its own slices, then rank 0
    consolidates them file by file, so no process gathers them. Tensors a converter reverts (stacked MoE
    experts): gathered one decoder layer at a time, reverted by transformers and written by rank 0.
    Saved in --export-dtype (auto: the model's own); tied weights stay tied.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    dtype = bundle.export_dtype
    tied = _tied_parameter_names(bundle.model)
    state = {k: v.to(dtype) for k, v in get_model_state_dict(bundle.model).items() if k not in tied}
    state, converted_by_layer = split_export_layout(bundle.model, state)
    index, size, max_bytes = {}, 0, 4 * 2**30  # shards of at most ~4 GiB, like save_pretrained's default
    file_no = 1
    for key, value in state.items():
        nbytes = value.numel() * value.element_size()
        if size and size + nbytes > max_bytes:
            file_no, size = file_no + 1, 0
        index[key], size = file_no, size + nbytes
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    if d.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier(group=d.cpu_group)
    writer = dcp.HuggingFaceStorageWriter(
        str(tmp), fqn_to_index_mapping=index, save_distributed=True, enable_consolidation=True
    )
    dcp.save(state, storage_writer=writer, process_group=d.cpu_group)
    _write_converted(bundle.model, converted_by_layer, tmp, max_bytes, d)
    if d.is_main:
        shutil.rmtree(tmp / "sharded", ignore_errors=True)
        config = bundle.config
        config.use_cache, config.dtype = True, dtype
        config.save_pretrained(tmp)
        if (bundle.model_dir / "generation_config.json").is_file():
            shutil.copy2(bundle.model_dir / "generation_config.json", tmp / "generation_config.json")
        tokenizer.save_pretrained(tmp)
        old = out_dir.with_name(f".{out_dir.name}.old")
        if out_dir.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
        log(f"exported Hugging Face model ({dtype}) to {out_dir}")
    dist.barrier(group=d.cpu_group)


def split_export_layout(model: nn.Module, state: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Ask transformers how save_pretrained would write each tensor (revert_weight_conversion on a meta copy):
    -> {saved name: sharded tensor} for plain renames, and per decoder layer the tensors a converter reverts."""
    import re

    from transformers.core_model_loading import revert_weight_conversion

    renamed: dict[str, Any] = {}
    converted: dict[str, dict[str, Any]] = {}
    for key, value in state.items():
        probe = torch.empty(value.shape, dtype=value.dtype, device="meta")
        try:
            saved = revert_weight_conversion(model, {key: probe})
        except Exception:  # noqa: BLE001 - a many-to-one revert needs its partners: handled with its layer below
            saved = {}
        if len(saved) == 1 and next(iter(saved.values())) is probe:
            renamed[next(iter(saved))] = value
        else:
            layer = re.match(r"(.*?\.\d+)\.", key)
            converted.setdefault(layer.group(1) if layer else "", {})[key] = value
    return renamed, list(converted.values())


def _write_converted(model: nn.Module, groups: list[dict[str, Any]], folder: Path, max_bytes: int, d: Dist) -> None:
    """Gather each layer's converted tensors (every rank takes part), revert them, and let rank 0 append them
    to the export as extra safetensors files listed in the index."""
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor
    from transformers.core_model_loading import revert_weight_conversion

    if not groups:
        return
    pending: dict[str, torch.Tensor] = {}
    written: dict[str, str] = {}
    written_bytes = 0

    def flush() -> None:
        nonlocal written_bytes
        written_bytes += sum(v.numel() * v.element_size() for v in pending.values())
        name = f"model-converted-{len(set(written.values())) + 1:05d}.safetensors"
        save_file({k: v.contiguous() for k, v in pending.items()}, str(folder / name), metadata={"format": "pt"})
        written.update(dict.fromkeys(pending, name))
        pending.clear()

    for group in groups:
        full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).cpu() for k, v in group.items()}
        if d.is_main:
            # clone: reverted tensors are views of one stacked tensor, and safetensors refuses shared storage
            pending.update({k: v.clone() for k, v in revert_weight_conversion(model, full).items()})
            if sum(v.numel() * v.element_size() for v in pending.values()) >= max_bytes:
                flush()
    if d.is_main:
        if pending:
            flush()
        index_path = folder / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        index["weight_map"].update(written)
        index["metadata"]["total_size"] += written_bytes
        index_path.write_text(json.dumps(index, indent=2))


# -----------------------------------------------------------------------------------------------
# Metrics
# -----------------------------------------------------------------------------------------------

# Dense bf16 tensor-core peak TFLOP/s per GPU (vendor datasheets), and fp32 (no TF32) peak.
PEAK_TFLOPS = {"H200": (989.0, 67.0), "H100": (989.0, 67.0), "A100": (312.0, 19.5)}


def peak_tflops(cfg: TrainConfig, precision: str) -> float | None:
    if cfg.peak_tflops:
        return cfg.peak_tflops
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, (half, full) in PEAK_TFLOPS.items():
        if key in name:
            return full if precision == "fp32" else half
    return None


def memory_stats(device: torch.device) -> dict[str, float]:
    """GiB. On CUDA the allocator's counters; on CPU the process's resident set (current and peak)."""
    gib = 2**30
    if device.type == "cuda":
        return {
            "mem_curr_alloc_gb": torch.cuda.memory_allocated(device) / gib,
            "mem_peak_alloc_gb": torch.cuda.max_memory_allocated(device) / gib,
            "mem_reserved_gb": torch.cuda.memory_reserved(device) / gib,
        }
    status = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                status[key] = int(value.split()[0]) * 1024 / gib
    return {
        "mem_curr_alloc_gb": status.get("VmRSS", 0.0),
        "mem_peak_alloc_gb": status.get("VmHWM", 0.0),
        "mem_reserved_gb": status.get("VmRSS", 0.0),
    }


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux >= 4.0)


class PhaseTimer:
    """Per-phase times over a logging window. On CUDA, events are recorded and read only at log time,
    so timing adds no host-device sync to the step loop."""

    PHASES = ("data", "forward", "backward", "update")

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        self.host_ms = dict.fromkeys(self.PHASES, 0.0)
        self.events: list[tuple[str, Any, Any]] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.cuda and name != "data":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.events.append((name, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.host_ms[name] += (time.perf_counter() - t0) * 1000

    def averages(self, steps: int) -> dict[str, float]:
        totals = dict(self.host_ms)
        if self.events:
            torch.cuda.synchronize()
            for name, start, end in self.events:
                totals[name] += start.elapsed_time(end)
        return {f"time_{k}_ms": v / max(1, steps) for k, v in totals.items()}


class Metrics:
    """Window accumulators on the device; one sync per log line. Writes stdout, metrics.jsonl, TensorBoard, W&B."""

    def __init__(self, cfg: TrainConfig, d: Dist, bundle: ModelBundle, plan: DataPlan, precision: str):
        self.cfg, self.d = cfg, d
        self.global_batch, self.steps_per_epoch = plan.global_batch, plan.steps_per_epoch
        self.tokens_per_step = plan.global_batch * cfg.seq_length
        self.flops_per_token, self.peak = bundle.flops_per_token, peak_tflops(cfg, precision)
        self.path = cfg.experiment_dir / "metrics.jsonl"
        self.timer = PhaseTimer(d.device)
        self.writer = None
        self.failure: str | None = None  # why metrics.jsonl could not be written (rank 0)
        if d.is_main and cfg.tensorboard == "on":
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(cfg.experiment_dir / "tensorboard"))
        self.wandb_run = start_wandb(cfg) if d.is_main and cfg.wandb == "on" else None
        self.bar = None
        if d.is_main and sys.stderr.isatty():
            from tqdm import tqdm

            # total steps and the ETA (log lines go through bar.write, so they do not tear it)
            self.bar = tqdm(desc="train", unit="step", total=total_steps(cfg, plan), dynamic_ncols=True)
        self._new_window()

    def _new_window(self) -> None:
        self.window_loss = torch.zeros((), device=self.d.device, dtype=torch.float64)
        self.window_steps = self.window_trained = 0
        self.window_start = time.perf_counter()
        self.timer.reset()
        reset_peak_memory(self.d.device)

    def epoch_progress(self, state: TrainState) -> float:
        """Epochs done as a fraction, e.g. 1.25 = a quarter into the second epoch."""
        return round(state.epoch + state.samples_in_epoch / (self.steps_per_epoch * self.global_batch), 4)

    def truncate_after(self, step: int) -> None:
        """On resume, drop lines a killed run wrote after the checkpoint it resumes from, and lines cut short
        (a kill or a full disk while logging). The kept lines go to a new file that replaces the old one, so a
        kill at this moment leaves either file, never an empty one."""
        if not self.d.is_main or not self.path.is_file():
            return
        kept, broken = [], []
        for number, line in enumerate(self.path.read_text(errors="replace").splitlines(keepends=True), 1):
            try:
                record = json.loads(line) if line.endswith("\n") else None
            except ValueError:
                record = None
            if not isinstance(record, dict):
                if line.strip():
                    broken.append(number)
            elif record.get("step", 0) <= step:
                kept.append(line)
        if broken:
            log(f"note: dropped {len(broken)} incomplete line(s) of {self.path} (line {', '.join(map(str, broken))})")
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            with open(tmp, "w") as fh:
                fh.writelines(kept)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise TrainError(
                f"cannot rewrite {self.path} ({exc}); free disk space or fix permissions and rerun"
            ) from exc

    def record(self, local_loss_sum: torch.Tensor, trained_tokens: int, aux_loss: torch.Tensor | None = None) -> None:
        """trained_tokens: the global batch's targets that carry loss (the same number on every rank);
        aux_loss: the step's MoE router loss (weighted; not part of `loss`), or None."""
        self.last_aux = aux_loss
        self.window_loss += local_loss_sum.detach().double()
        self.window_steps += 1
        self.window_trained += trained_tokens
        self.last_loss, self.last_trained = local_loss_sum.detach().double(), trained_tokens
        if self.bar is not None:
            self.bar.update(1)

    def due(self, step: int) -> bool:
        return step % self.cfg.log_freq == 0

    def emit(self, state: TrainState, lr: float, grad_norm: torch.Tensor, guard: BadStepGuard) -> dict:
        # The one host sync of the window: global loss sums across ranks, then .item().
        sums = torch.stack([self.last_loss, self.window_loss]).to(self.d.device)
        dist.all_reduce(sums)
        elapsed = time.perf_counter() - self.window_start
        step_sum, window_sum = sums.tolist()
        record = {
            "step": state.step,
            "epoch": self.epoch_progress(state),
            "loss": step_sum / max(1, self.last_trained),
            "loss_avg": window_sum / max(1, self.window_trained),
            "lr": lr,
            "grad_norm": float(grad_norm.item()),
            "skipped_steps": guard.sync(state),
        }
        record["tokens_per_s"] = self.tokens_per_step * self.window_steps / elapsed  # all tokens, trained or not
        record["trained_tokens"] = self.window_trained
        record["trained_tokens_per_s"] = self.window_trained / elapsed
        record.update(self.timer.averages(self.window_steps))
        record.update(self.memory_over_ranks())
        if self.last_aux is not None:
            aux = self.last_aux.detach().clone()
            dist.all_reduce(aux)
            record["aux_loss"] = aux.item() / self.d.world_size
        if self.peak:
            record["mfu"] = record["tokens_per_s"] * self.flops_per_token / (self.peak * 1e12 * self.d.world_size)
        self.write(record)
        self._new_window()
        return record

    def memory_over_ranks(self) -> dict[str, float]:
        """Each memory figure's maximum over the ranks (the one that runs out first), and rank 0's own."""
        mine = memory_stats(self.d.device)
        figures = torch.tensor(list(mine.values()), dtype=torch.float64)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=self.d.cpu_group)
        return {**dict(zip(mine, figures.tolist())), **{f"{k}_rank0": v for k, v in mine.items()}}

    def validate_base_model(self, model: nn.Module, blocks: PackedBlocks) -> None:
        """Step 0: the loss before any training, so the log shows base vs fine-tuned (--eval-at-start)."""
        self.write({"step": 0, "epoch": 0.0, **evaluate(model, blocks, self.cfg, self.d)})

    def validate_if_due(self, state: TrainState, last_step: int, model: nn.Module, blocks: PackedBlocks | None) -> None:
        """Every --eval-freq steps and at the last step, when there is a validation split."""
        due = state.step == last_step or (self.cfg.eval_freq and state.step % self.cfg.eval_freq == 0)
        if blocks is not None and due:
            result = evaluate(model, blocks, self.cfg, self.d)
            self.write({"step": state.step, "epoch": self.epoch_progress(state), **result})

    def write(self, record: dict) -> None:
        if not self.d.is_main:
            return
        record = {"time": dt.datetime.now().isoformat(timespec="seconds"), **record}
        try:
            fault_point("metrics_write", self.d, record["step"])
            with open(self.path, "a") as fh:
                fh.write(json.dumps(record) + "\n")
        except OSError as exc:  # disk full: the loop stops the run after a checkpoint attempt (see stop_if_failed)
            self.failure = self.failure or f"cannot write {self.path} ({exc}); free disk space and rerun to resume"
        if self.writer is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in ("step", "time"):
                    self.writer.add_scalar(key, value, record["step"])
        if self.wandb_run is not None:  # "step" is logged as the x axis (see start_wandb); W&B keeps its own time
            self.wandb_run.log({k: v for k, v in record.items() if k != "time"})
        message = " ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items() if k != "time"
        )
        if self.bar is not None:
            self.bar.write(message)
        else:
            log(message)

    def stop_if_failed(self) -> None:
        """After the run saved a checkpoint on a write failure: every rank stops with rank 0's message."""
        failure = broadcast_object(self.failure, self.d)
        if failure:
            raise TrainError(failure)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
        if self.bar is not None:
            self.bar.close()


def start_wandb(cfg: TrainConfig) -> Any:
    """Rank 0's Weights & Biases run, with the resolved config (what config.yaml holds).

    Offline unless WANDB_MODE is set (these machines have no internet): files go to outputs/EXP/wandb and
    `wandb sync` uploads them later. The run id is kept in outputs/EXP/wandb/run_id, so a resumed experiment
    continues the same run (resume="allow"). Records are plotted against our "step", not W&B's own step counter:
    a resume logs again the steps after its checkpoint, and W&B drops rows whose own step goes backwards."""
    import uuid

    import wandb

    folder = cfg.experiment_dir / "wandb"
    folder.mkdir(parents=True, exist_ok=True)
    id_file = folder / "run_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else ""
    if not run_id:
        run_id = uuid.uuid4().hex[:12]  # W&B ids: letters and digits; no W&B helper (its home moves between versions)
        id_file.write_text(run_id + "\n")
    try:
        run = wandb.init(
            dir=str(cfg.experiment_dir),  # W&B adds the wandb/ folder itself
            id=run_id,
            resume="allow",
            mode=os.environ.get("WANDB_MODE", "offline"),
            project=os.environ.get("WANDB_PROJECT", "fsdp-train"),
            name=cfg.experiment_name,
            config=dataclasses.asdict(cfg),
            settings=wandb.Settings(console="off"),  # our log lines and the progress bar stay as they are
        )
    except Exception as exc:  # e.g. WANDB_MODE=online without a key or network: one message, not a traceback
        raise TrainError(f"--wandb on: wandb.init failed ({exc}); set WANDB_MODE=offline or use --wandb off") from exc
    run.define_metric("*", step_metric="step")
    return run


def plot_metrics(metrics_path: Path, out_png: Path, title: str) -> None:
    """loss.png: train loss, validation loss and the learning rate by step. Never fails the run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()]
        train = [(r["step"], r["loss"], r["lr"]) for r in rows if "loss" in r]
        val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        if not train and not val:
            return
        fig, ax = plt.subplots(figsize=(7, 4))
        if train:
            ax.plot([t[0] for t in train], [t[1] for t in train], label="train loss (global batch)")
        if val:
            ax.plot(*zip(*val), "o-", label="validation loss")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if train:
            lr_ax = ax.twinx()
            lr_ax.plot([t[0] for t in train], [t[2] for t in train], color="gray", ls=":", label="learning rate")
            lr_ax.set_ylabel("learning rate")
            lr_ax.legend(loc="upper center")
        ax.legend(loc="upper right")
        fig.tight_layout()
        fig.savefig(out_png.with_name(out_png.name + ".tmp.png"), dpi=120)
        plt.close(fig)
        os.replace(out_png.with_name(out_png.name + ".tmp.png"), out_png)
    except Exception as exc:  # noqa: BLE001 - a plot is a convenience; the run's results are in metrics.jsonl
        log(f"could not write {out_png} ({type(exc).__name__}: {exc}); the figures are in {metrics_path}")


# -----------------------------------------------------------------------------------------------
# Train step
# -----------------------------------------------------------------------------------------------


class BadStepGuard:
    """Tracks non-finite steps on the device (no sync per step) and the fp16 dynamic loss scale."""

    def __init__(self, state: TrainState, device: torch.device, precision: str, max_bad_steps: int):
        self.dynamic = precision == "fp16"
        self.max_bad_steps = max_bad_steps
        self.scale = torch.tensor(state.loss_scale if self.dynamic else 1.0, device=device)
        if self.dynamic and state.step == 0:
            self.scale.fill_(2.0**16)
        self.good_steps = torch.tensor(state.scale_good_steps, device=device)
        self.skipped = torch.tensor(state.skipped_steps, device=device)
        self.streak = torch.tensor(state.bad_streak, device=device)
        self.worst_streak = self.streak.clone()

    def update(self, found_inf: torch.Tensor) -> None:
        found_inf = found_inf.to(self.skipped.device)
        self.skipped += found_inf.long()
        self.streak = (self.streak + 1) * found_inf.long()
        self.worst_streak = torch.maximum(self.worst_streak, self.streak)
        if self.dynamic:  # halve on overflow; double after 2000 clean steps (torch.amp.GradScaler's rule)
            self.good_steps = (self.good_steps + 1) * (1 - found_inf.long())
            grow = self.good_steps >= 2000
            self.scale = torch.where(
                found_inf.bool(), self.scale * 0.5, torch.where(grow, self.scale * 2.0, self.scale)
            )
            self.good_steps = torch.where(grow, torch.zeros_like(self.good_steps), self.good_steps)

    def sync(self, state: TrainState) -> int:
        """Copy device counters into the state (a host sync: only at log and checkpoint time); stop if too many."""
        state.skipped_steps, state.bad_streak = int(self.skipped.item()), int(self.streak.item())
        state.loss_scale, state.scale_good_steps = float(self.scale.item()), int(self.good_steps.item())
        worst = int(self.worst_streak.item())
        self.worst_streak = self.streak.clone()
        if worst >= self.max_bad_steps:
            raise TrainError(
                f"{worst} consecutive steps had a non-finite loss or gradient norm (--max-bad-steps "
                f"{self.max_bad_steps}); lower --lr, use --precision bf16/fp32, or check the data"
            )
        return state.skipped_steps


def _test_step_delay_s() -> float:
    """Test hook: FSDP_TRAIN_STEP_DELAY_S slows each step so a test can interrupt a run mid-way."""
    return float(os.environ.get("FSDP_TRAIN_STEP_DELAY_S", "0") or 0)


def _nan_injection_steps() -> set[int]:
    """Test hook: FSDP_TRAIN_NAN_AT_STEPS=3,4 makes the loss of those (1-based) steps NaN on rank 0."""
    raw = os.environ.get("FSDP_TRAIN_NAN_AT_STEPS", "")
    return {int(s) for s in raw.split(",") if s.strip()}


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over the targets that carry loss (label -100 = none), in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")


class ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of `hidden @ weight.T (+ bias)` over the targets that carry loss, computed in chunks of
    tokens so the [tokens x vocab] logits exist one chunk at a time (fp32 within the chunk, as the full path).

    The forward also computes the gradients chunk by chunk (the loss is a scalar, so backward only scales them):
    no logits are kept and none are recomputed. Optional tanh soft-capping (Gemma 2/3) is applied per chunk.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk, softcap):  # type: ignore[override]
        needs_grad = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if needs_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if needs_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and needs_grad[2] else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            h, y = hidden[start : start + chunk], labels[start : start + chunk]
            logits = F.linear(h, weight, bias).float()
            if softcap:
                capped = torch.tanh(logits / softcap)
                logits = capped * softcap
            keep = y != -100
            safe = torch.where(keep, y, 0)
            target_logit = logits.gather(1, safe[:, None]).squeeze(1)
            # Log-sum-exp, then softmax, in place in the chunk's (fresh) logits: one [chunk x vocab] buffer at a time.
            row_max = logits.amax(dim=-1, keepdim=True)
            sum_exp = logits.sub_(row_max).exp_().sum(dim=-1, keepdim=True)
            total += ((row_max.squeeze(1) + sum_exp.log().squeeze(1) - target_logit) * keep).sum()
            if not any(needs_grad):
                continue
            grad = logits.div_(sum_exp)  # d loss / d logits = softmax - onehot, on kept rows
            grad[torch.arange(len(y), device=y.device), safe] -= 1.0
            grad *= keep[:, None]
            if softcap:
                grad *= 1.0 - capped * capped
            grad = grad.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[start : start + chunk] = grad @ weight
            if grad_weight is not None:
                grad_weight += (grad.t() @ h).float()
            if grad_bias is not None:
                grad_bias += grad.float().sum(0)
            del logits, grad  # free this chunk's buffers before the next chunk allocates its own
        ctx.save_for_backward(*(g if g is not None else torch.empty(0) for g in (grad_hidden, grad_weight, grad_bias)))
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        needs = ctx.needs_input_grad
        return (
            grad_hidden * grad_output.to(grad_hidden.dtype) if needs[0] else None,
            (grad_weight * grad_output).to(ctx.dtypes[0]) if needs[1] else None,
            (grad_bias * grad_output).to(ctx.dtypes[1]) if needs[2] and ctx.dtypes[1] is not None else None,
            None,
            None,
            None,
        )


def chunked_loss_sum(
    hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, chunk: int, softcap: float | None
) -> torch.Tensor:
    """Summed cross-entropy of the output head over `hidden` [tokens x dim], chunk tokens at a time."""
    if torch.is_grad_enabled():
        return ChunkedCrossEntropy.apply(hidden, head.weight, head.bias, labels, chunk, softcap)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk):
        logits = head(hidden[start : start + chunk]).float()
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        total += F.cross_entropy(logits, labels[start : start + chunk], ignore_index=-100, reduction="sum")
    return total


def _load_balancing_fn(model: nn.Module) -> Any:
    """The load_balancing_loss_func of the model's own modeling module (Mixtral, Qwen2/3-MoE, OLMoE, ...)."""
    return getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)


def moe_aux_loss(model: nn.Module, outputs: Any) -> torch.Tensor | None:
    """The router loss transformers' CausalLM forward adds, computed from the base model's router logits."""
    aux = _load_balancing_fn(model)(outputs.router_logits, model.num_experts, model.num_experts_per_tok, None)
    return router_aux_loss(SimpleNamespace(aux_loss=aux), model.config)


# Config attributes that rescale a model's logits after its output head: the chunked loss cannot know how.
LOGIT_POSTPROCESSING = ("logit_scale", "logits_scaling", "output_multiplier_scale", "lm_head_multiplier")


def chunked_loss_problem(model: nn.Module) -> str | None:
    """Why the chunked loss cannot reproduce this model's logits, or None when it can."""
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        return f"its output head is a {type(head).__name__}, not a Linear layer"
    if model.base_model is model:
        return "it has no separate base model to take hidden states from"
    if router_forward_kwargs(model.config) and not (
        _load_balancing_fn(model) and hasattr(model, "num_experts") and hasattr(model, "num_experts_per_tok")
    ):
        return "its router loss is computed in a way only its own forward knows"
    found = [a for a in LOGIT_POSTPROCESSING if getattr(model.config, a, None) not in (None, 1, 1.0)]
    return f"its config rescales logits ({', '.join(found)})" if found else None


class CausalLMLoss(nn.Module):
    """The training forward: the decoder, then output head and loss together, in chunks of --loss-chunk-tokens
    tokens, so the [tokens x vocab] logits and their gradient never exist in full. This module is the FSDP
    root, so the head's weight stays gathered from the decoder's output to the end of the loss.
    With chunk 0 (or a model whose head the chunked path cannot reproduce) the model's own logits are used."""

    def __init__(self, model: nn.Module, chunk_tokens: int):
        super().__init__()
        self.model = model
        self.chunk = chunk_tokens
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        self.router_kwargs = router_forward_kwargs(model.config)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(summed token loss, the MoE router loss weighted by router_aux_loss_coef or None)."""
        inputs = {"input_ids": batch.input_ids, "position_ids": batch.position_ids, **self.router_kwargs}
        if not self.chunk:
            outputs = self.model(**inputs)
            return token_loss_sum(outputs.logits, batch.labels), router_aux_loss(outputs, self.model.config)
        outputs = self.model.base_model(**inputs)
        head = self.model.get_output_embeddings()
        hidden = outputs.last_hidden_state.flatten(0, 1)
        loss = chunked_loss_sum(hidden, head, batch.labels.flatten(), self.chunk, self.softcap)
        return loss, (moe_aux_loss(self.model, outputs) if self.router_kwargs else None)


def forward_backward(
    train_forward: nn.Module,
    micro_batches: list[Batch],
    trained_tokens: int,
    guard: BadStepGuard,
    d: Dist,
    timer: PhaseTimer,
    poison: bool,
    sync_last_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the micro-batches; gradients end up as those of the mean loss over every trained target token of the
    global batch (all micro-batches, all ranks), plus the MoE router loss where the model has one.
    Returns this rank's summed loss and its mean weighted router loss, or None (no sync)."""
    # FSDP averages gradients over the data-parallel ranks, so each rank scales its token sum by world/tokens;
    # trained_tokens is the global batch's count, known on every rank from the data plan.
    loss_scale = d.world_size / max(1, trained_tokens)
    local_sum = torch.zeros((), device=d.device)
    aux_sum = None
    for i, batch in enumerate(micro_batches):
        if sync_last_only:  # --accum-grad-sync last: gradients stay unsharded until the last micro-batch
            train_forward.set_requires_gradient_sync(i == len(micro_batches) - 1)
        with timer.phase("data"):
            batch = batch.to(d.device)
        with timer.phase("forward"):
            loss_sum, aux = train_forward(batch)
            if poison:
                loss_sum = loss_sum * float("nan")
        with timer.phase("backward"):
            objective = loss_sum * loss_scale
            if aux is not None:  # like HF's mean loss + coef * aux: averaged over micro-batches (and, by FSDP, ranks)
                objective = objective + aux / len(micro_batches)
                aux_sum = aux.detach() / len(micro_batches) + (0 if aux_sum is None else aux_sum)
            (objective * guard.scale).backward()
        local_sum += loss_sum.detach()
    return local_sum, aux_sum


def router_forward_kwargs(model_config: Any) -> dict[str, bool]:
    """MoE models compute their router load-balancing loss only when asked for the router logits."""
    has_aux = getattr(model_config, "router_aux_loss_coef", 0) and hasattr(model_config, "output_router_logits")
    return {"output_router_logits": True} if has_aux else {}


def router_aux_loss(outputs: Any, model_config: Any) -> torch.Tensor | None:
    """The config's router_aux_loss_coef times the model's load-balancing loss; None for models without one."""
    aux = getattr(outputs, "aux_loss", None)
    coef = getattr(model_config, "router_aux_loss_coef", 0)
    return None if aux is None or not coef else coef * aux


def optimizer_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, guard: BadStepGuard, cfg: TrainConfig, lr: float
) -> torch.Tensor:
    """Unscale, clip by the global norm across shards, and step, unless the norm is non-finite.

    The skip is decided on the device (fused AdamW's found_inf), so no host sync is needed here.
    Returns the global gradient norm (device tensor)."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()  # all-reduce of the per-shard norms: the norm of the whole model
    norm = norm / guard.scale.to(norm.device)
    found_inf = (~torch.isfinite(norm)).float()
    coef = 1.0 / guard.scale.to(norm.device)
    if cfg.grad_clip > 0:
        coef = coef * torch.clamp(cfg.grad_clip / (norm + 1e-6), max=1.0)
    local_grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    torch._foreach_mul_(local_grads, coef.to(local_grads[0].device))
    for group in optimizer.param_groups:
        group["lr"] = lr
    if optimizer.defaults.get("fused"):
        optimizer.found_inf = found_inf.to(local_grads[0].device)  # fused AdamW skips the update on device
        optimizer.step()
    elif not bool(found_inf.item()):  # sync: non-fused AdamW cannot skip on device
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    guard.update(found_inf)
    return norm


@torch.no_grad()
def evaluate(train_forward: nn.Module, blocks: PackedBlocks, cfg: TrainConfig, d: Dist) -> dict[str, float]:
    """Validation loss weighted by trained target tokens. Every rank runs the same number of micro-batches (padded with
    weight-0 blocks) because FSDP's forward all-gathers must line up across ranks."""
    train_forward.eval()
    count = len(blocks) if not cfg.eval_max_blocks else min(len(blocks), cfg.eval_max_blocks)
    mine = list(range(d.rank, count, d.world_size))
    steps = math.ceil(math.ceil(count / d.world_size) / cfg.batch_size)
    totals = torch.zeros(2, device=d.device, dtype=torch.float64)  # loss sum, tokens
    for i in range(steps):
        idx = mine[i * cfg.batch_size : (i + 1) * cfg.batch_size]
        real = len(idx)
        idx = idx + [0] * (cfg.batch_size - real)
        batch = blocks.gather(idx).to(d.device)
        batch.labels[real:] = -100  # padding blocks count for nothing
        totals[0] += train_forward(batch)[0].double()
        totals[1] += (batch.labels != -100).sum()
    dist.all_reduce(totals)
    train_forward.train()
    loss = (totals[0] / totals[1]).item() if totals[1] > 0 else float("nan")
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)), "val_tokens": int(totals[1].item())}


# -----------------------------------------------------------------------------------------------
# main()
# -----------------------------------------------------------------------------------------------


# -- one run per experiment ------------------------------------------------------------------------

LOCK_FILE = "run.lock"
LOCK_REFRESH_S = 30.0  # the holder touches its lock file this often...
LOCK_STALE_S = 600.0  # ...so a lock from another host that nobody touched for this long belongs to a dead run


class ExperimentLockedError(TrainError):
    pass


def _process_start_ticks(pid: int) -> str | None:
    """When a process started (field 22 of /proc/PID/stat); None if it is gone or a zombie. A pid reused by
    an unrelated process has another start time."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _process_alive(pid: int, start_ticks: str | None) -> bool:
    if Path("/proc/self/stat").is_file():
        ticks = _process_start_ticks(pid)
        return ticks is not None and (start_ticks is None or ticks == start_ticks)
    try:  # no procfs (macOS): existence only
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class ExperimentLock:
    """One run per experiment: `outputs/EXP/run.lock` names the holder (host, pid, start time).

    It is created complete under a private name and hard-linked into place: link() fails if the lock exists,
    atomically, also on NFS and the parallel filesystems of a cluster. A lock whose holder is gone is taken over
    with a message: on this host when the process no longer exists, from another host when the holder stopped
    refreshing it for LOCK_STALE_S. Global rank 0 holds it for the whole run and removes it on exit."""

    def __init__(self, experiment_dir: Path):
        self.path = experiment_dir / LOCK_FILE
        self.record: dict | None = None
        self._stop_refresh = threading.Event()

    def _read(self, path: Path | None = None) -> dict | None:
        try:
            holder = json.loads((path or self.path).read_text())
        except (OSError, ValueError):
            return None
        return holder if isinstance(holder, dict) and isinstance(holder.get("pid"), int) else None

    def _alive(self, holder: dict) -> bool:
        if holder.get("host") == socket.gethostname():
            return _process_alive(holder["pid"], holder.get("process_start"))
        with contextlib.suppress(OSError):
            return time.time() - self.path.stat().st_mtime < LOCK_STALE_S
        return False

    def _held_message(self, holder: dict) -> str:
        return (
            f"experiment {self.path.parent} is in use by another run: host {holder.get('host')}, pid "
            f"{holder['pid']}, started {holder.get('started_at')} (lock file {self.path}). Wait for that run to "
            f"finish or stop it, or use another --experiment-name. If that process is really gone (e.g. its node "
            f"died), delete {self.path}."
        )

    def check_free(self) -> None:
        holder = self._read()
        if holder is not None and self._alive(holder):
            raise ExperimentLockedError(self._held_message(holder))

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "process_start": _process_start_ticks(os.getpid()),
            "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv),
        }
        mine = self.path.with_name(f".{LOCK_FILE}.{self.record['host']}.{os.getpid()}")
        mine.write_text(json.dumps(self.record))
        try:
            for _ in range(3):
                try:
                    os.link(mine, self.path)
                    break
                except FileExistsError:
                    self._take_over_if_stale()
            else:
                raise ExperimentLockedError(f"could not take {self.path}: other launches keep racing for it")
        finally:
            mine.unlink(missing_ok=True)
        threading.Thread(target=self._refresh, name="experiment-lock", daemon=True).start()

    def _take_over_if_stale(self) -> None:
        holder = self._read()
        if holder is not None and self._alive(holder):
            raise ExperimentLockedError(self._held_message(holder))
        stale = self.path.with_name(f".{LOCK_FILE}.stale.{socket.gethostname()}.{os.getpid()}")
        try:
            os.rename(self.path, stale)
        except FileNotFoundError:
            return  # another launch removed it first; try again
        if self._read(stale) != holder:  # a live run took the lock between our read and the rename: give it back
            with contextlib.suppress(FileExistsError):
                os.link(stale, self.path)
        else:
            what = (
                f"host {holder.get('host')}, pid {holder['pid']}, started {holder.get('started_at')}"
                if holder
                else "unreadable"
            )
            log(f"taking over the lock of a run that is gone ({what}): {self.path}")
        stale.unlink(missing_ok=True)

    def _refresh(self) -> None:
        while not self._stop_refresh.wait(LOCK_REFRESH_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        self._stop_refresh.set()
        if self.record is not None and self._read() == self.record:
            self.path.unlink(missing_ok=True)
        self.record = None


# -- reporting errors ------------------------------------------------------------------------------

ERROR_GRACE_S = 15.0  # how long a rank other than 0 leaves the report of an error to rank 0


def report_error(message: str, exit_code: int) -> int:
    """One clear message from one rank; returns the exit code.

    An error every rank hits is reported by rank 0 alone: the other ranks wait to be stopped by torchrun,
    which ends every worker as soon as one fails; only an error rank 0 did not hit outlives the wait and is
    reported by the rank that hit it. Under torchrun the message also goes into the worker's error file
    (TORCHELASTIC_ERROR_FILE), which torchrun prints last, as the root cause, instead of "To enable traceback"."""
    if _RANK_FOR_LOGS != 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # StopRequest turned SIGTERM into a flag; now it must end us
        time.sleep(ERROR_GRACE_S)
    log(f"ERROR: {message}", all_ranks=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with contextlib.suppress(OSError):  # the format torch.distributed.elastic's ErrorHandler writes
            extra = {"py_callstack": message, "timestamp": str(int(time.time()))}
            Path(error_file).write_text(json.dumps({"message": {"message": message, "extraInfo": extra}}))
    return exit_code


# -- workers end with their launcher -------------------------------------------------------------

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_launcher() -> None:
    """A worker started by torchrun ends within seconds when torchrun itself dies (kill -9, the OOM killer):
    orphans would otherwise keep training unattended, beside the rerun. Linux sends SIGKILL the moment the
    parent dies (PR_SET_PDEATHSIG); a watchdog thread polling the parent pid covers other systems. Being killed
    never leaves a partial checkpoint: a save only becomes a step_N folder by its final atomic rename."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # not under torchrun: the user's shell is no launcher to follow
        return
    launcher = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    threading.Thread(target=_watch_launcher, args=(launcher,), name="launcher-watchdog", daemon=True).start()


def _watch_launcher(launcher: int) -> None:
    while os.getppid() == launcher:
        time.sleep(1.0)
    log(f"the launcher (torchrun, pid {launcher}) is gone: stopping this worker", all_ranks=True)
    os.kill(os.getpid(), signal.SIGKILL)


class StopRequest:
    """SIGTERM/SIGINT only set a flag; the ranks agree on it at the next step boundary, save and exit 0."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C means now
        self.requested = True
        log(f"received {signal.Signals(signum).name}: will checkpoint at the end of this step and exit", all_ranks=True)


def config_fingerprint(config: Any) -> str:
    """The model's architecture settings; not the library version that wrote them, nor the load dtype."""
    settings = {k: v for k, v in config.to_dict().items() if k not in ("transformers_version", "dtype", "torch_dtype")}
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def total_steps(cfg: TrainConfig, plan: DataPlan) -> int:
    steps = plan.steps_per_epoch * cfg.num_epochs
    return min(steps, cfg.max_steps) if cfg.max_steps else steps


def dry_run(cfg: TrainConfig, world_size: int) -> int:
    from model_download import format_memory_plan, training_memory_plan

    model_dir = resolve_model_dir(cfg.model_name)
    model = build_model_skeleton(model_dir, cfg.attn_implementation, cfg.document_masking == "on")
    layers = find_decoder_layers(model)
    num_params = sum(p.numel() for p in model.parameters())
    per_layer = sum(p.numel() for p in layers[0].parameters())
    log("resolved config:\n" + yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False).rstrip())
    log(f"model {type(model).__name__} from {model_dir}: {num_params:,} parameters")
    log(
        f"sharding plan: {len(layers)} x {type(layers[0]).__name__} ({per_layer:,} params each) each its own FSDP "
        f"unit, plus the root unit ({num_params - per_layer * len(layers):,} params: embeddings, final norm, head); "
        f"--sharding {cfg.sharding} over {world_size} processes, cpu offload {cfg.cpu_offload}, activation "
        f"checkpointing {cfg.activation_checkpointing} (every {cfg.ac_every_n_layers} layer(s))"
    )
    sizes = sorted({1, 2, 4, 8, world_size})
    rows = training_memory_plan(
        num_params, world_sizes=sizes, largest_unit_params=max(per_layer, num_params - per_layer * len(layers))
    )
    log(f"per-rank memory estimate (this run: {world_size} processes):\n" + format_memory_plan(rows))
    log("dry run: nothing was trained")
    return 0


def run(cfg: TrainConfig) -> int:
    precision = resolve_precision(cfg)
    d = setup_distributed(cfg)
    stop = StopRequest()
    seed_everything(cfg.seed + d.rank)
    if d.is_main:
        cfg.experiment_dir.mkdir(parents=True, exist_ok=True)
        (cfg.experiment_dir / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    model_dir = resolve_model_dir(cfg.model_name)
    data = build_data(cfg, model_dir, d)
    bundle = build_model(cfg, precision, d)
    optimizer = build_optimizer(bundle.model, cfg)
    fingerprint = {
        "model": config_fingerprint(bundle.config),
        "dataset": data.dataset_fingerprint,
        "seq_length": cfg.seq_length,
        "global_batch_size": data.train.global_batch,
        "seed": cfg.seed,
        "tokenizer": data.tokenizer_hash,
        "data_format": data.data_format,
    }
    checkpointer = Checkpointer(cfg, d, fingerprint)
    latest = checkpointer.latest_complete()
    state = TrainState()
    if latest is not None:
        state = checkpointer.load(latest, bundle.model, None if cfg.export_only else optimizer)
        log(
            f"resumed from {latest} at step {state.step} (epoch {state.epoch}, {state.samples_in_epoch} samples "
            f"into the epoch)"
        )
    elif cfg.export_only:
        raise CheckpointError(f"--export-only: no complete checkpoint in {checkpointer.root}")
    if cfg.export_only:
        export_hf_model(bundle, data.tokenizer, cfg.experiment_dir / "final", d)
        return 0
    metrics = Metrics(cfg, d, bundle, data.train, precision)
    if metrics.bar is not None:
        metrics.bar.update(state.step)  # a resumed run's bar starts where it resumes
    metrics.truncate_after(state.step if state.step else -1)  # a start from scratch keeps no line, not even step 0
    try:
        finished = train_loop(cfg, d, bundle, data, optimizer, checkpointer, metrics, state, stop)
    finally:
        metrics.close()
        if d.is_main:
            plot_metrics(metrics.path, cfg.experiment_dir / "loss.png", cfg.experiment_name)
    if finished:
        export_hf_model(bundle, data.tokenizer, cfg.experiment_dir / "final", d)
    return 0


def train_loop(
    cfg: TrainConfig,
    d: Dist,
    bundle: ModelBundle,
    data: TrainData,
    optimizer: torch.optim.Optimizer,
    checkpointer: Checkpointer,
    metrics: Metrics,
    state: TrainState,
    stop: StopRequest,
) -> bool:
    """Returns True when training ran to the end, False when it stopped on a signal (after saving)."""
    plan, last_step = data.train, total_steps(cfg, data.train)
    guard = BadStepGuard(state, d.device, resolve_precision(cfg), cfg.max_bad_steps)
    nan_steps, delay_s = _nan_injection_steps(), _test_step_delay_s()
    prefetch = Prefetcher(plan, pin=d.device.type == "cuda")
    sync_last_only = cfg.accum_grad_sync == "last" and cfg.grad_accum_steps > 1
    if state.step >= last_step:
        log(f"training already reached step {last_step}; nothing to train (raise --max-steps or --num-epochs to go on)")
    else:
        log(f"training steps {state.step + 1}..{last_step} ({plan.steps_per_epoch} per epoch)")
    if state.step == 0 and cfg.eval_at_start == "on" and data.validation is not None:
        metrics.validate_base_model(bundle.train_forward, data.validation)
    grad_norm = torch.zeros(())
    while state.step < last_step:
        with metrics.timer.phase("data"):
            micro_batches, trained = prefetch.get(state.epoch, state.samples_in_epoch // plan.global_batch)
        poison = (state.step + 1) in nan_steps and d.rank == 0
        loss_sum, aux_loss = forward_backward(
            bundle.train_forward, micro_batches, trained, guard, d, metrics.timer, poison, sync_last_only
        )
        lr = lr_at(state.step, cfg, last_step)
        with metrics.timer.phase("update"):
            grad_norm = optimizer_step(bundle.model, optimizer, guard, cfg, lr)
        state.advance(plan.global_batch, plan.steps_per_epoch)
        if delay_s:
            time.sleep(delay_s)
        metrics.record(loss_sum, trained, aux_loss)
        if metrics.due(state.step) or state.step == last_step:
            metrics.emit(state, lr, grad_norm, guard)
        metrics.validate_if_due(state, last_step, bundle.train_forward, data.validation)
        interrupted = all_ranks_agree(stop.requested or metrics.failure is not None, d)
        if interrupted or checkpointer.due(state.step):
            guard.sync(state)
            checkpointer.save(bundle.model, optimizer, state, "signal" if interrupted else "periodic")
        if interrupted:
            checkpointer.finish_pending()
            metrics.stop_if_failed()
            log(f"stopped at step {state.step} on request; rerun the same command to resume")
            return False
    guard.sync(state)
    checkpointer.save(bundle.model, optimizer, state, "final")
    checkpointer.finish_pending()
    return True


def main(argv: list[str] | None = None) -> int:
    die_with_launcher()
    try:
        cfg = load_config(argv)
        lock = ExperimentLock(cfg.experiment_dir)
        if _RANK_FOR_LOGS == 0:  # the other ranks would see rank 0's own lock; torchrun stops them if rank 0 exits
            lock.check_free()  # a launch on a busy experiment fails in seconds, before the slower validation
        problems = validate_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        if problems:
            raise ConfigError(problems)
    except ConfigError as exc:
        return report_error(str(exc), 2)
    except ExperimentLockedError as exc:
        return report_error(str(exc), 1)
    try:
        if cfg.dry_run:
            return dry_run(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        if _RANK_FOR_LOGS == 0:  # before any process group, so a refused launch touches nothing
            lock.acquire()
        return run(cfg)
    except (TrainError, FileNotFoundError) as exc:
        return report_error(str(exc), 1)
    finally:
        lock.release()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(main)())  # record: an unexpected exception becomes torchrun's root cause, not "see docs"
