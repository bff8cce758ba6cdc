"""The run's settings: TrainConfig (one dataclass; argparse and the YAML keys derive from its fields), loading them
(defaults < --config YAML < command line) and validating them before any process group or model exists, with
every problem named by its flag."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from fsdp_lib.errors import ConfigError
from fsdp_lib.offline import hub_dataset_snapshot, is_hub_dataset_id, resolve_model_dir

ON_OFF = ("on", "off")


def _opt(default: Any, help: str, choices: tuple[str, ...] | None = None, short: str | None = None) -> Any:
    """A dataclass field whose metadata drives argparse (one declaration, one help text)."""
    return field(default=default, metadata={"help": help, "choices": choices, "short": short})


@dataclass
class TrainConfig:
    """Every setting of a run. YAML keys (--config) are these names, with dashes or underscores."""

    experiment_name: str = _opt("", "folder name under --save-dir for checkpoints, metrics and export", short="-e")
    dataset_name: list[str] = field(
        default_factory=list,
        metadata={
            "help": "folder written by data_hf.py (Dataset or DatasetDict with train/validation), or a hub dataset "
            "ORG/NAME already in the offline cache (model_download.py --dataset ORG/NAME); give it several times (a "
            "YAML list) to train on a mixture, see --data-weights",
            "choices": None,
            "short": "-d",
        },
    )
    data_weights: str = _opt(
        "",
        "a mixture's proportions, one per -d in order, e.g. 0.7,0.3 (normalised); default: each dataset's share "
        "of the blocks (every dataset once per epoch)",
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
    max_skipped_fraction: float = _opt(
        0.05,
        "conversation data: stop when more than this fraction of a split's conversations cannot be trained (e.g. "
        "the chat template refuses them); above 0.01 the start of the run warns",
    )
    loss_chunk_tokens: str = _opt(
        "auto",
        "tokens per chunk of the output head + loss, so full [tokens x vocab] logits never exist; auto = as many as "
        "keep one chunk's fp32 logits within 256 MiB (512 at a 128k vocabulary); 0 = full logits",
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
    peft: str = _opt(
        "none",
        "none = train every weight; lora = freeze the base (stored in the compute dtype) and train low-rank "
        "adapters (peft); qlora = lora over a base whose decoder-layer Linear weights are 4-bit NF4 (torchao)",
        choices=("none", "lora", "qlora"),
    )
    lora_rank: int = _opt(16, "--peft lora/qlora: rank r of each adapter")
    lora_alpha: float = _opt(32.0, "--peft lora/qlora: adapter scale alpha (the update is alpha/r x B A)")
    lora_dropout: float = _opt(0.0, "--peft lora/qlora: dropout on the adapters' input")
    lora_target_modules: str = _opt(
        "auto",
        "--peft lora/qlora: comma-separated Linear names to adapt (e.g. q_proj,v_proj), all-linear (every Linear "
        "but the output head), or auto = every Linear of the decoder layers' attention and MLP (not MoE routers "
        "or experts)",
    )
    adapter: str = _opt("", "--peft lora/qlora: start from this PEFT adapter folder (its rank, alpha and targets)")
    export_merged: str = _opt(
        "off",
        "--peft lora/qlora: also export outputs/EXP/final-merged, the base with the adapters merged in "
        "(--export-dtype), a standard HF folder",
        choices=ON_OFF,
    )
    objective: str = _opt(
        "auto",
        "lm = next-token loss (text, or conversations' assistant turns); dpo = direct preference optimisation on "
        "pairs (prompt, chosen, rejected: data_hf.py --format preference); auto = dpo for a dataset with chosen and "
        "rejected columns, else lm",
        choices=("auto", "lm", "dpo"),
    )
    dpo_beta: float = _opt(0.1, "--objective dpo: beta, the strength of the pull towards the reference model")
    dpo_loss: str = _opt(
        "sigmoid",
        "--objective dpo: sigmoid = the DPO paper's loss; ipo = the IPO squared loss",
        choices=("sigmoid", "ipo"),
    )
    dpo_label_smoothing: float = _opt(
        0.0, "--objective dpo, --dpo-loss sigmoid: assumed share of flipped labels (conservative DPO), in [0, 0.5)"
    )
    sft_weight: float = _opt(
        0.0, "--objective dpo: add this weight x the chosen response's per-token NLL to each pair's loss (RPO)"
    )
    reference: str = _opt(
        "auto",
        "--objective dpo: the reference model. precomputed = the starting model's log-probs of every pair, computed "
        "once before step 1 and stored with the token cache (no second model in memory); live = a frozen copy "
        "(--peft: the same model with adapters off); auto = live with --peft and no --adapter, else precomputed",
        choices=("auto", "precomputed", "live"),
    )
    log_freq: int = _opt(10, "optimizer steps between metric lines")
    ckpt_freq: int = _opt(500, "optimizer steps between checkpoints (0 = only at the end)")
    eval_freq: int = _opt(0, "optimizer steps between validation passes (0 = only at the end)")
    eval_max_blocks: int = _opt(0, "cap on validation blocks per pass (0 = all)")
    eval_at_start: str = _opt(
        "on", "evaluate the base model before the first step (step 0); not on resume", choices=ON_OFF
    )
    sample_prompts: str = _opt(
        "",
        "a file of prompts (one per line; .jsonl: one conversation per line, rendered with the chat template) whose "
        "greedy completions are written at every evaluation, step 0 included, to outputs/EXP/samples.jsonl, "
        "TensorBoard/W&B and the log",
    )
    sample_max_new_tokens: int = _opt(64, "--sample-prompts: tokens generated per prompt (cut at the end token)")
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
    init_timeout_s: int = _opt(
        300,
        "timeout of process group set-up (every rank connecting to the others): a launch or torchrun restart "
        "that cannot connect fails after this instead of waiting --collective-timeout-s",
    )
    force_resume: bool = _opt(False, "resume even if model/data/batch/seed/tokenizer changed since the checkpoint")
    export_dtype: str = _opt(
        "auto",
        "dtype of the exported model (auto = the model's original dtype)",
        choices=("auto", "bf16", "fp16", "fp32"),
    )
    export_only: bool = _opt(False, "export outputs/EXP/final from the newest checkpoint and exit")
    dry_run: bool = _opt(False, "print the resolved config, model size, sharding plan and memory estimate; exit")

    def __post_init__(self) -> None:
        if isinstance(self.dataset_name, str):  # one dataset, as code (not the parser) may give it
            self.dataset_name = [self.dataset_name] if self.dataset_name else []

    @property
    def experiment_dir(self) -> Path:
        return Path(self.save_dir) / self.experiment_name

    @property
    def datasets_label(self) -> str:
        """-d as the messages name it: the dataset, or the mixture's datasets."""
        return " + ".join(self.dataset_name)


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
        names = [o for o in action.option_strings if "_" not in o]
        if not action.option_strings or action.nargs == 0:
            return ", ".join(names) or super()._format_action_invocation(action)
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
        elif str(f.type) == "list[str]":
            group.add_argument(*names, dest=f.name, action="append", help=help_text)
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            group.add_argument(*names, dest=f.name, type=kind, choices=f.metadata.get("choices"), help=help_text)
    return parser


