"""The run's settings: TrainConfig (one dataclass, its fields in sections; argparse and the YAML keys derive from
them), loading them (defaults < --config YAML < command line), and the parsing and resolution of a few of them
(--data-slice, --data-weights, --precision auto). Validating them before any process group or model exists is
fsdp_lib.checks'."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from fsdp_lib.arguments import StoreOnce
from fsdp_lib.errors import ConfigError, not_utf8
from fsdp_lib.markers import step_dirs

ON_OFF = ("on", "off")


def _opt(default: Any, help: str, choices: tuple[str, ...] | None = None, short: str | None = None) -> Any:
    """A dataclass field whose metadata drives argparse (one declaration, one help text)."""
    return field(default=default, metadata={"help": help, "choices": choices, "short": short})


@dataclass
class TrainConfig:
    """Every setting of a run. YAML keys (--config) are these names, with dashes or underscores."""

    # --- Experiment, data and model: what trains on what, where it is saved
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

    # --- Optimization: how long, the learning-rate schedule, the batch
    num_epochs: int = _opt(1, "passes over the packed training blocks")
    max_steps: int = _opt(0, "stop after this many optimizer steps in total (0 = run all epochs)")
    lr: float = _opt(3e-5, "peak AdamW learning rate")
    min_lr: float = _opt(0.0, "the learning rate the decay ends at (it reaches it one step after the last)")
    warmup_steps: int = _opt(0, "linear warmup: step k of the first W trains at k/W x --lr (step W at --lr)")
    lr_schedule: str = _opt(
        "cosine",
        "decay after warmup, from --lr at the first step after it: step s (1-based) of T at progress (s-W-1)/(T-W)",
        choices=("cosine", "linear", "constant"),
    )
    weight_decay: float = _opt(0.0, "AdamW weight decay (never applied to norms and biases)")
    grad_clip: float = _opt(1.0, "clip the global gradient norm to this value (0 = no clipping)")
    batch_size: int = _opt(1, "sequences per process per micro-batch", short="-b")
    grad_accum_steps: int = _opt(1, "micro-batches per optimizer step")
    global_batch_size: int = _opt(
        0, "sequences per optimizer step over all processes; sets --grad-accum-steps to N / (processes x -b) (0 = off)"
    )

    # --- Blocks and loss: rows, packing, conversations, the output head's chunks
    data_slice: str = _opt("", "train on rows START:END of the train split (either may be empty), e.g. 0:50000")
    seq_length: int = _opt(1024, "tokens per packed training block")
    document_masking: str = _opt(
        "on", "packed documents never attend to each other (position ids restart per document)", choices=ON_OFF
    )
    packing: str = _opt(
        "auto",
        "how documents fill the blocks: whole = each whole in one block (best fit, the rest padding; one longer than "
        "a block is cut into pieces), so a conversation never straddles two; stream = one token stream cut into "
        "blocks (no padding); auto = whole for conversations, stream for text. Pairs and prompts are always whole",
        choices=("auto", "whole", "stream"),
    )
    context_parallel: int = _opt(
        1,
        "split each sequence over N processes (Ulysses: an all-to-all hands each process all tokens of 1/N of the "
        "attention heads); packed documents stay exact; the processes / N data-parallel groups train different "
        "micro-batches. N divides the processes, --seq-length and the model's attention heads, and divides its "
        "key/value heads or is a multiple of them (each then copied to N / kv-heads processes)",
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
        "conversations, preference pairs and GRPO prompts: stop when more than this fraction of a split's records "
        "cannot be trained (e.g. the chat template refuses them, or they do not fit --seq-length); above 0.01 the "
        "start of the run warns",
    )
    loss_chunk_tokens: str = _opt(
        "auto",
        "tokens per chunk of the output head + loss, so full [tokens x vocab] logits never exist; auto = as many as "
        "keep one chunk's fp32 logits within 256 MiB (512 at a 128k vocabulary); 0 = full logits",
    )

    # --- Precision, sharding and memory
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
    activation_offload: str = _opt(
        "off",
        "keep the activations saved for backward (with checkpointing: each layer's input) in host memory between the "
        "forward and the backward (pinned, copied without blocking the host; exact)",
        choices=ON_OFF,
    )
    tiled_mlp: int = _opt(
        0, "compute each decoder layer's MLP over N tiles of the tokens, recomputed tile by tile in backward, so its "
        "[tokens x intermediate] activations exist for one tile at a time (exact; 0 = off; dense MLPs only)"
    )  # fmt: skip
    compile: str = _opt("off", "torch.compile each decoder layer", choices=ON_OFF)
    fp8: str = _opt(
        "off",
        "train the decoder layers' Linear layers in float8 (torchao: rowwise scales with --document-masking on, else "
        "tensorwise with float8 all-gather under FSDP; master weights and optimizer state stay fp32): on = a GPU with float8 matmuls (compute capability 8.9+: "
        "H100, H200, L40S, RTX 4090) with --precision bf16, best with --compile on; emulate = the same casts with "
        "high-precision matmuls on any device (float8's numbers, none of its speed: for tests)",
        choices=("off", "on", "emulate"),
    )
    accum_grad_sync: str = _opt(
        "per-micro-batch",
        "with --grad-accum-steps > 1: reduce-scatter gradients after every micro-batch (sharded gradient memory), "
        "or only after the last (one reduce-scatter per step, but unsharded gradients held across micro-batches)",
        choices=("per-micro-batch", "last"),
    )
    attn_implementation: str = _opt(
        "auto",
        "attention kernel; auto = varlen with document masking (each packed document attends to itself, no T x T "
        "mask: torch's varlen flash kernel on a GPU in bf16/fp16, SDPA per document elsewhere), else sdpa where the "
        "architecture supports it, else eager",
        choices=("auto", "varlen", "sdpa", "eager", "flash_attention_2", "flex_attention"),
    )

    # --- PEFT: LoRA and QLoRA adapters
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
    lora_kernel: str = _opt(
        "fused",
        "--peft lora/qlora: fused = each adapted Linear's base and adapter products in one autograd function "
        "(exact; where peft's module computes the same: no dropout, a dense frozen base), peft = peft's modules",
        choices=("fused", "peft"),
    )
    export_merged: str = _opt(
        "off",
        "--peft lora/qlora: also export outputs/EXP/final-merged, the base with the adapters merged in "
        "(--export-dtype), a standard HF folder",
        choices=ON_OFF,
    )

    # --- Objective and preference training (DPO)
    objective: str = _opt(
        "auto",
        "lm = next-token loss (text, or conversations' assistant turns); dpo = direct preference optimisation on "
        "pairs (prompt, chosen, rejected: data_hf.py --format preference); grpo = online RL: completions sampled "
        "for each prompt (a 'prompt' column: data_hf.py --format prompts), scored by --reward; kto = KTO on "
        "unpaired examples (prompt, completion, label) or on pairs, each unpaired into a desirable and an undesirable "
        "example; auto = dpo for a dataset with chosen and rejected columns, kto for one with prompt, completion and "
        "label, grpo for one with a prompt column and no text or messages, else lm",
        choices=("auto", "lm", "dpo", "grpo", "kto"),
    )
    dpo_beta: float = _opt(
        0.1,
        "--objective dpo, kto: beta. sigmoid/ipo: the strength of the pull towards the reference model; simpo: the scale "
        "of the length-normalised reward (its paper: 2.0-2.5); orpo: lambda, the weight of the odds-ratio term",
    )
    dpo_loss: str = _opt(
        "sigmoid",
        "--objective dpo: sigmoid = the DPO paper's loss; ipo = the IPO squared loss; simpo = SimPO, reference-free "
        "(mean log-prob per response token, a target margin --simpo-gamma); orpo = ORPO, reference-free (the "
        "chosen response's NLL + beta x the odds-ratio loss)",
        choices=("sigmoid", "ipo", "simpo", "orpo"),
    )
    simpo_gamma: float = _opt(0.5, "--dpo-loss simpo: the target reward margin gamma (its paper: 0.5-1.5)")
    dpo_label_smoothing: float = _opt(
        0.0, "--objective dpo, --dpo-loss sigmoid: assumed share of flipped labels (conservative DPO), in [0, 0.5)"
    )
    sft_weight: float = _opt(
        0.0, "--objective dpo: add this weight x the chosen response's per-token NLL to each pair's loss (RPO)"
    )
    kto_desirable_weight: float = _opt(
        1.0, "--objective kto: the weight of a desirable example's loss (KTO's lambda_D; raise it when they are rarer)"
    )
    kto_undesirable_weight: float = _opt(1.0, "--objective kto: the weight of an undesirable example's loss (lambda_U)")
    reference: str = _opt(
        "auto",
        "--objective dpo, kto: the reference model. precomputed = the starting model's log-probs of every pair, computed "
        "once before step 1 and stored with the token cache (no second model in memory); live = a frozen copy "
        "(--peft: the same model with adapters off); auto = live with --peft and no --adapter, else precomputed",
        choices=("auto", "precomputed", "live"),
    )

    # --- Online RL with rewards (GRPO)
    num_generations: int = _opt(8, "--objective grpo: completions sampled per prompt (a group; at least 2)")
    max_new_tokens: int = _opt(256, "--objective grpo: the longest completion, in tokens (cut at the end token)")
    temperature: float = _opt(1.0, "--objective grpo: sampling temperature (> 0)")
    top_p: float = _opt(1.0, "--objective grpo: nucleus sampling, the probability mass kept (1 = all)")
    reward: list[str] = field(
        default_factory=list,
        metadata={
            "help": "--objective grpo: a reward function, FILE.py:FUNCTION (TRL's signature: f(prompts, completions, "
            "**columns) -> one float or None per completion) or a built-in: accuracy (the completion's last number "
            "or \\boxed{} answer equals the answer/solution column's), format (matches --reward-pattern); give it "
            "several times to combine them",
            "choices": None,
            "short": None,
        },
    )
    reward_weights: str = _opt("", "--objective grpo: one weight per --reward, comma-separated (default: 1 each)")
    reward_timeout_s: float = _opt(
        600.0,
        "--objective grpo: the longest one call of a reward function (one process's completions of a micro-batch) "
        "may take, in seconds; past it the run stops naming the function (default: 600 or half of "
        "--collective-timeout-s, whichever is less; a value given must be below --collective-timeout-s; 0 = no "
        "limit, and a function that hangs then holds every process until --collective-timeout-s)",
    )
    reward_pattern: str = _opt(
        r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*",
        "--reward format: the regular expression a whole completion must match (dot matches newlines)",
    )
    grpo_loss: str = _opt(
        "dapo",
        "--objective grpo: how token losses are averaged over the global batch. grpo = per completion, then over "
        "completions; dapo = over all completion tokens (long completions are not under-weighted); dr_grpo = summed "
        "/ (completions x --max-new-tokens), advantages not divided by the group's std",
        choices=("grpo", "dapo", "dr_grpo"),
    )
    epsilon: float = _opt(0.2, "--objective grpo: the policy ratio is clipped to [1 - epsilon, 1 + --epsilon-high]")
    epsilon_high: float = _opt(0.0, "--objective grpo: the upper clip (DAPO's clip-higher: 0.28); 0 = --epsilon")
    num_iterations: int = _opt(
        1,
        "--objective grpo: optimizer updates per generation batch (TRL's num_iterations, the paper's mu): a step "
        "samples once, then updates this many times on the same completions, the policy ratio taken to the policy "
        "that sampled them (so --epsilon clips from the second update on)",
    )
    grpo_beta: float = _opt(
        0.0,
        "--objective grpo: weight of the KL term to the reference (the model with adapters off with --peft, else a "
        "frozen copy); 0 = no reference, as is current practice",
    )
    rollout_unshard: str = _opt(
        "auto",
        "--objective grpo: keep the decoder layers gathered for a whole generation (on: one all-gather per layer, "
        "the whole model in memory meanwhile) or gather each for every token (off); auto = on where the model "
        "takes under a quarter of the GPU's memory",
        choices=("auto", "on", "off"),
    )

    # --- Cadence: metric lines, checkpoints, evaluation
    log_freq: int = _opt(10, "optimizer steps between metric lines")
    ckpt_freq: int = _opt(500, "optimizer steps between checkpoints (0 = only at the end)")
    eval_freq: int = _opt(0, "optimizer steps between validation passes (0 = only at the end)")
    eval_max_blocks: int = _opt(0, "cap on validation blocks per pass, per dataset of a mixture (0 = all)")
    eval_at_start: str = _opt(
        "on", "evaluate the base model before the first step (step 0); not on resume", choices=ON_OFF
    )

    # --- Samples: greedy completions at every evaluation
    sample_prompts: str = _opt(
        "",
        "a file of prompts (one per line; .jsonl: one conversation per line, rendered with the chat template) whose "
        "greedy completions are written at every evaluation, step 0 included, to outputs/EXP/samples.jsonl, "
        "TensorBoard/W&B and the log",
    )
    sample_max_new_tokens: int = _opt(64, "--sample-prompts: tokens generated per prompt (cut at the end token)")

    # --- Checkpoints
    keep_last: int = _opt(3, "complete checkpoints to keep (the newest is never deleted)")
    async_ckpt: str = _opt("off", "write checkpoints in the background while training continues", choices=ON_OFF)

    # --- Telemetry
    tensorboard: str = _opt("off", "also write TensorBoard event files to outputs/EXP/tensorboard", choices=ON_OFF)
    wandb: str = _opt(
        "off",
        "also log to Weights & Biases, offline unless WANDB_MODE says otherwise (files in outputs/EXP/wandb)",
        choices=ON_OFF,
    )
    peak_tflops: float = _opt(0.0, "accelerator peak TFLOP/s per GPU for MFU (0 = built-in table)")
    profile_steps: str = _opt(
        "",
        "profile optimizer steps START:END (e.g. 5:6; one step: 5) with torch.profiler: per rank a trace "
        "(Perfetto/Chrome) and a table of the operators' time in outputs/EXP/profile",
    )

    # --- Guards and timeouts
    max_bad_steps: int = _opt(25, "stop after this many consecutive steps with a non-finite loss or gradient")
    collective_timeout_s: int = _opt(1800, "timeout of collectives (checkpoint agreement, tokenisation wait)")
    init_timeout_s: int = _opt(
        300,
        "timeout of process group set-up (every rank connecting to the others): a launch or torchrun restart "
        "that cannot connect fails after this instead of waiting --collective-timeout-s",
    )

    # --- Resume, export and dry run
    force_resume: bool = _opt(False, "resume even if model/data/batch/seed/tokenizer changed since the checkpoint")
    export_dtype: str = _opt(
        "auto",
        "dtype of the exported model (auto = the model's original dtype; a trained value fp16 cannot hold stops the export)",
        choices=("auto", "bf16", "fp16", "fp32"),
    )
    export_only: bool = _opt(
        False, "export outputs/EXP/final from the newest checkpoint and exit (the run's config.yaml; reads no data)"
    )
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
    parser.add_argument("--config", action=StoreOnce, help="YAML file of flag names; the command line overrides it")
    for f in dataclasses.fields(TrainConfig):
        names = list(dict.fromkeys([f"--{f.name.replace('_', '-')}", f"--{f.name}"]))
        if f.metadata.get("short"):
            names.insert(0, f.metadata["short"])
        group = required if f.name in REQUIRED_FLAGS else parser
        help_text = f.metadata["help"]
        unset = f.default in ("", None) or f.default is dataclasses.MISSING  # nothing to show (or the help says it)
        if f.name not in REQUIRED_FLAGS and not unset and "default:" not in help_text:
            help_text += f" (default: {f.default})"
        if f.type in ("bool", bool):
            group.add_argument(*names, dest=f.name, action="store_true", help=help_text)
        elif str(f.type) == "list[str]":
            group.add_argument(*names, dest=f.name, action="append", help=help_text)
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            group.add_argument(*names, dest=f.name, type=kind, choices=f.metadata.get("choices"), help=help_text)
    return parser


class _ConfigLoader(yaml.SafeLoader):
    """YAML 1.1 without its base-60 integers: `profile-steps: 5:6` and `data-slice: 10:20` stay the text they are
    on the command line (a safe_load reads them as 306 and 620)."""


def _int_or_text(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int | str:
    text = loader.construct_scalar(node)
    return text if ":" in text else yaml.SafeLoader.construct_yaml_int(loader, node)


_ConfigLoader.add_constructor("tag:yaml.org,2002:int", _int_or_text)


def _mapping_without_repeats(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict:
    """A mapping whose keys are all different flags: YAML keeps the last of two equal keys silently, and
    `max-steps` and `max_steps` are one flag."""
    seen: dict[str, Any] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        flag = str(key).replace("-", "_")
        if flag in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"'{key}' sets the same flag as '{seen[flag]}' above; keep one", key_node.start_mark
            )
        seen[flag] = key
    return loader.construct_mapping(node, deep=True)


_ConfigLoader.add_constructor("tag:yaml.org,2002:map", _mapping_without_repeats)


def _normalise_yaml_value(name: str, value: Any, errors: list[str], source: str) -> Any:
    """YAML 1.1 reads on/off as booleans and 1e-4 as a string; map them back, and check types of the file's values."""
    f = {x.name: x for x in dataclasses.fields(TrainConfig)}[name]
    if isinstance(value, bool) and {"on", "off"} <= set(f.metadata.get("choices") or ()):  # fp8: on, auto/on/off
        return "on" if value else "off"
    if str(f.type) == "list[str]":
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(item, str) for item in values):
            errors.append(
                f"{source}: key '{name.replace('_', '-')}' has value {value!r}; expected a string or a list of strings"
            )
            return []
        return values
    if isinstance(value, str) and str(f.type) in ("int", "float"):
        # 1e-4 is a float on the command line but a string to YAML 1.1 (it wants 1.0e-4): read it as argparse would
        try:
            value = {"int": int, "float": float}[str(f.type)](value.strip())
        except ValueError:
            pass  # refused below, naming the key
    expected = {"int": int, "float": (int, float), "bool": bool, "str": (str, int, float)}[str(f.type)]
    if not isinstance(value, expected) or (str(f.type) == "int" and isinstance(value, bool)):
        hint = ""
        if str(f.type) == "str" and isinstance(value, list):  # a comma-separated flag written as a YAML list
            hint = f', e.g. {name.replace("_", "-")}: "{",".join(str(item) for item in value)}"'
        errors.append(f"{source}: key '{name.replace('_', '-')}' has value {value!r}; expected {str(f.type)}{hint}")
        return f.default
    if (choices := f.metadata.get("choices")) and str(value) not in choices:  # with the type errors, not after them
        errors.append(
            f"{source}: key '{name.replace('_', '-')}' has value {value!r}; expected one of {', '.join(choices)}"
        )
    if str(f.type) == "float":
        return float(value)
    if str(f.type) == "str":
        return str(value)
    return value


