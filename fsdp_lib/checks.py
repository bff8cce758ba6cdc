"""Validating a run's settings before any process group or model exists: validate_config collects every problem,
each naming its flag and the fix, in a fixed order (fsdp_train.py raises them as one ConfigError). The checks that
need the model itself (adapter targets, a QLoRA base) are fsdp_lib.model.build's."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import torch

from fsdp_lib.arguments import parse_data_slice, parse_data_weights, parse_profile_steps
from fsdp_lib.config import (
    LORA_FLAGS,
    TrainConfig,
    saved_settings,
)
from fsdp_lib.context_degree import context_problems
from fsdp_lib.errors import file_above, not_utf8, unreadable
from fsdp_lib.experiment_dir import experiment_dir_problems, resume_refusal
from fsdp_lib.markers import TOKEN_CACHE, WHOLE_FOLDER_KINDS, enclosing_folder, folder_kind, step_dirs
from fsdp_lib.objective_flags import PREFERENCE_OBJECTIVES, changed_flags, grpo_problems, need, preference_problems
from fsdp_lib.offline import hub_dataset_snapshot, is_hub_dataset_id, resolve_model_dir


def launch_world(cfg: TrainConfig) -> int:
    """The processes of this launch: torchrun's WORLD_SIZE, else 1. A --dry-run outside torchrun with
    --context-parallel N plans the smallest launch that runs it, N processes (WORLD_SIZE=32 plans 32)."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return max(1, cfg.context_parallel) if cfg.dry_run else 1


def validate_config(cfg: TrainConfig, world_size: int) -> list[str]:
    """Check everything that can be checked before any process group or model exists."""
    problems = _launcher_problems(cfg) + _flag_problems(cfg, world_size)
    return problems + _non_finite_problems(cfg, problems)


def _launcher_problems(cfg: TrainConfig) -> list[str]:
    """torchrun's variables set in part, by hand or left in a shell: WORLD_SIZE=2 alone trained as one process with
    the accumulation of two (half the global batch asked for); RANK alone, or without MASTER_ADDR, a traceback. A
    --dry-run takes WORLD_SIZE alone as the launch it plans."""
    env = os.environ
    if cfg.dry_run and "RANK" not in env:
        return []
    if ("RANK" in env) != ("WORLD_SIZE" in env):
        given, lacking = ("RANK", "WORLD_SIZE") if "RANK" in env else ("WORLD_SIZE", "RANK")
        return [
            f"{given}={env[given]} is set but {lacking} is not: torchrun sets both (and MASTER_ADDR, MASTER_PORT); "
            f"launch with torchrun, or unset {given} to run one process"
        ]
    if "RANK" in env and (missing := [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in env]):
        return [
            f"RANK and WORLD_SIZE are set but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: "
            "torchrun sets them all; launch with torchrun, or unset RANK and WORLD_SIZE to run one process"
        ]
    return []


