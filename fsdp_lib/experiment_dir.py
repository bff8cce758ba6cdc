"""What a run may do with its experiment folder (--save-dir/--experiment-name), checked before any process group:
never write into another tool's folder or a folder of the user's own files, never start an experiment over by
itself (a rerun whose checkpoints are gone would train from step 0 and replace final/ and metrics.jsonl), refuse a
resume the flags alone show to differ (--seq-length, --seed, the global batch, ...) before any data is read; and
what its config.yaml holds. No torch."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import yaml

from fsdp_lib.config import ONE_LAUNCH_FLAGS, TrainConfig, packs_whole
from fsdp_lib.errors import name_sample
from fsdp_lib.markers import EXPERIMENT_ENTRIES, EXPERIMENT_LOCK, EXPERIMENT_STATE, folder_kind, step_dirs


def experiment_dir_problems(cfg: TrainConfig) -> list[str]:
    """The experiment folder's problems (at most one), each naming the flag and the fix."""
    folder = cfg.experiment_dir
    if (folder.exists() or folder.is_symlink()) and not folder.is_dir():
        return [
            f"--experiment-name {cfg.experiment_name}: {folder} is a file, not an experiment folder; choose another "
            "--experiment-name or --save-dir"
        ]
    if (kind := folder_kind(folder)) and kind.kind != "experiment":
        return [
            f"--experiment-name {cfg.experiment_name}: {kind.describe(folder)}, not an experiment; "
            "choose another --experiment-name or --save-dir"
        ]
    if kind is None and (foreign := foreign_entries(folder)):
        return [
            f"--experiment-name {cfg.experiment_name}: {folder} exists and holds {name_sample(foreign)}, which "
            "fsdp_train.py did not write (a run replaces what it writes there): choose another --experiment-name or "
            "--save-dir"
        ]
    if (kind is None or kind.kind == "experiment") and (named := same_names_not_ours(folder)):
        return [
            f"--experiment-name {cfg.experiment_name}: {folder} holds {name_sample(named)} but no checkpoint, state or "
            "export, and its config.yaml is not a run's settings of this experiment: another tool's files with the "
            "names a run writes, which it would replace; choose another --experiment-name or --save-dir"
        ]
    exports = [folder / name for name in ("final", "final-merged")]
    if blocked := [path for path in exports if path.is_symlink() or (path.exists() and not path.is_dir())]:
        return [
            f"--experiment-name {cfg.experiment_name}: {blocked[0]} is a {'link' if blocked[0].is_symlink() else 'file'}"
            ", where this run writes its export (a folder): move it aside, or choose another --experiment-name"
        ]
    if not cfg.export_only and (evidence := lost_checkpoint(folder)):
        return [
            f"--experiment-name {cfg.experiment_name}: {evidence}, but no complete checkpoint is left in "
            f"{folder / 'checkpoint'}, so this run would start again from step 0 and replace its final/ and "
            "metrics.jsonl. To continue, put the checkpoint back; to keep it and start over, choose a new "
            f"--experiment-name{_train_on_hint(folder / 'final')}; to train this experiment again from step 0, "
            f"delete {folder / EXPERIMENT_STATE} and its final/ yourself"
        ]
    return []


PACKED_WHOLE = ":packing-whole"  # in a run's data format (data/plan.py): its documents were packed whole


def packing_refusal(then_format: str, now_format: str, config: dict) -> str:
    """A resume refused for its --packing alone, with the value that resumes it: the run's (its config.yaml
    settings), else stream (a run from before the flag)."""
    then, now = ("whole" if PACKED_WHOLE in fmt else "stream" for fmt in (then_format, now_format))
    value = config.get("packing") or "stream"
    fix = "leave --packing out" if value == "auto" else f"--packing {value}"
    chat = then_format.startswith("chat:") or "[chat:" in then_format or "; chat:" in then_format  # mixtures too
    why = "conversations are packed whole by default since 2026-11-28; " if chat else ""
    return f"--packing: checkpoint {then} vs now {now} ({why}{fix} resumes this run as it began)"


# export_fingerprint's adapter entries as the flags that set them (a refusal said "peft.start: 'init' vs 'f1ec...'")
PEFT_NAMES = {
    "mode": "--peft", "rank": "--lora-rank", "alpha": "--lora-alpha", "dropout": "--lora-dropout",
    "targets": "--lora-target-modules", "start": "--adapter (init: none)",
    "base_weights": "the base model's weights (--model-name's files)",
}  # fmt: skip