def _normalise_yaml_value(name: str, value: Any, errors: list[str], source: str) -> Any:
    """YAML 1.1 reads on/off as booleans; map them back, and check types of the file's values."""
    f = {x.name: x for x in dataclasses.fields(TrainConfig)}[name]
    if f.metadata.get("choices") == ON_OFF and isinstance(value, bool):
        return "on" if value else "off"
    if str(f.type) == "list[str]":
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(item, str) for item in values):
            errors.append(f"{source}: key '{name}' has value {value!r}; expected a string or a list of strings")
            return []
        return values
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
        "--init-timeout-s": cfg.init_timeout_s,
        "--sample-max-new-tokens": cfg.sample_max_new_tokens,
    }
    problems += [f"{flag} must be at least 1 (got {value})" for flag, value in positive.items() if value < 1]
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
    for f in dataclasses.fields(TrainConfig):  # argparse checks choices on the command line; this covers --config
        choices = f.metadata.get("choices")
        if choices and getattr(cfg, f.name) not in choices:
            flag = "--" + f.name.replace("_", "-")
            problems.append(f"{flag} {getattr(cfg, f.name)!r} is not one of {', '.join(choices)}")
    if cfg.loss_chunk_tokens != "auto" and not str(cfg.loss_chunk_tokens).strip().isdigit():
        problems.append(
            f"--loss-chunk-tokens {cfg.loss_chunk_tokens!r}: expected auto or a whole number of tokens (0 = full logits)"
        )
    if cfg.sample_prompts and not Path(cfg.sample_prompts).is_file():
        problems.append(f"--sample-prompts {cfg.sample_prompts}: no such file (one prompt per line, or .jsonl)")
    if not 0.0 <= cfg.max_skipped_fraction <= 1.0:
        problems.append(f"--max-skipped-fraction must be between 0 and 1 (got {cfg.max_skipped_fraction})")
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
        if cfg.peft == "qlora" and shard > 1:  # NF4's all-gather asks the mesh for one group; a 2-D mesh has two
            problems.append(
                f"--peft qlora with --sharding hybrid (shard groups of {shard}): torchao's NF4 weights shard over a "
                f"1-D mesh only; use --sharding full (or none: one copy of the 4-bit base per process)"
            )
    problems += _peft_problems(cfg)
    problems += _dpo_problems(cfg)
    problems += _batch_problems(cfg, world_size)
    if cfg.data_slice and parse_data_slice(cfg.data_slice) is None:
        problems.append(
            f"--data-slice {cfg.data_slice!r}: expected START:END with whole numbers, e.g. 0:50000 or 1000:"
        )
    if cfg.wandb == "on":
        problems += _wandb_problems()
    if cfg.chat_template and not Path(cfg.chat_template).is_file():
        problems.append(f"--chat-template {cfg.chat_template}: no such file (a Jinja chat template)")
    for name in cfg.dataset_name:
        problems += _dataset_problems(name)
    problems += _mixture_problems(cfg)
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


