"""Run under torchrun: build a model the way fsdp_train.py does (meta, fully_shard, sharded load) and
compare every gathered parameter and buffer with `from_pretrained` on one process. Exits non-zero on mismatch."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from fsdp_lib.config import TrainConfig
from fsdp_lib.interrupts import exit_without_teardown
from fsdp_lib.model import hf_weights
from fsdp_lib.model.anatomy import clean_fqn
from fsdp_lib.model.build import build_model, check_still_tied
from fsdp_lib.runtime import setup_distributed

readers = []  # what hf_weights.hf_reader built: the thread count the load used


def recording_reader(model_dir, threads):
    reader = reader_of(model_dir, threads)
    readers.append(reader)
    return reader


reader_of, hf_weights.hf_reader = hf_weights.hf_reader, recording_reader


def main(model_dir: str, sharding: str) -> int:
    cfg = TrainConfig(model_name=model_dir, sharding=sharding, seq_length=32, activation_checkpointing="on")
    d = setup_distributed(cfg)
    bundle = build_model(cfg, "fp32", d)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    expected = dict(reference.named_parameters()) | dict(reference.named_buffers())
    mismatched = []
    for name, tensor in [*bundle.model.named_parameters(), *bundle.model.named_buffers()]:
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        if not torch.equal(full.cpu(), expected[clean_fqn(name)]):
            mismatched.append(name)
    check_still_tied(bundle.model)
    dist.destroy_process_group()
    if mismatched:
        print(f"MISMATCH {mismatched}")
        return 1
    print(f"ALL {len(expected)} TENSORS EQUAL")
    files = {f.name for f in Path(model_dir).glob("*.safetensors")}
    print(f"READ {len(files)} FILES WITH {readers[0].thread_count} THREADS")
    return 0


if __name__ == "__main__":
    exit_without_teardown(main(sys.argv[1], sys.argv[2]))
