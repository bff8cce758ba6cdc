"""--wandb on: an offline Weights & Biases run that logs what metrics.jsonl holds, plus the resolved config, and that
a resume continues; a clear flag error when the package is missing. W&B never reaches its server here."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

import fsdp_train as ft
from fsdp_lib.checks import validate_config
from fsdp_lib.config import TrainConfig, load_config
from fsdp_lib.train.metrics import start_wandb
from tests.fsdp_helpers import output_of, run_trainer, trainer_args

OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}


def wandb_records(path: Path) -> list:
    """The protobuf records of a .wandb file: W&B's own LevelDB-style log (7-byte file header, 32 KiB blocks,
    each chunk a 7-byte header: crc32c, length, type FULL=1 FIRST=2 MIDDLE=3 LAST=4). wandb 0.31 no longer ships
    a Python reader (its Go core writes the file), so this reads the format that `wandb sync` reads."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", f"{path} is not a W&B log"
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # block trailer / zero padding
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def read_offline_run(run_dir: Path) -> dict:
    """run id, config and the history rows (without W&B's own _step/_runtime/_timestamp) of one offline run."""
    (log_file,) = run_dir.glob("run-*.wandb")
    run_id, config, history = None, {}, []
    for record in wandb_records(log_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
        elif kind == "config":
            config.update({u.key: json.loads(u.value_json) for u in record.config.update})
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history.append({k: v for k, v in items.items() if not k.startswith("_")})
    return {"id": run_id, "config": config, "history": history}


def metrics_records(exp: Path) -> list[dict]:
    rows = [json.loads(x) for x in (exp / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [{k: v for k, v in r.items() if k != "time"} for r in rows]


def test_offline_run_logs_the_metrics_and_config_and_a_resume_continues_it(inputs, tmp_path):
    args = trainer_args("wb", *inputs, tmp_path) + ["--wandb", "on", "--ckpt-freq", "3", "--eval-max-blocks", "2"]
    first = run_trainer(args + ["--max-steps", "3"], nproc=1, env=OFFLINE)  # rank 0 logs: one process
    assert first.returncode == 0, output_of(first)
    exp = tmp_path / "wb"
    run_id = (exp / "wandb" / "run_id").read_text().strip()
    (first_dir,) = (exp / "wandb").glob("offline-run-*")
    logged = read_offline_run(first_dir)
    assert logged["id"] == run_id and first_dir.name.endswith(run_id)
    assert logged["config"]["wandb"] == "on" and logged["config"]["max_steps"] == 3
    assert logged["config"]["experiment_name"] == "wb" and logged["config"]["seq_length"] == 32
    expected = metrics_records(exp)
    assert [r["step"] for r in expected if "loss" in r] == [1, 2, 3] and any("val_loss" in r for r in expected)
    assert logged["history"] == [pytest.approx(r, rel=1e-12) for r in expected]

    second = run_trainer(args + ["--max-steps", "5"], nproc=1, env=OFFLINE)
    assert second.returncode == 0, output_of(second)
    assert "resumed from" in output_of(second)
    (second_dir,) = set((exp / "wandb").glob("offline-run-*")) - {first_dir}
    resumed = read_offline_run(second_dir)
    assert resumed["id"] == run_id and resumed["config"]["max_steps"] == 5
    # both parts together are exactly metrics.jsonl: steps 4..5 follow the checkpoint at step 3
    assert logged["history"] + resumed["history"] == [pytest.approx(r, rel=1e-12) for r in metrics_records(exp)]
    assert [r["step"] for r in resumed["history"] if "loss" in r] == [4, 5]


def test_offline_by_default_and_wandb_mode_respected(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = TrainConfig(experiment_name="default", save_dir=str(tmp_path), wandb="on")
    start_wandb(cfg).finish()
    assert len(list((tmp_path / "default" / "wandb").glob("offline-run-*"))) == 1
    monkeypatch.setenv("WANDB_MODE", "disabled")  # the user's choice wins over our offline default
    cfg = TrainConfig(experiment_name="disabled", save_dir=str(tmp_path), wandb="on")
    start_wandb(cfg).finish()
    assert not list((tmp_path / "disabled" / "wandb").glob("*-run-*"))


def test_missing_wandb_is_a_flag_error_before_any_process_group(inputs, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now fails as if it were not installed
    args = trainer_args("nowb", *inputs, tmp_path)
    assert validate_config(load_config(args), 1) == []  # off (the default) never needs it
    assert ft.main(args + ["--wandb", "on"]) == 2
    out = capsys.readouterr()
    message = out.out + out.err
    assert "--wandb on needs the wandb package" in message and "pip install wandb" in message
    assert not (tmp_path / "nowb").exists()
