"""Which objective a dataset trains: --objective auto follows its columns (pairs: dpo, unpaired examples: kto,
prompts: grpo, text or conversations: lm), an explicit --objective must fit them, and the flags of the other
objectives are refused; a mixture holds text and conversations only. Read before anything is tokenised (by
plan.load_source and --dry-run's describe_datasets). No torch."""

from __future__ import annotations

from fsdp_lib.config import TrainConfig
from fsdp_lib.errors import TrainError
from fsdp_lib.objective_flags import (
    GRPO_FLAGS,
    KTO_FLAGS,
    changed_dpo_flags,
    changed_flags,
    flags_apply,
    grpo_conflicts,
    grpo_range_problems,
)
from fsdp_lib.records.dataset import load_text_dataset
from fsdp_lib.records.schema import dataset_kind


def check_mixture_kinds(cfg: TrainConfig) -> None:
    """A mixture trains text and conversations: a dataset of pairs or prompts in it is named before any dataset's
    objective is resolved (with text first and the GRPO flags given, the text dataset was blamed for them)."""
    if len(cfg.dataset_name) < 2:
        return
    for name in cfg.dataset_name:
        try:
            kind = dataset_kind(load_text_dataset(name, cfg.text_column or None)[0].column_names)
        except ValueError:
            continue  # load_source says what is wrong with it
        if kind in ("preference", "unpaired", "prompts"):
            what = "prompts" if kind == "prompts" else "preference data"
            raise TrainError(f"--dataset-name {name} holds {what}, which train alone; give -d once")


def objective_of(cfg: TrainConfig, columns: list[str], name: str) -> str:
    """resolve_objective for dataset `name` of the run, which must then be its only dataset unless it trains lm."""
    objective = resolve_objective(cfg, columns, name)
    if objective in ("dpo", "kto", "grpo") and len(cfg.dataset_name) > 1:
        what = "prompts" if objective == "grpo" else "preference data"
        raise TrainError(
            f"--dataset-name {name} holds {what}, which train alone (--objective {objective}); give -d once"
        )
    return objective


def resolve_objective(cfg: TrainConfig, columns: list[str], name: str = "") -> str:
    """--objective as lm, dpo, kto or grpo: auto follows the dataset; an explicit choice must fit it."""
    name = name or cfg.datasets_label
    kind = dataset_kind(columns)
    if cfg.objective == "kto" or (cfg.objective == "auto" and kind == "unpaired"):
        return resolve_kto(cfg, columns, kind, name)
    if kind == "unpaired":
        raise TrainError(
            f"--objective {cfg.objective}: --dataset-name {name} holds unpaired preference examples (prompt, "
            "completion, label); train them with --objective kto (or auto)"
        )
    if changed_flags(cfg, KTO_FLAGS):
        raise TrainError(
            f"{flags_apply(changed_flags(cfg, KTO_FLAGS))} to --objective kto; --dataset-name {name} has the "
            f"columns {columns} (--objective {cfg.objective})"
        )
    preference = kind == "preference"
    if cfg.objective == "grpo" or (cfg.objective == "auto" and kind == "prompts"):
        if "prompt" not in columns or preference:
            raise TrainError(
                f"--objective grpo: --dataset-name {name} has the columns {columns}; it needs a 'prompt' column (and "
                "no chosen/rejected); convert prompts with: python data_hf.py --format prompts ..."
            )
        if not cfg.reward:
            raise TrainError(
                f"--dataset-name {name} holds prompts (--objective auto: grpo), which train with rewards: give "
                "--reward FILE.py:FUNCTION or a built-in (accuracy, format)"
            )
        # what checks.py refuses for an explicit --objective grpo, once auto has become grpo here
        why = f"--dataset-name {name} holds prompts (--objective auto: grpo)"
        if problems := grpo_conflicts(cfg, why) + grpo_range_problems(cfg):
            raise TrainError("; ".join(problems))
        return "grpo"
    if changed_flags(cfg, GRPO_FLAGS):
        raise TrainError(
            f"{flags_apply(changed_flags(cfg, GRPO_FLAGS))} to --objective grpo, on prompts only; --dataset-name "
            f"{name} has the columns {columns}"
        )
    if cfg.objective == "dpo" and not preference:
        raise TrainError(
            f"--objective dpo: --dataset-name {name} has the columns {columns}, not prompt, chosen and "
            f"rejected; convert preference pairs with: python data_hf.py --format preference ..."
        )
    if cfg.objective == "lm" and kind == "prompts":
        raise TrainError(
            f"--objective lm: --dataset-name {name} holds prompts only (the columns {columns}: no 'text' or "
            "'messages'), nothing to train a language model on; train them with --objective grpo and --reward, or "
            "pass --text-column NAME to train on a column of text"
        )
    if cfg.objective == "lm" and preference:
        raise TrainError(
            f"--objective lm: --dataset-name {name} holds preference pairs (prompt, chosen, rejected); "
            f"train them with --objective dpo (or auto), or convert the chosen conversations with --format chat"
        )
    if not preference:
        if changed_dpo_flags(cfg):
            raise TrainError(
                f"{', '.join(changed_dpo_flags(cfg))} apply to preference data; --dataset-name {name} "
                f"has the columns {columns}"
            )
        return "lm"
    if cfg.document_masking == "off":
        raise TrainError(
            f"--dataset-name {name} holds preference pairs: --objective dpo packs a pair's sequences as "
            f"separate documents and needs --document-masking on"
        )
    if cfg.loss_on != "assistant":
        raise TrainError(
            f"--loss-on {cfg.loss_on}: --dataset-name {name} holds preference pairs, whose log-probabilities "
            f"are those of the responses' assistant turns; leave --loss-on at its default"
        )
    return "dpo"


def resolve_kto(cfg: TrainConfig, columns: list[str], kind: str | None, name: str) -> str:
    """--objective kto: the dataset holds unpaired examples (prompt, completion, label) or pairs (unpaired)."""
    if kind not in ("unpaired", "preference"):
        raise TrainError(
            f"--objective kto: --dataset-name {name} has the columns {columns}; it needs prompt, completion and "
            "label (unpaired examples, TRL's shape) or prompt, chosen and rejected (pairs: data_hf.py --format "
            "preference), which KTO unpairs"
        )
    if cfg.loss_on != "assistant":
        raise TrainError(
            f"--loss-on {cfg.loss_on}: --objective kto scores the completions' assistant turns; leave --loss-on at "
            "its default"
        )
    others = changed_flags(cfg, GRPO_FLAGS) + [
        f for f in changed_dpo_flags(cfg) if f not in ("--dpo-beta", "--reference")
    ]
    if others:  # also when --objective auto chose kto: flags of another objective would be ignored silently
        raise TrainError(
            f"{flags_apply(others, negated=True)} to --objective kto (--dataset-name {name}); it takes --dpo-beta, "
            "--reference and --kto-desirable-weight / --kto-undesirable-weight"
        )
    if cfg.document_masking == "off":
        raise TrainError(
            f"--dataset-name {name}: --objective kto packs each example and its KL sequence as separate documents "
            "and needs --document-masking on"
        )
    return "kto"