def _flag_problems(cfg: TrainConfig, world_size: int) -> list[str]:
    if cfg.export_only and cfg.experiment_name and not step_dirs(cfg.experiment_dir / "checkpoint"):
        return [  # the one thing to say: without a run, the flags an export would also need are beside the point
            f"--export-only: {cfg.experiment_dir / 'checkpoint'} holds no checkpoint, so there is nothing to export; "
            "check --experiment-name/-e and --save-dir (those of the run that trained it)"
        ]
    problems = _required_problems(cfg) + _range_problems(cfg) + _value_problems(cfg)
    problems += _device_problems(cfg, world_size)
    problems += _peft_problems(cfg)
    if cfg.model_name:
        problems += _model_problems(cfg)
    if cfg.export_only:  # nothing trains and no dataset is read: data, objective and batch settings change nothing
        return problems  # (--chat-template is checked where the checkpoint says the run used one: export_tokenizer)
    if cfg.chat_template:
        problems += chat_template_problems(Path(cfg.chat_template))
    problems += preference_problems(cfg)
    problems += grpo_problems(cfg)
    problems += context_problems(cfg, world_size)
    problems += _batch_problems(cfg, world_size // max(1, cfg.context_parallel))
    # what the checkpoint's flags alone show, before data or model; the process count under torchrun, or of a run
    # without it (one process); a --dry-run without torchrun would compare one process's global batch with the run's
    problems += resume_refusal(cfg, world_size if "WORLD_SIZE" in os.environ or not cfg.dry_run else None)
    if cfg.data_slice and parse_data_slice(cfg.data_slice) is None:
        problems.append(
            f"--data-slice {cfg.data_slice!r}: expected START:END with whole numbers, e.g. 0:50000 or 1000:"
        )
    if cfg.profile_steps and parse_profile_steps(cfg.profile_steps) is None:
        problems.append(
            f"--profile-steps {cfg.profile_steps!r}: expected START:END, optimizer steps counted from 1 with "
            "START <= END, e.g. 5:6"
        )
    if cfg.wandb == "on":
        problems += _wandb_problems()
    for name in cfg.dataset_name:
        problems += _dataset_problems(name)
    return problems + _mixture_problems(cfg)


def _input_file_problems(flag: str, path: Path, what: str) -> list[str]:
    """A file the run reads: it exists, is a file (not a folder) and is UTF-8 text."""
    if path.is_dir():
        return [f"{flag} {path}: a folder, not a file ({what})"]
    if not path.is_file():
        return [f"{flag} {path}: no such file ({what})"]
    return _text_file_problems(flag, path)


def chat_template_problems(path: Path) -> list[str]:
    """--chat-template: a UTF-8 file that Jinja parses (a syntax error would otherwise surface at the first record,
    or never on a text dataset, and be exported with the tokenizer)."""
    problems = _input_file_problems("--chat-template", path, "a Jinja chat template")
    if problems:
        return problems
    if not path.read_text(encoding="utf-8").strip():
        return [f"--chat-template {path}: the file is empty; write the Jinja chat template in it"]
    import jinja2

    try:  # transformers' own environment ({% generation %}, loop controls); private, so its absence skips the check
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return []
    try:
        _compile_jinja_template(path.read_text(encoding="utf-8"))
    except jinja2.TemplateSyntaxError as exc:
        return [f"--chat-template {path}: not a valid Jinja template (line {exc.lineno}: {exc.message}); fix it"]
    return []


def conversation_prompts(path: str | Path) -> bool:
    """Whether --sample-prompts FILE holds conversations, one per line (a .jsonl file, in any case), rendered with
    the chat template; else one plain prompt per line."""
    return Path(path).suffix.lower() == ".jsonl"


def _sample_prompts_problems(path: Path) -> list[str]:
    """--sample-prompts: a UTF-8 file with at least one prompt (blank lines do not count); one whose lines all read
    as conversations (JSON lists of messages, or {"messages": ...}) must be named .jsonl, or each would be
    prompted as its JSON text."""
    problems = _input_file_problems("--sample-prompts", path, "one prompt per line, or .jsonl")
    if problems:
        return problems
    lines = [line for line in path.read_text(encoding="utf-8-sig").splitlines() if line.strip()]
    if not lines:
        problems.append(f"--sample-prompts {path}: the file holds no prompt; write one prompt per line")
    elif not conversation_prompts(path) and all(map(_reads_as_conversation, lines[:50])):
        problems.append(
            f"--sample-prompts {path}: its lines are conversations (JSON), but only a .jsonl file is read as "
            "conversations and rendered with the chat template (this one would be prompted with its JSON text); "
            "rename it to .jsonl"
        )
    return problems


def _reads_as_conversation(line: str) -> bool:
    try:
        value = json.loads(line)
    except ValueError:
        return False
    turns = value.get("messages") if isinstance(value, dict) else value
    return isinstance(turns, list) and bool(turns) and all(isinstance(turn, dict) for turn in turns)


def _text_file_problems(flag: str, path: Path) -> list[str]:
    """A file the run reads as text must be UTF-8 (read here once, before any process group, to say so plainly)."""
    try:
        path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        return [f"{flag} {path}: {not_utf8(exc)}; save it as UTF-8"]
    except OSError as exc:
        return [f"{flag} {path}: cannot be read ({exc.strerror})"]
    return []


def _saved_model_hint(cfg: TrainConfig) -> str:
    """Where an --export-only looked for the run's model: the experiment's config.yaml."""
    if not (cfg.export_only and cfg.experiment_name):
        return ""
    saved, path = saved_settings(cfg.experiment_dir)
    if saved:
        return f" ({path} names none)"
    if path.is_file():
        return f" ({path} cannot be read as YAML settings, and no checkpoint keeps a copy of them)"
    return f" (no {path} to take it from)"


def _required_problems(cfg: TrainConfig) -> list[str]:
    """-e, -d and -m are given, and -e names a folder, not a path."""
    problems: list[str] = []
    for flag, value in (
        ("--experiment-name/-e", cfg.experiment_name),
        ("--dataset-name/-d", cfg.dataset_name or cfg.export_only),  # an export reads no dataset
        ("--model-name/-m", cfg.model_name),
    ):
        if not value:
            problems.append(f"{flag} is required{_saved_model_hint(cfg) if flag.startswith('--model') else ''}")
    if cfg.experiment_name and (os.sep in cfg.experiment_name or cfg.experiment_name in (".", "..")):
        problems.append(f"--experiment-name '{cfg.experiment_name}' must be a plain folder name, not a path")
    elif not cfg.experiment_name.isprintable():
        problems.append(
            f"--experiment-name {cfg.experiment_name!r} holds a control character (a newline or tab pasted with it?); "
            "choose a plain name"
        )
    elif cfg.experiment_name.startswith("."):  # .token_cache and the tools' temporaries live beside experiments
        problems.append(
            f"--experiment-name '{cfg.experiment_name}': names starting with '.' are the project's own folders under "
            f"--save-dir ({TOKEN_CACHE}, temporaries); choose a plain name"
        )
    elif cfg.experiment_name:
        problems += experiment_dir_problems(cfg)
    return problems + _save_dir_problems(cfg.save_dir)


def _save_dir_problems(value: str) -> list[str]:
    """--save-dir holds experiments (and the token cache): not a file, not a folder of another kind, which a run
    would fill with checkpoints, and not inside one, whose tool replaces or prunes it whole."""
    if not value.strip():  # Path("") is the current folder: experiments and the token cache went there
        return ["--save-dir is empty (an unset shell variable?); give the folder for the experiments (default outputs)"]
    save_dir = Path(value)
    if inside := enclosing_folder(save_dir, WHOLE_FOLDER_KINDS):
        return [f"--save-dir {save_dir} is {inside}, whose tool would delete or misread it; choose a folder of its own"]
    if save_dir.exists() and not save_dir.is_dir():
        return [f"--save-dir {save_dir}: a file, not a folder; choose a folder for the experiments (default outputs)"]
    if blocker := file_above(save_dir):
        return [f"--save-dir {save_dir}: {blocker} is a file; choose a folder for the experiments"]
    kind = folder_kind(save_dir)
    if kind is not None:
        return [
            f"--save-dir {kind.describe(save_dir)}; experiments go under a folder of their own: choose another "
            "--save-dir (default outputs)"
        ]
    return []


def _range_problems(cfg: TrainConfig) -> list[str]:
    """Counts that must be at least 1, and amounts that must not be negative."""
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
        "--init-timeout-s": cfg.init_timeout_s,
        "--sample-max-new-tokens": cfg.sample_max_new_tokens,
    }
    problems = [f"{flag} must be at least 1 (got {value})" for flag, value in positive.items() if value < 1]
    if cfg.tiled_mlp < 0 or cfg.tiled_mlp == 1:
        problems.append(f"--tiled-mlp {cfg.tiled_mlp}: give the number of tiles, 2 or more (0 = off)")
    non_negative = {
        "--max-steps": cfg.max_steps,
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
    return problems


def _non_finite_problems(cfg: TrainConfig, problems: list[str]) -> list[str]:
    """NaN passes every comparison (--min-lr nan trained NaN weights and exported them with exit 0), inf most:
    each number flag that no other problem names already."""
    found = []
    for f in dataclasses.fields(TrainConfig):
        flag, value = "--" + f.name.replace("_", "-"), getattr(cfg, f.name)
        if (
            isinstance(value, float)
            and not math.isfinite(value)
            and not any(p.startswith(f"{flag} ") for p in problems)
        ):
            found.append(f"{flag} must be a finite number (got {value})")
    return found


def _value_problems(cfg: TrainConfig) -> list[str]:
    """Values a flag's type cannot check: choices given in --config, the loss chunk, the prompts file, fractions and
    the learning rates."""
    problems: list[str] = []
    for f in dataclasses.fields(TrainConfig):  # argparse checks choices on the command line; this covers --config
        choices = f.metadata.get("choices")
        if choices and getattr(cfg, f.name) not in choices:
            flag = "--" + f.name.replace("_", "-")
            problems.append(f"{flag} {getattr(cfg, f.name)!r} is not one of {', '.join(choices)}")
    if cfg.loss_chunk_tokens != "auto" and not str(cfg.loss_chunk_tokens).strip().isdigit():
        problems.append(
            f"--loss-chunk-tokens {cfg.loss_chunk_tokens!r}: expected auto or a whole number of tokens (0 = full logits)"
        )
    if cfg.sample_prompts and not cfg.export_only:  # an export reads no prompts
        problems += _sample_prompts_problems(Path(cfg.sample_prompts))
    if not 0.0 <= cfg.max_skipped_fraction <= 1.0:
        problems.append(f"--max-skipped-fraction must be between 0 and 1 (got {cfg.max_skipped_fraction})")
    if not cfg.lr > 0 or not math.isfinite(cfg.lr):
        problems.append(f"--lr must be a positive number (got {cfg.lr})")
    elif cfg.min_lr > cfg.lr:
        problems.append(f"--min-lr {cfg.min_lr} is above --lr {cfg.lr}; lower --min-lr")
    return problems


def _device_problems(cfg: TrainConfig, world_size: int) -> list[str]:
    """fp16 needs CUDA; --sharding hybrid needs shard groups that divide the world (and no QLoRA across them)."""
    problems: list[str] = []
    if cfg.precision == "fp16" and not torch.cuda.is_available():
        problems.append(
            "--precision fp16 needs a CUDA GPU (CPU fp16 kernels are slow and incomplete); use fp32 or bf16"
        )
    if cfg.fp8 != "off":
        problems += _float8_problems(cfg)
    if cfg.sharding == "hybrid":
        shard = cfg.hybrid_shard_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if shard < 1 or world_size % shard:
            problems.append(
                f"--sharding hybrid: world size {world_size} is not a multiple of the shard group size "
                f"{shard}; set --hybrid-shard-size to a divisor of {world_size}"
            )
        if cfg.peft == "qlora" and shard > 1:  # NF4's all-gather asks the mesh for one group; a 2-D mesh has two
            problems.append(
                f"--peft qlora with --sharding hybrid (shard groups of {shard}): torchao's NF4 weights shard over a "
                f"1-D mesh only; use --sharding full (or none: one copy of the 4-bit base per process)"
            )
    return problems


FP8_CAPABILITY = (8, 9)  # torch._scaled_mm's float8 kernels: Ada Lovelace (sm_89), Hopper (sm_90) and later


def float8_device_problem(mode: str) -> str | None:
    """Why `--fp8 on` cannot run on this machine, or None."""
    if mode != "on":
        return None
    if not torch.cuda.is_available():
        return "--fp8 on needs a CUDA GPU with float8 matmuls (H100, H200, L40S, RTX 4090); none is visible"
    capability = torch.cuda.get_device_capability()
    if capability < FP8_CAPABILITY:
        return (
            f"--fp8 on needs a GPU of compute capability 8.9 or later for float8 matmuls; this one "
            f"({torch.cuda.get_device_name()}) is {capability[0]}.{capability[1]}: use --fp8 off"
        )
    return None


def _float8_problems(cfg: TrainConfig) -> list[str]:
    """--fp8: a GPU that has float8 matmuls (on), full fine-tuning, and bf16 compute (on) or anything but fp16."""
    problems = [problem] if (problem := float8_device_problem(cfg.fp8)) else []
    if cfg.peft != "none":
        problems.append(
            f"--fp8 {cfg.fp8} trains full weights in float8; with --peft {cfg.peft} the base is frozen (LoRA's float8 "
            "path is not built): leave --fp8 off"
        )
    if cfg.precision == "fp16":  # either mode: one message, not this and the next
        problems.append("--fp8 with --precision fp16: float8 scales and the fp16 loss scale do not mix; use bf16")
    elif cfg.fp8 == "on" and cfg.precision not in ("auto", "bf16"):
        problems.append(f"--fp8 on computes the rest of the model in bf16: use --precision bf16 (not {cfg.precision})")
    return problems


def _batch_problems(cfg: TrainConfig, world_size: int) -> list[str]:
    """--global-batch-size must split evenly over the (data-parallel) processes and micro-batches; then it sets the
    accumulation. world_size: the processes over --context-parallel."""
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


def _peft_problems(cfg: TrainConfig) -> list[str]:
    """The adapter flags that can be checked without the model (the targets and --adapter: adapters.py)."""
    if cfg.peft == "none":
        changed = changed_flags(cfg, LORA_FLAGS)
        return [f"{need(changed)} --peft lora or qlora (got --peft none)"] if changed else []
    problems = []
    if cfg.lora_rank < 1:
        problems.append(f"--lora-rank must be at least 1 (got {cfg.lora_rank}); 8-64 is usual")
    if not cfg.lora_alpha > 0 or not math.isfinite(cfg.lora_alpha):
        problems.append(f"--lora-alpha must be a positive number (got {cfg.lora_alpha}); 2 x --lora-rank is usual")
    if not 0.0 <= cfg.lora_dropout < 1.0:
        problems.append(f"--lora-dropout must be in [0, 1) (got {cfg.lora_dropout})")
    if cfg.adapter and not (Path(cfg.adapter) / "adapter_config.json").is_file():
        problems.append(f"--adapter {cfg.adapter}: not a PEFT adapter folder (no adapter_config.json)")
    for package in ("peft",) + (("torchao",) if cfg.peft == "qlora" else ()):
        if not _installed(package):
            problems.append(
                f"--peft {cfg.peft} needs the {package} package, which is not installed; pip install -r "
                f"requirements.txt" + (", or use --peft lora" if package == "torchao" else "")
            )
    return problems


def _installed(package: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # ValueError: sys.modules holds None for it (an import that was blocked)
        return False


def _wandb_problems() -> list[str]:
    """wandb is optional: a missing (or broken) install is a flag problem, not a traceback on rank 0 later."""
    try:
        import wandb  # noqa: F401
    except ImportError as exc:
        return [f"--wandb on needs the wandb package ({exc}); pip install wandb, or leave --wandb off"]
    return []


def _mixture_problems(cfg: TrainConfig) -> list[str]:
    """-d given several times: a mixture. Its weights must match the datasets; some settings take one dataset."""
    if cfg.data_weights and len(cfg.dataset_name) < 2:
        return [f"--data-weights {cfg.data_weights} needs two or more datasets (-d given several times)"]
    if len(cfg.dataset_name) < 2:
        return []
    problems = []
    # the same folder however it is spelt (./data, data/, an absolute path); hub ids as given
    folders = [str(Path(name).resolve()) if Path(name).exists() else name for name in cfg.dataset_name]
    if len(set(folders)) < len(folders):
        problems.append(f"-d/--dataset-name names a dataset twice ({', '.join(cfg.dataset_name)}); raise its weight")
    if cfg.data_weights:
        weights = parse_data_weights(cfg.data_weights)
        if weights is None or len(weights) != len(cfg.dataset_name):
            problems.append(
                f"--data-weights {cfg.data_weights}: expected {len(cfg.dataset_name)} numbers separated by commas, "
                f"one per -d in order (e.g. {','.join(['1'] * len(cfg.dataset_name))})"
            )
        elif not all(math.isfinite(w) and w > 0 for w in weights):
            problems.append(f"--data-weights {cfg.data_weights}: every weight must be a positive number")
    if cfg.objective in PREFERENCE_OBJECTIVES:
        problems.append(f"--objective {cfg.objective} trains on one preference dataset; give -d once")
    if cfg.data_slice:
        problems.append(f"--data-slice {cfg.data_slice} selects rows of one dataset; give -d once")
    return problems


def _dataset_problems(name: str) -> list[str]:
    if not name.strip():  # Path("") is ".": it said "--dataset-name .: not a dataset"
        return [
            "--dataset-name/-d is empty: give a dataset folder written by data_hf.py, or a cached hub dataset ORG/NAME"
        ]
    if is_hub_dataset_id(name):  # resolved from the HF_HOME cache only, never the network
        try:
            hub_dataset_snapshot(name)
        except ValueError as exc:
            return [f"--dataset-name/-d {exc}"]
        return []
    path = Path(name)
    if why := unreadable(path):
        return [f"--dataset-name {path}: cannot be read ({why}); let the user who runs the trainer read it"]
    convert = f"convert raw files with: python data_hf.py --data_folder {path} --save_dir DATASET, then pass -d DATASET"
    if path.exists() and not path.is_dir():
        if folder_kind(path.parent) is not None and folder_kind(path.parent).kind == "dataset":  # a file of one
            return [f"--dataset-name {path}: a file of the dataset {path.parent}; pass the folder: -d {path.parent}"]
        return [f"--dataset-name {path}: a file, not a dataset folder; {convert}"]
    if not path.is_dir():
        return [f"--dataset-name {path}: no such folder; create it with data_hf.py --save_dir {path}"]
    kind = folder_kind(path)
    if kind is not None and kind.kind != "dataset":
        instead = {
            "experiment": f"its model is -m {path / 'final'}; -d takes the dataset it was trained on",
            "model": "pass it as -m/--model-name, and a dataset as -d",
            "split folders": f"convert them with: python data_hf.py --data_folder {path} --save_dir DATASET (every split "
            "into one dataset), then pass -d DATASET",
        }.get(kind.kind, "pass a dataset folder written by data_hf.py")
        return [f"--dataset-name {kind.describe(path)}, not a dataset; {instead}"]
    if not any((path / marker).exists() for marker in ("dataset_dict.json", "dataset_info.json", "state.json")):
        return [
            f"--dataset-name {path}: not a dataset written by data_hf.py (no dataset_dict.json or state.json); {convert}"
        ]
    return []


def _model_problems(cfg: TrainConfig) -> list[str]:
    if why := unreadable(Path(cfg.model_name).expanduser()):
        return [f"--model-name {cfg.model_name}: cannot be read ({why}); let the user who runs the trainer read it"]
    try:
        model_dir = resolve_model_dir(cfg.model_name)
    except FileNotFoundError as exc:
        return [str(exc)]
    except OSError as exc:  # a file inside the folder that cannot be read
        return [f"--model-name {cfg.model_name}: cannot be read ({exc.strerror}: {exc.filename})"]
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a bad config
        return [config_problem(cfg.model_name, model_dir, exc)]
    max_positions = getattr(config, "max_position_embeddings", None)
    problems = []
    if cfg.export_only:  # the config reads; what fits in its positions matters to training only
        return problems
    if max_positions and cfg.seq_length > max_positions:
        problems.append(
            f"--seq-length {cfg.seq_length} exceeds the model's max_position_embeddings {max_positions}; "
            f"lower --seq-length"
        )
    if max_positions and cfg.sample_prompts and cfg.sample_max_new_tokens >= max_positions:
        problems.append(
            f"--sample-max-new-tokens {cfg.sample_max_new_tokens} leaves no room for a prompt within the model's "
            f"max_position_embeddings {max_positions}; lower it (64 is the default)"
        )
    return problems


def config_problem(model_name: str, model_dir: Path, exc: Exception) -> str:
    """config.json that transformers cannot read, in one line with the fix: a model type this transformers does not
    know, or a file that is damaged."""
    import transformers

    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "does not recognize this architecture" in str(exc) or "model type" in first_line.lower():
        return (
            f"--model-name {model_name}: {model_dir / 'config.json'}: {first_line} (transformers "
            f"{transformers.__version__}); upgrade transformers, or check model_type in config.json"
        )
    return (
        f"--model-name {model_name}: cannot read {model_dir / 'config.json'} ({first_line}); restore it, or fetch "
        "the model again (model_download.py verifies what it downloads)"
    )