def format_difference(was: str, now: str, payload: dict, cfg: TrainConfig) -> str | None:
    """A changed data format said as the setting behind it: --data-weights, the chat template (its hash in the
    format), --loss-on, --document-masking; None when it is none of these (the format strings are then shown)."""
    config = payload.get("config", {})
    said = []
    if "data_weights" in config and config["data_weights"] != cfg.data_weights:
        said.append(f"--data-weights: checkpoint {config['data_weights']!r} vs now {cfg.data_weights!r}")
    kinds = [re.findall(r"(?:^|\[|; )(chat|pairs|text|prompts)", fmt) for fmt in (was, now)]
    templates = [re.findall(r"(?:chat|pairs):([0-9a-f]+)", fmt) for fmt in (was, now)]
    if kinds[0] != kinds[1]:  # converted again as another kind: not the template's doing
        said.append(f"the data's kind: checkpoint {', '.join(kinds[0])} vs now {', '.join(kinds[1])}")
    elif templates[0] != templates[1]:
        given = [config.get("chat_template") or "the model folder's", cfg.chat_template or "the model folder's"]
        said.append(
            f"the chat template: checkpoint {', '.join(templates[0]) or 'none'} ({given[0]}) vs now "
            f"{', '.join(templates[1]) or 'none'} ({given[1]}): a template edited or replaced since renders the "
            "conversations into other tokens"
        )
    for flag in ("loss-on", "document-masking"):
        values = [re.findall(rf"{flag}-(\w+)", fmt) for fmt in (was, now)]
        if values[0] != values[1] and values[0] and values[1]:
            said.append(f"--{flag}: checkpoint {', '.join(values[0])} vs now {', '.join(values[1])}")
    return "; ".join(said) or None


# A refused resume's way out: here (the plain flags, before any data is read) and in train/checkpoint.py (the rest)
RESUME_REFUSED_FIX = (
    "These change the math or the data. Restore the original settings, pass --force-resume to resume anyway, or use "
    "a new --experiment-name"
)


def run_settings(cfg: TrainConfig) -> dict:
    """What outputs/EXP/config.yaml holds: the run's flags, with its local files and folders (the model, datasets,
    chat template, sample prompts, adapter, reward files) made absolute, so `-e EXP --export-only`, which reads the
    file, finds them from any working folder (a relative path named a folder of the folder it was run from)."""

    def absolute(value: str) -> str:
        path_text, colon, function = value.rpartition(":")
        if not path_text.endswith(".py"):  # not a reward's FILE.py:FUNCTION
            path_text, colon, function = value, "", ""
        path = Path(path_text)
        if path.is_absolute() or not path.exists():  # a hub id, a built-in reward, or already absolute
            return value
        return str(path.resolve()) + colon + function

    settings = {key: value for key, value in dataclasses.asdict(cfg).items() if key not in ONE_LAUNCH_FLAGS}
    if cfg.global_batch_size > 0:  # the accumulation validate_config derived for this launch's process count: the
        settings["grad_accum_steps"] = 1  # file, reused with --config on another count, contradicted the batch
    for key in ("model_name", "chat_template", "sample_prompts", "adapter", "save_dir"):
        settings[key] = absolute(settings[key]) if settings[key] else settings[key]
    for key in ("dataset_name", "reward"):
        settings[key] = [absolute(value) for value in settings[key]]
    return settings


def flags_changed_since(saved: dict, cfg: TrainConfig) -> list[str]:
    """The flags whose values differ from the checkpoint's run (its run_settings), as `--flag NOW (was THEN)`."""
    now = run_settings(cfg)
    derived = {"grad_accum_steps"} if cfg.global_batch_size > 0 else set()  # older config.yaml saved the derived one
    return [
        f"--{key.replace('_', '-')} {now[key]} (was {saved[key]})"
        for key in now
        if key in saved and key not in ONE_LAUNCH_FLAGS and key not in derived and saved[key] != now[key]
    ]


def newest_checkpoint(experiment: Path) -> Path | None:
    """The experiment's newest complete checkpoint folder by name (checkpoint/step_N), not yet verified."""
    try:
        steps = step_dirs(experiment / "checkpoint")
    except OSError:  # unreadable: the run's own reads say so, with the path
        return None
    return steps[-1] if steps else None


def resumes(cfg: TrainConfig) -> bool:
    """Whether this run resumes: its experiment has a checkpoint folder (verified later). A check of the data that
    a run which began before it existed would fail warns such a run rather than stopping it."""
    return bool(cfg.experiment_name) and newest_checkpoint(cfg.experiment_dir) is not None


def resume_outlook(experiment: Path) -> str:
    """What the same command without --dry-run would do with the experiment's checkpoints, for the dry run."""
    if (newest := newest_checkpoint(experiment)) is None:
        return f"a run would start at step 0 (no checkpoint in {experiment / 'checkpoint'})"
    return f"a run would resume from {newest} (verified against its checksums first)"