def _peft_problems(cfg: TrainConfig) -> list[str]:
    """The adapter flags that can be checked without the model (the targets and --adapter: adapters.py)."""
    lora_flags = ("lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules", "adapter", "export_merged")
    if cfg.peft == "none":
        defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
        changed = [f"--{n.replace('_', '-')}" for n in lora_flags if getattr(cfg, n) != defaults[n]]
        return [f"{', '.join(changed)} need --peft lora or qlora (got --peft none)"] if changed else []
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


DPO_FLAGS = ("dpo_beta", "dpo_loss", "dpo_label_smoothing", "sft_weight", "reference")


def changed_dpo_flags(cfg: TrainConfig) -> list[str]:
    """The preference flags (DPO_FLAGS) set to something other than their default, as --flag names."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    return [f"--{n.replace('_', '-')}" for n in DPO_FLAGS if getattr(cfg, n) != defaults[n]]


def _dpo_problems(cfg: TrainConfig) -> list[str]:
    """The preference flags: only with --objective dpo (or auto, where the dataset decides), and in range."""
    if cfg.objective == "lm":
        changed = changed_dpo_flags(cfg)
        return [f"{', '.join(changed)} need --objective dpo (got --objective lm)"] if changed else []
    problems = []
    if not cfg.dpo_beta > 0 or not math.isfinite(cfg.dpo_beta):
        problems.append(f"--dpo-beta must be a positive number (got {cfg.dpo_beta}); 0.1 is usual")
    if not 0.0 <= cfg.dpo_label_smoothing < 0.5:
        problems.append(f"--dpo-label-smoothing must be in [0, 0.5) (got {cfg.dpo_label_smoothing})")
    elif cfg.dpo_label_smoothing and cfg.dpo_loss != "sigmoid":
        problems.append(
            f"--dpo-label-smoothing {cfg.dpo_label_smoothing} applies to --dpo-loss sigmoid (conservative DPO); "
            f"the {cfg.dpo_loss} loss has no such term"
        )
    if not cfg.sft_weight >= 0 or not math.isfinite(cfg.sft_weight):
        problems.append(f"--sft-weight must not be negative (got {cfg.sft_weight})")
    if cfg.reference == "live" and cfg.peft != "none" and cfg.adapter:
        problems.append(
            f"--reference live with --peft {cfg.peft} means adapters off, which is the base without --adapter "
            f"{cfg.adapter}, not the starting model; use --reference precomputed (or auto)"
        )
    if cfg.objective == "dpo" and cfg.document_masking == "off":
        problems.append(
            "--objective dpo packs a pair's sequences as separate documents: it needs --document-masking on"
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


def parse_data_slice(text: str) -> tuple[int, int | None] | None:
    """'START:END' -> (start, end or None); None when malformed."""
    start, sep, end = text.partition(":")
    if not sep or not all(part.strip().isdigit() for part in (start, end) if part.strip()):
        return None
    return int(start or 0), (int(end) if end.strip() else None)


def parse_data_weights(text: str) -> list[float] | None:
    """--data-weights as numbers, or None when it does not parse."""
    try:
        return [float(item) for item in text.split(",")]
    except ValueError:
        return None


def _mixture_problems(cfg: TrainConfig) -> list[str]:
    """-d given several times: a mixture. Its weights must match the datasets; some settings take one dataset."""
    if cfg.data_weights and len(cfg.dataset_name) < 2:
        return [f"--data-weights {cfg.data_weights} needs two or more datasets (-d given several times)"]
    if len(cfg.dataset_name) < 2:
        return []
    problems = []
    if len(set(cfg.dataset_name)) < len(cfg.dataset_name):
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
    if cfg.objective == "dpo":
        problems.append("--objective dpo trains on one preference dataset; give -d once")
    if cfg.data_slice:
        problems.append(f"--data-slice {cfg.data_slice} selects rows of one dataset; give -d once")
    return problems


def _dataset_problems(name: str) -> list[str]:
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


def resolve_precision(cfg: TrainConfig) -> str:
    if cfg.precision != "auto":
        return cfg.precision
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
