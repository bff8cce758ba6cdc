"""Run under torchrun with one process and fsdp_train.py's flags: the LoRA fine-tune built directly with peft on the
unsharded Hugging Face model (from_pretrained, get_peft_model), without FSDP, fed the trainer's own batches (its data
plan) with the same adapter initialisation, AdamW settings, clipping and schedule. Writes
EXPERIMENT_DIR/reference.json: the loss of each step and the final adapter tensors by adapter_key."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, as for fsdp_train.py
from fsdp_lib.checks import validate_config  # noqa: E402
from fsdp_lib.config import load_config  # noqa: E402
from fsdp_lib.data.plan import build_data, total_steps  # noqa: E402
from fsdp_lib.interrupts import exit_without_teardown  # noqa: E402
from fsdp_lib.model.adapters import adapter_key, init_adapters  # noqa: E402
from fsdp_lib.offline import resolve_model_dir  # noqa: E402
from fsdp_lib.runtime import setup_distributed  # noqa: E402
from fsdp_lib.train.optim import lr_at  # noqa: E402


def main(argv: list[str]) -> int:
    cfg = load_config(argv)
    assert not validate_config(cfg, 1)
    d = setup_distributed(cfg)
    model_dir = resolve_model_dir(cfg.model_name)
    data = build_data(cfg, model_dir, d)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.use_cache = False  # as the trainer: with a cache, transformers ignores packed documents' positions
    targets = cfg.lora_target_modules.split(",")
    model = get_peft_model(model, LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=targets))
    init_adapters(model, cfg.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=True)
    plan, last = data.train, total_steps(cfg, data.train)
    order = plan.epoch_order(0)
    losses = {}
    for step in range(last):
        micro_batches, trained = plan.micro_batches(order, step), plan.trained_tokens(order, step)
        total = 0.0
        for batch in micro_batches:
            logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch.labels.flatten(), reduction="sum")
            (loss / trained).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg, last)
        optimizer.step()
        optimizer.zero_grad()
        losses[step + 1] = total / trained
    adapters = {adapter_key(n): p.detach().tolist() for n, p in model.named_parameters() if p.requires_grad}
    cfg.experiment_dir.mkdir(parents=True, exist_ok=True)
    (cfg.experiment_dir / "reference.json").write_text(json.dumps({"losses": losses, "adapters": adapters}))
    return 0


if __name__ == "__main__":
    exit_without_teardown(main(sys.argv[1:]))