# Flags that act on the launch they are given to, never kept in a run's config.yaml nor read from a --config file.
ONE_LAUNCH_FLAGS = ("force_resume", "export_only", "dry_run")


def load_config(argv: list[str] | None) -> TrainConfig:
    """Defaults < YAML file < command line; with --export-only, the experiment's own config.yaml (its run's
    settings) comes first, so `-e EXP --export-only` alone exports it. Raises ConfigError listing every problem."""
    args = vars(build_arg_parser().parse_args(argv))
    values: dict[str, Any] = {}
    errors: list[str] = []
    config_file = args.pop("config", None)
    if config_file:
        path = Path(config_file)
        try:
            loaded = yaml.load(path.read_text(encoding="utf-8"), Loader=_ConfigLoader) or {}
        except UnicodeDecodeError as exc:
            raise ConfigError([f"--config {config_file}: {not_utf8(exc)}; save it as UTF-8 YAML"]) from exc
        except (OSError, yaml.YAMLError) as exc:
            what = "no such file" if isinstance(exc, FileNotFoundError) else f"cannot read it as YAML ({exc})"
            raise ConfigError([f"--config {config_file}: {what}"]) from exc
        if not isinstance(loaded, dict):
            raise ConfigError([f"--config {config_file}: expected a mapping of flag names to values"])
        known = {f.name for f in dataclasses.fields(TrainConfig)}
        for key, value in loaded.items():
            name = str(key).replace("-", "_")
            if name not in known:
                errors.append(f"--config {config_file}: unknown key '{key}' (keys are the flag names, e.g. seq-length)")
                continue
            if name in ONE_LAUNCH_FLAGS:  # a run's config.yaml once kept them: reused, it forced every later resume
                if value:
                    errors.append(f"--config {config_file}: key '{key}' acts on one launch only: give --{name.replace('_', '-')} "
                                  "on the command line")  # fmt: skip
                continue
            values[name] = _normalise_yaml_value(name, value, errors, f"--config {config_file}")
    if args.get("export_only", values.get("export_only")):  # the run's own settings first, where it is now
        where = {**values, **args}
        folder = Path(where.get("save_dir", TrainConfig.save_dir)) / where.get("experiment_name", "")
        values = {**saved_run_settings(folder, errors, where.get("peft")), **values}
    # --global-batch-size sets the accumulation: the one of the two given on the command line overrides the file's
    for given, other in (("global_batch_size", "grad_accum_steps"), ("grad_accum_steps", "global_batch_size")):
        if given in args and other not in args:
            values.pop(other, None)
    values.update(args)
    if errors:
        raise ConfigError(errors)
    return TrainConfig(**values)