def resume_refusal(cfg: TrainConfig, world_size: int | None) -> list[str]:
    """A resume the full check would refuse, said before any data is tokenised or model loaded (at most one
    problem): the settings its flags alone decide (settings_a_resume_refuses). Not with --force-resume."""
    if cfg.export_only or cfg.force_resume or not cfg.experiment_name:
        return []
    if not (changed := settings_a_resume_refuses(cfg.experiment_dir, cfg, world_size)):
        return []
    return [
        f"--experiment-name {cfg.experiment_name}: cannot resume from {changed[0]}: {'; '.join(changed[1:])}. "
        f"{RESUME_REFUSED_FIX}"
    ]


def settings_a_resume_refuses(experiment: Path, cfg: TrainConfig, world_size: int | None) -> list[str]:
    """The newest checkpoint and the pinned settings it differs in that the flags alone decide, read from its
    train_state.json before any data or model is loaded (the full check, train/checkpoint.py, comes after both,
    minutes into a large run): --seq-length, --seed, the global batch (world_size processes; None = not known, as
    in a --dry-run without torchrun: only --global-batch-size is compared), --packing of one dataset, an --objective
    given by name, --peft and, for adapters trained from scratch, their rank, alpha and dropout, --data-slice.
    [] when there is no readable checkpoint or nothing differs."""
    if (found := newest_fingerprint(experiment)) is None:
        return []
    newest, saved, config = found
    return [str(newest), *changed] if (changed := _plain_differences(saved, config, cfg, world_size)) else []


def newest_fingerprint(experiment: Path) -> tuple[Path, dict, dict] | None:
    """(the newest checkpoint, its resume fingerprint, its config) as its train_state.json holds them; None when
    there is none or it cannot be read (the run's own reads say what is wrong with it)."""
    if (newest := newest_checkpoint(experiment)) is None:
        return None
    try:
        payload = json.loads((newest / "train_state.json").read_text(encoding="utf-8"))
        saved, config = payload["fingerprint"], payload.get("config", {})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return (newest, saved, config) if isinstance(saved, dict) and isinstance(config, dict) else None


def reference_refusal(cfg: TrainConfig, objective: str, reference: str) -> str | None:
    """A resume of --objective dpo or kto that the full check would refuse for its reference (another mode, or a
    precomputed one of other starting weights, --adapter, --precision or --attn-implementation), said before the
    reference pass over the whole dataset runs. Not with --force-resume."""
    if cfg.force_resume or not cfg.experiment_name or (found := newest_fingerprint(cfg.experiment_dir)) is None:
        return None
    newest, saved, _ = found
    was = saved.get("objective")
    if not isinstance(was, dict) or objective_name(was) != objective or was.get("reference", reference) == reference:
        return None
    difference = objective_difference({"reference": was["reference"]}, {"reference": reference})
    return f"--experiment-name {cfg.experiment_name}: cannot resume from {newest}: {difference}. {RESUME_REFUSED_FIX}"


def _plain_differences(saved: dict, config: dict, cfg: TrainConfig, world_size: int | None) -> list[str]:
    """settings_a_resume_refuses's comparisons, each as `--flag: checkpoint THEN vs now NOW`."""
    changed = [
        f"--{k.replace('_', '-')}: checkpoint {saved[k]!r} vs now {v!r}"
        for k, v in (("seq_length", cfg.seq_length), ("seed", cfg.seed))
        if k in saved and saved[k] != v
    ]
    data_world = (world_size or 1) // max(1, cfg.context_parallel)
    batch = cfg.global_batch_size if cfg.global_batch_size > 0 else data_world * cfg.batch_size * cfg.grad_accum_steps
    # (a degree that does not divide the processes is refused on its own: no batch to compare then)
    known = (world_size is not None and data_world > 0 and (world_size or 1) % max(1, cfg.context_parallel) == 0) or (
        cfg.global_batch_size > 0
    )
    if known and "global_batch_size" in saved and saved["global_batch_size"] != batch:
        how = f"{data_world} processes x -b {cfg.batch_size} x --grad-accum-steps {cfg.grad_accum_steps}"
        if cfg.global_batch_size > 0:
            how = f"--global-batch-size {batch}"
        if (degree := config.get("context_parallel", 1)) != cfg.context_parallel:  # a context group trains one row
            how += f"; --context-parallel {degree} then, {cfg.context_parallel} now"
        changed.append(
            f"the global batch: checkpoint {saved['global_batch_size']!r} vs now {batch} ({how}; "
            f"{keep_batch_hint(int(saved['global_batch_size']), max(1, data_world), cfg.batch_size)})"
        )
    if (
        cfg.objective != "auto"
        and "objective" in saved
        and (then := objective_name(saved["objective"])) != cfg.objective
    ):
        changed.append(f"--objective: checkpoint {then} vs now {cfg.objective}")
    fmt = saved.get("data_format")
    if isinstance(fmt, str) and fmt.startswith(("chat:", "text")):  # one dataset of text or conversations
        whole = packs_whole(cfg, conversations=fmt.startswith("chat:"))
        if (PACKED_WHOLE in fmt) != whole:
            changed.append(packing_refusal(fmt, PACKED_WHOLE if whole else "", config))
    if "peft" in saved:
        changed += _adapter_differences(saved["peft"], config, cfg)
    if "dataset" in saved and "data_slice" in config and config["data_slice"] != cfg.data_slice:
        changed.append(f"--data-slice: checkpoint {config['data_slice']!r} vs now {cfg.data_slice!r}")
    return changed


