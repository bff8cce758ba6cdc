"""The objective a run trains: the language-model loss (None here: the training forward is the objective), DPO on
preference pairs (dpo.py), KTO on unpaired examples (kto.py) or GRPO on prompts with rewards (grpo.py), as the data
plan resolved --objective. Each has begin_step, which the loop calls with a step's micro-batches before they run
(GRPO samples its completions there, KTO measures its reference point)."""

from __future__ import annotations

from fsdp_lib.config import TrainConfig
from fsdp_lib.data.plan import TrainData
from fsdp_lib.model.build import ModelBundle
from fsdp_lib.objective_flags import PREFERENCE_OBJECTIVES
from fsdp_lib.runtime import Dist
from fsdp_lib.train.dpo import DPOObjective, build_dpo, reference_mode
from fsdp_lib.train.grpo import GRPOObjective, build_grpo
from fsdp_lib.train.kto import KTOObjective, build_kto

Objective = DPOObjective | KTOObjective | GRPOObjective


def build_objective(
    cfg: TrainConfig, bundle: ModelBundle, data: TrainData, precision: str, d: Dist
) -> tuple[Objective | None, dict | str]:
    """(the objective, or None for --objective lm; what a resume must agree with), before any checkpoint is
    loaded."""
    if data.objective == "dpo":
        return build_dpo(cfg, bundle, data, precision, d)
    if data.objective == "kto":
        return build_kto(cfg, bundle, data, precision, d)
    if data.objective == "grpo":
        return build_grpo(cfg, bundle, data, precision, d)
    return None, "lm"


def needs_starting_weights(cfg: TrainConfig, objective: str) -> bool:
    """Whether a resumed run still reads the model folder's weights, which the checkpoint then replaces: with
    --peft (the checkpoint holds the adapters, the frozen base is the folder's) and for a DPO or KTO reference
    precomputed by the starting model (computed before the checkpoint loads where its cache is missing)."""
    return cfg.peft != "none" or (objective in PREFERENCE_OBJECTIVES and reference_mode(cfg) == "precomputed")