# What an --export-only takes from the run's config.yaml: what builds the model, its adapters and tokenizer (it reads
# no data), not how it ran (batch, processes, device, logging), which the export's own launch may change.
EXPORT_SETTINGS = (
    "model_name", "seed", "document_masking", "chat_template", "attn_implementation", "peft", "lora_rank",
    "lora_alpha", "lora_dropout", "lora_target_modules", "adapter", "lora_kernel", "export_merged", "export_dtype",
)  # fmt: skip


def saved_run_settings(folder: Path, errors: list[str], peft: str | None = None) -> dict[str, Any]:
    """The EXPORT_SETTINGS of the run in FOLDER (saved_settings), read as --config reads a file, for an --export-only
    of that experiment; {} where there are none (the command line then says everything, as for a training run).
    `--peft none` given: without the run's adapter settings."""
    saved, path = saved_settings(folder)
    names = {str(key).replace("-", "_"): value for key, value in saved.items()}
    keys = [n for n in EXPORT_SETTINGS if n in names and not (peft == "none" and n in LORA_FLAGS)]
    return {n: _normalise_yaml_value(n, names[n], errors, str(path)) for n in keys}


def saved_settings(folder: Path) -> tuple[dict[str, Any], Path]:
    """A run's settings and the file they came from: FOLDER/config.yaml (written at the run's start) or, where that
    is missing, damaged or not a mapping, the copy in its newest checkpoint's train_state.json; ({}, config.yaml)
    where neither has them."""
    path = folder / "config.yaml"
    try:
        saved = yaml.load(path.read_text(encoding="utf-8"), Loader=_ConfigLoader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        saved = None
    if isinstance(saved, dict):
        return saved, path
    for step in reversed(step_dirs(folder / "checkpoint")):
        try:
            kept = json.loads((step / "train_state.json").read_text(encoding="utf-8")).get("config")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(kept, dict):
            return kept, step / "train_state.json"
    return {}, path


LORA_FLAGS = (
    "lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules", "adapter", "lora_kernel", "export_merged",
)  # fmt: skip


def packs_whole(cfg: TrainConfig, conversations: bool) -> bool:
    """--packing as resolved for a dataset of conversations or of text (auto: whole for conversations)."""
    return cfg.packing == "whole" or (cfg.packing == "auto" and conversations)


def resolve_precision(cfg: TrainConfig) -> str:
    """--precision, with auto resolved: bf16 on a CUDA device that supports it, else fp32."""
    if cfg.precision != "auto":
        return cfg.precision
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