def _adapter_differences(peft: object, config: dict, cfg: TrainConfig) -> list[str]:
    """--peft, and the rank, alpha and dropout of adapters both runs initialise from the flags (with --adapter
    they are the adapter folder's)."""
    then = peft.get("mode") if isinstance(peft, dict) else peft
    if then != cfg.peft:
        return [f"--peft: checkpoint {then} vs now {cfg.peft}"]
    if not isinstance(peft, dict) or peft.get("start") != "init" or config.get("adapter") or cfg.adapter:
        return []
    now = {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha, "dropout": cfg.lora_dropout}
    return [f"--lora-{k}: checkpoint {peft[k]!r} vs now {v!r}" for k, v in now.items() if k in peft and peft[k] != v]


def adapter_difference(was: dict, now: dict, config: dict, cfg: TrainConfig) -> str:
    """The entries in which two --peft fingerprints differ, each as the flag behind it; a changed starting adapter
    (its files' hash, or init) also with the --adapter folders of both runs, which the hashes alone do not name."""
    then, now_dir = config.get("adapter") or "none", run_settings(cfg).get("adapter") or "none"  # both absolute
    same = " (the same folder: its files changed since the run started)" if then == now_dir else ""
    folders = "" if then == now_dir == "none" else f" (--adapter {then} then, {now_dir} now{same})"

    def note(key: str) -> str:
        return folders if key == "start" else ""

    return "; ".join(
        f"{PEFT_NAMES.get(k, f'peft.{k}')}: checkpoint {was.get(k)!r} vs now {now.get(k)!r}{note(k)}"
        for k in sorted(set(was) | set(now), key=str)
        if was.get(k) != now.get(k)
    )


def objective_name(fingerprint: object) -> str:
    """The --objective a resume fingerprint's objective entry stands for: lm's is the string, DPO's and KTO's a
    dict of their settings (KTO's loss named kto), GRPO's a dict naming it."""
    if not isinstance(fingerprint, dict):
        return str(fingerprint)
    return str(fingerprint.get("objective") or ("kto" if fingerprint.get("loss") == "kto" else "dpo"))


# The flags behind the entries of a DPO, KTO or GRPO resume fingerprint ("beta" and "loss" by objective, below).
_OBJECTIVE_FLAGS = {
    "label_smoothing": "--dpo-label-smoothing", "sft_weight": "--sft-weight", "simpo_gamma": "--simpo-gamma",
    "reference": "--reference", "desirable_weight": "--kto-desirable-weight",
    "undesirable_weight": "--kto-undesirable-weight", "num_generations": "--num-generations",
    "max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p",
    "epsilon": "--epsilon / --epsilon-high", "rewards": "--reward / --reward-weights",
    "num_iterations": "--num-iterations",
    "reference_weights": "the frozen reference's weights (--model-name's files, read again by a resume; they changed "
    "since the run started)",
}  # fmt: skip
_REFERENCE_SHOWN = {"copy": "live", "adapters-off": "live (the model with its adapters off)", "none": "none"}


