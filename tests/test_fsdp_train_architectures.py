"""The architecture matrix: every family the README lists, loaded, trained and exported for real.

One torchrun launch (2 processes, gloo) per architecture runs tests/fsdp_arch_check.py: sharded load equals
`from_pretrained` bit for bit, 3 training steps lower the loss, and `from_pretrained` of the export
reproduces the trained parameters and logits.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import fsdp_train as ft
from tests.fsdp_helpers import REPO_ROOT, losses_by_step, make_dataset, make_model, trainer_args

MATRIX = [
    ("llama", True),
    ("llama", False),
    ("qwen2", False),
    ("mistral", False),
    ("gemma", True),
    ("gemma2", True),
    ("gemma3_text", True),
    ("phi3", False),
    ("gpt2", True),
    ("opt", True),
    ("gpt_neox", True),
    ("mixtral", False),
    ("qwen2_moe", False),
    ("olmoe", False),
    ("qwen3_moe", False),
]


@pytest.fixture(scope="module")
def matrix_dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("data") / "corpus", validation=False, n_docs=48)


@pytest.mark.parametrize("arch,tied", MATRIX, ids=[f"{a}-{'tied' if t else 'untied'}" for a, t in MATRIX])
def test_load_train_export(tmp_path, matrix_dataset, arch, tied):
    model = make_model(tmp_path / "model", arch=arch, with_weights=True, tied=tied)  # fp32: the export is exact
    args = [*trainer_args("run", matrix_dataset, model, tmp_path), "--max-steps", "3", "-b", "2", "--lr", "1e-2"]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        + ["tests/fsdp_arch_check.py", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("LOAD EQUAL") == 2, out  # both ranks compared every parameter
    assert "EXPORT REPRODUCES" in out, out
    losses = losses_by_step(tmp_path / "run")
    assert sorted(losses) == [1, 2, 3] and losses[3] < losses[1], losses


def test_attn_implementation_is_honoured_or_reported_with_the_flag(tmp_path):
    model = make_model(tmp_path / "gemma2", arch="gemma2")
    assert ft.build_model_skeleton(model, "auto").config._attn_implementation == "eager"  # no SDPA in Gemma2
    assert ft.build_model_skeleton(model, "eager").config._attn_implementation == "eager"
    with pytest.raises(ft.TrainError, match="--attn-implementation sdpa"):
        ft.build_model_skeleton(model, "sdpa")
