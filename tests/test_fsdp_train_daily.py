"""Daily-use flags: --global-batch-size (and its resume on another process count), base-model evaluation at
step 0, loss.png, --data-slice and --export-dtype."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_lib.arguments import parse_data_slice
from fsdp_lib.checks import _batch_problems, validate_config
from fsdp_lib.config import TrainConfig, load_config
from tests.fsdp_helpers import losses_by_step, output_of, run_trainer, trainer_args


def _records(exp: Path) -> list[dict]:
    return [json.loads(x) for x in (exp / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.mark.parametrize(
    "flags,world,message",
    [
        (["--global-batch-size", "6", "-b", "2"], 2, "not a multiple of processes x --batch-size (2 x 2 = 4)"),
        (["--global-batch-size", "8", "-b", "2", "--grad-accum-steps", "3"], 2, "contradicts --global-batch-size"),
        (["--data-slice", "10-20"], 1, "--data-slice '10-20': expected START:END"),
    ],
)
def test_bad_batch_and_slice_flags_name_the_flag(inputs, tmp_path, flags, world, message):
    cfg = load_config(trainer_args("x", *inputs, tmp_path) + flags)
    assert any(message in p for p in validate_config(cfg, world)), validate_config(cfg, world)


def test_too_few_blocks_for_one_batch_names_the_fix_of_its_objective():
    """Fewer train blocks than one global batch: a shorter --seq-length adds blocks of text, not of pairs (packed
    whole) nor of prompts (a longer one fits more of them); the batch flag named is the one the user set."""
    from fsdp_lib.data.plan import too_few_blocks_fix

    assert too_few_blocks_fix(TrainConfig(), "text") == "lower --seq-length or --batch-size or --grad-accum-steps"
    pairs = too_few_blocks_fix(TrainConfig(global_batch_size=4, data_slice="0:2"), "dpo")
    assert pairs.startswith("lower --global-batch-size (each pair or example is packed whole") and pairs.endswith(
        "or a wider --data-slice than 0:2"
    )
    assert "raise --seq-length or lower --max-new-tokens" in too_few_blocks_fix(TrainConfig(), "grpo")
    assert too_few_blocks_fix(TrainConfig(), "grpo", skipped=False) == "lower --batch-size or --grad-accum-steps"
    assert too_few_blocks_fix(TrainConfig(), "kto") == too_few_blocks_fix(TrainConfig(), "dpo")


def test_global_batch_size_sets_the_accumulation():
    cfg = TrainConfig(global_batch_size=16, batch_size=2)
    assert _batch_problems(cfg, 4) == [] and cfg.grad_accum_steps == 2
    assert parse_data_slice("5:") == (5, None) and parse_data_slice(":7") == (0, 7)
    assert parse_data_slice(" : ") == (0, None) and parse_data_slice(" 2 : 9 ") == (2, 9)  # spaces, as typed in YAML


def test_same_command_resumes_on_one_process_with_global_batch_size(inputs, tmp_path):
    """2 processes x -b 2 (accum 1), then the same command on 1 process (accum 2): one run, one base evaluation."""
    args = trainer_args("gbs", *inputs, tmp_path) + ["-b", "2", "--global-batch-size", "4", "--ckpt-freq", "3"]
    first = run_trainer(args + ["--max-steps", "3"])
    assert first.returncode == 0, output_of(first)
    second = run_trainer(args + ["--max-steps", "6"], nproc=1)
    out = output_of(second)
    assert second.returncode == 0, out
    assert "resumed from" in out and "world size changed (2 -> 1)" in out and "(1 x 2 x 2)" in out
    assert sorted(losses_by_step(tmp_path / "gbs")) == [1, 2, 3, 4, 5, 6]
    base = [r for r in _records(tmp_path / "gbs") if r["step"] == 0]
    assert len(base) == 1 and base[0]["val_loss"] > 0 and "val_ppl" in base[0]
    assert (tmp_path / "gbs" / "loss.png").stat().st_size > 1000


def test_data_slice_and_export_dtype(inputs, tmp_path):
    args = trainer_args("sl", *inputs, tmp_path) + ["--data-slice", "0:40", "--max-steps", "1000"]
    args += ["--export-dtype", "fp32", "--eval-at-start", "off"]
    result = run_trainer(args, nproc=1)  # the rows and the exported dtype, not the processes
    out = output_of(result)
    assert result.returncode == 0, out
    assert "--data-slice 0:40: training on rows 0..39 of 144" in out
    # the slice runs out long before --max-steps: said at the start, with the fix
    assert "WARNING: --max-steps 1000 is more than --num-epochs 1 x" in out and "raise --num-epochs" in out
    assert not [r for r in _records(tmp_path / "sl") if r["step"] == 0]
    config = json.loads((tmp_path / "sl" / "final" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "float32"  # the model itself ships in bf16
    empty = run_trainer(trainer_args("sl2", *inputs, tmp_path) + ["--data-slice", "500:", "--max-steps", "1"], nproc=1)
    assert empty.returncode != 0 and "selects none" in output_of(empty)


def test_an_export_dtype_that_overflows_is_refused_and_the_checkpoint_exports_in_another(inputs, tmp_path):
    """A trained value beyond fp16's 65,504 became inf in the exported folder, and the log said only 'exported
    (torch.float16)'. Refused before anything is written, naming the tensor; --export-only in bf16 then works."""
    import shutil

    from safetensors.torch import load_file, save_file

    dataset, model = inputs
    big = tmp_path / "big_model"
    shutil.copytree(model, big)
    for path in big.glob("*.safetensors"):
        weights = load_file(path)
        name = next(k for k in weights if k.endswith("input_layernorm.weight"))
        weights[name][0] = 1e5
        save_file(weights, path, metadata={"format": "pt"})
    args = trainer_args("fp16", dataset, big, tmp_path) + ["--max-steps", "1", "--eval-at-start", "off"]
    result = run_trainer([*args, "--export-dtype", "fp16"], nproc=1)
    out = output_of(result)
    assert result.returncode != 0 and "--export-dtype float16: 1 trained value(s) exceed its range (65,504)" in out, out
    assert "input_layernorm.weight (1)" in out and "--export-only --export-dtype bf16" in out and "Traceback" not in out
    assert not (tmp_path / "fp16" / "final").exists()
    again = run_trainer([*args, "--export-only", "--export-dtype", "bf16"], nproc=1)
    assert again.returncode == 0, output_of(again)
    assert (tmp_path / "fp16" / "final" / "config.json").is_file()