def objective_difference(was: dict, now: dict, notes: dict[str, str] | None = None) -> str:
    """The entries in which two objective fingerprints of one --objective differ, each as the flag behind it, with
    the values as typed (--reference live, not 'copy'; --num-iterations 1 where an earlier run left it out), and
    after an entry its note from `notes` (the reward functions whose file changed)."""
    grpo = objective_name(was) == "grpo"
    flags = {
        **_OBJECTIVE_FLAGS,
        "beta": "--grpo-beta" if grpo else "--dpo-beta",
        "loss": "--grpo-loss" if grpo else "--dpo-loss",
    }

    def shown(key: str, value: object) -> object:
        if key == "num_iterations" and value is None:
            return 1
        if key == "reference" and isinstance(value, str):
            if value.startswith("precomputed-"):  # the key of the starting weights, adapter, precision and attention
                return f"precomputed, key {value[12:]} (of the starting weights, --adapter, --precision, --attn-implementation)"
            return _REFERENCE_SHOWN.get(value, value)
        return value

    return "; ".join(
        f"{flags.get(k, k)}: checkpoint {shown(k, was.get(k))!r} vs now {shown(k, now.get(k))!r}{(notes or {}).get(k, '')}"
        for k in sorted(set(was) | set(now), key=str)
        if was.get(k) != now.get(k)
    )


def without_reference_weights(saved: object, now: object) -> bool:
    """Whether two objective fingerprints agree once the live reference's weights identity, which a checkpoint of an
    older version lacks, is left out of the current one."""
    if not (isinstance(saved, dict) and isinstance(now, dict)) or "reference_weights" in saved:
        return False
    return saved == {k: v for k, v in now.items() if k != "reference_weights"}


def keep_batch_hint(batch: int, ranks: int, micro: int) -> str:
    """How a launch of `ranks` data-parallel processes at -b `micro` keeps a run's global batch: --global-batch-size
    where -b divides it over them, else with the largest -b that does (or that none does)."""
    if batch % (ranks * micro) == 0:
        return f"--global-batch-size {batch} keeps it on any process count that divides it"
    fits = [b for b in range(min(micro, batch // ranks), 0, -1) if batch % (ranks * b) == 0]
    if fits:
        return f"--global-batch-size {batch} -b {fits[0]} keeps it on {ranks} data-parallel processes"
    return f"{batch} sequences do not split over {ranks} data-parallel processes: resume on a count that divides it"


def _train_on_hint(final: Path) -> str:
    """How to go on from an experiment's export: a model folder (-m), an adapter (--adapter), or nothing."""
    if (final / "adapter_config.json").is_file():
        return f" (--adapter {final} with the same -m trains on from its adapter)"
    if (final / "config.json").is_file():
        return f" (-m {final} trains on from its export)"
    return ""


def same_names_not_ours(folder: Path) -> list[str]:
    """Entries named as a run's (config.yaml, metrics.jsonl, tensorboard/, ...) in a folder that shows no run (no
    lock, state, checkpoint or export) and whose config.yaml does not name this experiment: another tool's outputs,
    which a run replaced by name ([] when they are a run's, or there are none)."""
    present = sorted(name for name in EXPERIMENT_ENTRIES if (folder / name).exists())
    if not present or any(name in present for name in (EXPERIMENT_LOCK, EXPERIMENT_STATE, "checkpoint", "final")):
        return []
    try:
        saved = yaml.safe_load((folder / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        saved = None
    return [] if isinstance(saved, dict) and saved.get("experiment_name") == folder.name else present


def foreign_entries(experiment: Path) -> list[str]:
    """What an experiment folder holds that fsdp_train.py did not write ([] for none, or no folder)."""
    try:
        names = sorted(p.name for p in experiment.iterdir()) if experiment.is_dir() else []
    except OSError:
        return []
    return [n for n in names if n not in EXPERIMENT_ENTRIES and not _HARMLESS.fullmatch(n)]


# Beside fsdp_train.py's own entries: its temporaries (.NAME.tmp..., .NAME.old, the lock's .run.lock.HOST.PID), the
# launch's logs (tee, Slurm's --output) and file-system debris; none of them is replaced by a run.
_HARMLESS = re.compile(rf"\..+\.(tmp.*|old)|\.{re.escape(EXPERIMENT_LOCK)}\..+|.+\.(log|out|err)|\.nfs.*|\.DS_Store")


def lost_checkpoint(experiment: Path) -> str | None:
    """What shows that an experiment trained before (its state.json naming a checkpoint, or final/) when no complete
    checkpoint is left in checkpoint/: a rerun would start from step 0 and replace final/ and metrics.jsonl."""
    try:
        if step_dirs(experiment / "checkpoint"):
            return None
    except OSError:  # unreadable: the run's own reads say so, with the path
        return None
    state = experiment / EXPERIMENT_STATE
    try:
        saved = json.loads(state.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        saved = None
    if isinstance(saved, dict) and "latest_checkpoint" in saved:
        return f"{state} names checkpoint {saved['latest_checkpoint']} (step {saved.get('step', '?')})"
    if (experiment / "final").is_dir():
        return f"{experiment / 'final'} holds a finished run's export"
    return None
