"""Which flags belong to which objective (DPO, KTO, GRPO), whether a run changed them from their defaults, and the
problems of those flags: checked before any process group (checks.validate_config, with --objective given) and
again once the data resolve --objective auto (data/plan.py). No torch."""

from __future__ import annotations

import dataclasses
import math

from fsdp_lib.config import TrainConfig

DPO_FLAGS = ("dpo_beta", "dpo_loss", "simpo_gamma", "dpo_label_smoothing", "sft_weight", "reference")
KTO_FLAGS = ("kto_desirable_weight", "kto_undesirable_weight")
PREFERENCE_OBJECTIVES = ("dpo", "kto")  # trained on PairBlocks: DPO's pairs, KTO's examples with their KL sequences
REFERENCE_FREE_LOSSES = ("simpo", "orpo")  # --dpo-loss values that use no reference model
GRPO_FLAGS = (
    "num_generations", "max_new_tokens", "temperature", "top_p", "reward", "reward_weights", "reward_pattern",
    "reward_timeout_s", "grpo_loss", "epsilon", "epsilon_high", "grpo_beta", "rollout_unshard", "num_iterations",
)  # fmt: skip


def changed_flags(cfg: TrainConfig, names: tuple[str, ...]) -> list[str]:
    """Those of the fields `names` set to something other than their default, as --flag names."""
    defaults = {
        f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        for f in dataclasses.fields(TrainConfig)
    }
    return [f"--{n.replace('_', '-')}" for n in names if getattr(cfg, n) != defaults[n]]


def changed_dpo_flags(cfg: TrainConfig) -> list[str]:
    """The preference flags (DPO_FLAGS) set to something other than their default, as --flag names."""
    return changed_flags(cfg, DPO_FLAGS)


def flags_apply(flags: list[str], negated: bool = False) -> str:
    """'--a applies' or '--a, --b apply' ('does not apply', 'do not apply'): a message's start."""
    verb = ("does not apply" if negated else "applies") if len(flags) == 1 else ("do not apply" if negated else "apply")
    return f"{', '.join(flags)} {verb}"


def grpo_conflicts(cfg: TrainConfig, why: str) -> list[str]:
    """What a GRPO run cannot take, one problem each, whether --objective grpo was given or auto chose it from the
    data (checks.py and data.objective.resolve_objective); `why` says which ("this run is --objective grpo", ...)."""
    problems = []
    if changed_dpo_flags(cfg):
        problems.append(f"{flags_apply(changed_dpo_flags(cfg))} to --objective dpo; {why}: drop them")
    if cfg.fp8 != "off":
        problems.append(
            f"--fp8 {cfg.fp8}: {why}, and generation through float8 layers is not built or tested; leave --fp8 off"
        )
    if cfg.loss_on != "assistant":
        problems.append(
            f"--loss-on {cfg.loss_on}: {why}, whose loss is on the sampled completions' tokens only (never the "
            "prompt's); leave --loss-on at its default"
        )
    return problems


def need(flags: list[str]) -> str:
    """'--a needs' or '--a, --b need': the start of a message about flags that only apply with another one."""
    return f"{', '.join(flags)} {'needs' if len(flags) == 1 else 'need'}"


def preference_problems(cfg: TrainConfig) -> list[str]:
    """The preference flags: only with --objective dpo (or auto, where the dataset decides), and in range."""
    if cfg.objective == "lm":
        changed = changed_dpo_flags(cfg) + changed_flags(cfg, KTO_FLAGS)
        return [f"{need(changed)} --objective dpo or kto (got --objective lm)"] if changed else []
    problems = _kto_problems(cfg)
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
    problems += _reference_free_problems(cfg)
    if cfg.reference == "live" and cfg.peft != "none" and cfg.adapter:
        problems.append(
            f"--reference live with --peft {cfg.peft} means adapters off, which is the base without --adapter "
            f"{cfg.adapter}, not the starting model; use --reference precomputed (or auto)"
        )
    if cfg.objective in PREFERENCE_OBJECTIVES and cfg.document_masking == "off":
        problems.append(
            f"--objective {cfg.objective} packs a pair's sequences (KTO: an example and its KL sequence) as separate "
            "documents: it needs --document-masking on"
        )
    return problems


def _kto_problems(cfg: TrainConfig) -> list[str]:
    """KTO's weights, and the DPO-only flags it has no use for (it reuses --dpo-beta and --reference)."""
    if cfg.objective not in ("kto", "auto"):
        changed = changed_flags(cfg, KTO_FLAGS)
        return [f"{need(changed)} --objective kto (got --objective {cfg.objective})"] if changed else []
    problems = []
    for flag, weight in (("--kto-desirable-weight", cfg.kto_desirable_weight),
                         ("--kto-undesirable-weight", cfg.kto_undesirable_weight)):  # fmt: skip
        if not math.isfinite(weight) or weight < 0:
            problems.append(f"{flag} must be a number >= 0 (got {weight}); 1 is usual")
    if cfg.kto_desirable_weight == 0 and cfg.kto_undesirable_weight == 0:
        problems.append("--kto-desirable-weight and --kto-undesirable-weight are both 0: nothing would be trained")
    dpo_only = [flag for flag in changed_dpo_flags(cfg) if flag not in ("--dpo-beta", "--reference")]
    if cfg.objective == "kto" and dpo_only:
        problems.append(
            f"{flags_apply(dpo_only)} to --objective dpo; --objective kto takes --dpo-beta, --reference and "
            "--kto-desirable-weight / --kto-undesirable-weight"
        )
    return problems


def grpo_problems(cfg: TrainConfig) -> list[str]:
    """The GRPO flags: only with --objective grpo, and in range. With auto the dataset decides first:
    data.objective.resolve_objective runs these checks once auto has become grpo (and refuses the flags otherwise). The
    reward files are imported later, in fsdp_train.main (rewards.reward_problems)."""
    if cfg.objective in ("lm", *PREFERENCE_OBJECTIVES):
        changed = changed_flags(cfg, GRPO_FLAGS)
        return [f"{need(changed)} --objective grpo (got --objective {cfg.objective})"] if changed else []
    if cfg.objective == "auto":
        return []
    problems = []
    if not cfg.reward:
        problems.append(
            "--objective grpo needs at least one --reward: FILE.py:FUNCTION, or a built-in (accuracy, format)"
        )
    return problems + grpo_conflicts(cfg, "this run is --objective grpo") + grpo_range_problems(cfg)


def reward_timeout(cfg: TrainConfig) -> float:
    """--reward-timeout-s as given, else its default or half of --collective-timeout-s, whichever is less (the
    other processes wait for this one's rewards in a collective)."""
    if changed_flags(cfg, ("reward_timeout_s",)):
        return cfg.reward_timeout_s
    return min(cfg.reward_timeout_s, cfg.collective_timeout_s / 2)


def grpo_range_problems(cfg: TrainConfig) -> list[str]:
    """The GRPO flags' values, each problem naming its flag."""
    problems = []
    if changed_flags(cfg, ("reward_pattern",)) and "format" not in cfg.reward:  # it would be silently unused
        problems.append("--reward-pattern is what --reward format checks; add --reward format or drop --reward-pattern")
    if cfg.num_generations < 2:
        problems.append(
            f"--num-generations must be at least 2 (got {cfg.num_generations}): advantages compare the completions "
            "of one prompt; 8-16 is usual"
        )
    if cfg.num_iterations < 1:
        problems.append(f"--num-iterations must be at least 1 (got {cfg.num_iterations}); 1 samples every step")
    if cfg.max_new_tokens < 1:
        problems.append(f"--max-new-tokens must be at least 1 (got {cfg.max_new_tokens})")
    elif cfg.max_new_tokens >= cfg.seq_length:
        problems.append(
            f"--max-new-tokens {cfg.max_new_tokens} leaves no room for a prompt in --seq-length {cfg.seq_length} "
            "(prompt + completion); raise --seq-length or lower --max-new-tokens"
        )
    if cfg.grpo_beta and cfg.peft != "none" and cfg.adapter:
        problems.append(
            f"--grpo-beta {cfg.grpo_beta} with --peft {cfg.peft} takes the KL to the model with its adapters off, which "
            f"is the base without --adapter {cfg.adapter}, not the starting model; start from a model folder with the "
            "adapter merged in (its run's final-merged/, --export-merged on), or set --grpo-beta 0"
        )
    if not cfg.reward_timeout_s >= 0 or not math.isfinite(cfg.reward_timeout_s):
        problems.append(f"--reward-timeout-s must be a number of seconds, 0 or more (got {cfg.reward_timeout_s})")
    elif changed_flags(cfg, ("reward_timeout_s",)) and cfg.reward_timeout_s >= cfg.collective_timeout_s:
        problems.append(
            f"--reward-timeout-s {cfg.reward_timeout_s:g} is not below --collective-timeout-s "
            f"{cfg.collective_timeout_s}: the other processes, waiting for this one's rewards, would time out first "
            "with no word of the function; lower --reward-timeout-s or raise --collective-timeout-s"
        )
    if not cfg.temperature > 0 or not math.isfinite(cfg.temperature):
        problems.append(f"--temperature must be a positive number (got {cfg.temperature}); GRPO samples, 1.0 is usual")
    if not 0.0 < cfg.top_p <= 1.0:
        problems.append(f"--top-p must be in (0, 1] (got {cfg.top_p})")
    if not 0.0 < cfg.epsilon < 1.0:
        problems.append(f"--epsilon must be in (0, 1) (got {cfg.epsilon}); 0.2 is usual")
    if cfg.epsilon_high and not cfg.epsilon_high >= cfg.epsilon:
        problems.append(
            f"--epsilon-high {cfg.epsilon_high} is below --epsilon {cfg.epsilon}; clip-higher raises the upper bound "
            "(DAPO: 0.28), 0 keeps it at --epsilon"
        )
    if not cfg.grpo_beta >= 0 or not math.isfinite(cfg.grpo_beta):
        problems.append(f"--grpo-beta must not be negative (got {cfg.grpo_beta}); 0 = no KL term")
    return problems


def _reference_free_problems(cfg: TrainConfig) -> list[str]:
    """SimPO and ORPO use no reference model; ORPO has its own NLL term; --simpo-gamma is SimPO's."""
    problems = []
    if not math.isfinite(cfg.simpo_gamma) or cfg.simpo_gamma < 0:
        problems.append(f"--simpo-gamma must not be negative (got {cfg.simpo_gamma}); 0.5 is usual")
    elif cfg.simpo_gamma != 0.5 and cfg.dpo_loss != "simpo":
        problems.append(f"--simpo-gamma applies to --dpo-loss simpo (got --dpo-loss {cfg.dpo_loss})")
    if cfg.dpo_loss in REFERENCE_FREE_LOSSES and cfg.reference != "auto":
        problems.append(
            f"--reference {cfg.reference}: --dpo-loss {cfg.dpo_loss} is reference-free (no reference model is "
            "computed or built); leave --reference out"
        )
    if cfg.dpo_loss == "orpo" and cfg.sft_weight:
        problems.append(
            "--sft-weight: --dpo-loss orpo already adds the chosen response's NLL (weight 1) and weighs its "
            "odds-ratio term with --dpo-beta; leave --sft-weight out"
        )
    return problems
