"""fsdp_train.py core: config validation, data order, and real 2-process gloo training runs on CPU."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import fsdp_train as ft
from fsdp_lib.config import TrainConfig, load_config
from fsdp_lib.data.cache import PackedBlocks, token_dtype, tokenize_to_file
from fsdp_lib.data.plan import DataPlan
from fsdp_lib.errors import ConfigError
from fsdp_lib.integrity import recorded_problems
from fsdp_lib.train.optim import LocalShardAdamW, lr_at
from tests.fsdp_helpers import (
    REPO_ROOT,
    io_args,
    losses_by_step,
    make_chat_dataset,
    make_dataset,
    make_model,
    output_of,
    read_metrics,
    run_trainer,
    torchrun_command,
    trainer_args,
)


@pytest.fixture(scope="session")
def dataset_dir(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("data") / "corpus")


@pytest.fixture(scope="session")
def scratch_model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("models") / "llama_scratch")


@pytest.fixture(scope="session")
def pretrained_model(tmp_path_factory) -> Path:
    """A tiny bf16 Llama saved in several safetensors files, as real checkpoints are (the reader's threads each
    read a file)."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = make_model(tmp_path_factory.mktemp("models") / "llama_weights", with_weights=True, dtype="bfloat16")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    (folder / "model.safetensors").unlink()
    model.save_pretrained(folder, max_shard_size="20KB")
    return folder


# --- config -------------------------------------------------------------------------------------


def test_bad_flags_are_all_reported_with_their_names(tmp_path, dataset_dir, scratch_model, capsys):
    code = ft.main(
        [
            *io_args("x", dataset_dir, scratch_model, tmp_path),
            "--batch-size",
            "0",
            "--lr",
            "-1",
            "--seq-length",
            "4096",
            "--keep-last",
            "0",
        ]
    )
    out = capsys.readouterr().out
    assert code == 2
    for flag in (
        "--batch-size",
        "--lr",
        "--seq-length 4096 exceeds the model's max_position_embeddings 128",
        "--keep-last",
    ):
        assert flag in out
    assert not (tmp_path / "x").exists(), "nothing may be created for an invalid config"


def test_missing_inputs_name_the_flag(tmp_path, capsys):
    code = ft.main(["-e", "x", "-d", str(tmp_path / "nope"), "-m", "org/not-cached", "--save-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 2
    assert "--dataset-name" in out and "data_hf.py" in out
    assert "--model-name org/not-cached" in out and "model_download.py" in out


def test_yaml_config_and_command_line_precedence(tmp_path):
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("seq-length: 256\nbatch_size: 4\nactivation-checkpointing: off\nlr: 1.0e-4\n")
    cfg = load_config(["--config", str(cfg_file), "-b", "8", "-e", "exp"])
    assert (cfg.seq_length, cfg.batch_size, cfg.activation_checkpointing, cfg.lr) == (256, 8, "off", 1e-4)
    cfg_file.write_text("seq_lenght: 256\n")
    with pytest.raises(ConfigError, match="unknown key 'seq_lenght'"):
        load_config(["--config", str(cfg_file)])
    # written as on the command line: YAML 1.1 reads 1e-4 as a string, "20" is quoted; both are read as argparse would
    cfg_file.write_text("lr: 1e-4\nweight-decay: 5e-2\nwarmup-steps: '20'\nmax-steps: 1_000\n")
    cfg = load_config(["--config", str(cfg_file)])
    assert (cfg.lr, cfg.weight_decay, cfg.warmup_steps, cfg.max_steps) == (1e-4, 0.05, 20, 1000)
    cfg_file.write_text("lr: fast\nwarmup-steps: 2.5\n")
    with pytest.raises(ConfigError, match="key 'lr' has value 'fast'; expected float"):
        load_config(["--config", str(cfg_file)])
    # on/off read by YAML as a boolean for a flag with more choices than on and off (it said "has value True")
    cfg_file.write_text("fp8: on\n")
    assert load_config(["--config", str(cfg_file)]).fp8 == "on"
    # a flag that acts on one launch: a run's config.yaml kept force_resume: true, and reused with --config it forced
    # every later resume onto changed settings; false (older config.yaml files) is passed over
    cfg_file.write_text("force-resume: true\n")
    with pytest.raises(ConfigError, match="key 'force-resume' acts on one launch only: give --force-resume on the"):
        load_config(["--config", str(cfg_file)])
    cfg_file.write_text("force_resume: false\nexport_only: false\ndry_run: false\n")
    assert not load_config(["--config", str(cfg_file)]).force_resume
    from fsdp_lib.experiment_dir import run_settings

    assert not {"force_resume", "export_only", "dry_run"} & set(run_settings(load_config(["--force-resume"])))
    # START:END values unquoted: YAML 1.1 would read 5:6 as the base-60 number 306
    cfg_file.write_text("profile-steps: 5:6\ndata-slice: 10:20\nmax-steps: 1_000\n")
    cfg = load_config(["--config", str(cfg_file)])
    assert (cfg.profile_steps, cfg.data_slice, cfg.max_steps) == ("5:6", "10:20", 1000)
    # --global-batch-size sets the accumulation: either one on the command line overrides the other from the file
    cfg_file.write_text("grad-accum-steps: 4\n")
    cfg = load_config(["--config", str(cfg_file), "--global-batch-size", "16"])
    assert (cfg.global_batch_size, cfg.grad_accum_steps) == (16, 1), "the file's accumulation was kept"
    cfg_file.write_text("global-batch-size: 64\n")
    cfg = load_config(["--config", str(cfg_file), "--grad-accum-steps", "2"])
    assert (cfg.global_batch_size, cfg.grad_accum_steps) == (0, 2)
    cfg_file.write_text("global-batch-size: 64\ngrad-accum-steps: 4\n")  # both in the file: checked as given
    cfg = load_config(["--config", str(cfg_file)])
    assert (cfg.global_batch_size, cfg.grad_accum_steps) == (64, 4)
    # --export-only: the experiment's config.yaml first (where it is now: not its recorded folder), then the flags
    (tmp_path / "moved" / "exp").mkdir(parents=True)
    # (what builds the model: not the data, which it does not read, nor how it ran, which the export's launch may
    # change; read as --config)
    saved = {"seq_length": 64, "peft": "lora", "save_dir": "gone", "experiment_name": "old", "no_such_key": 1,
             "global_batch_size": 64, "grad_accum_steps": 4, "context_parallel": 2, "document-masking": False}  # fmt: skip
    (tmp_path / "moved" / "exp" / "config.yaml").write_text(yaml.safe_dump(saved))
    cfg = load_config(["-e", "exp", "--save-dir", str(tmp_path / "moved"), "--export-only", "--seq-length", "32"])
    assert (cfg.seq_length, cfg.peft, cfg.experiment_dir) == (32, "lora", tmp_path / "moved" / "exp")
    assert (cfg.global_batch_size, cfg.grad_accum_steps, cfg.context_parallel, cfg.document_masking) == (0, 1, 1, "off")
    assert load_config(["-e", "exp", "--save-dir", str(tmp_path / "moved")]).peft == "none", "only for an export"
    assert load_config(["-e", "exp", "--save-dir", str(tmp_path / "moved"), "--export-only"]).seq_length == 1024
    # --peft none given to export a LoRA run's base: the run's adapter flags are not taken (they were refused as
    # "--lora-rank needs --peft lora", flags the user never typed)
    (tmp_path / "moved" / "exp" / "config.yaml").write_text(yaml.safe_dump({**saved, "lora_rank": 8}))
    cfg = load_config(["-e", "exp", "--save-dir", str(tmp_path / "moved"), "--export-only", "--peft", "none"])
    assert (cfg.peft, cfg.lora_rank) == ("none", TrainConfig.lora_rank)


def test_lr_schedule_shapes():
    cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, lr_schedule="cosine")
    lrs = [lr_at(s, cfg, 110) for s in range(110)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)
    cfg.lr_schedule = "linear"
    assert lr_at(60, cfg, 110) == pytest.approx(1.0 - 0.9 * 0.5)


def test_local_shard_adamw_steps_exactly_as_torch_fused_adamw():
    """The step on cached local lists (from the second step on) gives bit for bit torch's AdamW(fused=True) with
    the same grad_scale and found_inf: two weight-decay groups, the lr and betas changed between steps, a skipped
    step, a parameter without a gradient for one step, and the state reloaded (new tensors) part way."""
    import copy

    def make(cls: type) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape)) for shape in [(8, 4), (4, 8), (8,), (6, 3), (3,)]]
        groups = [{"params": params[:2] + params[3:4], "weight_decay": 0.1}, {"params": params[2:3] + params[4:]}]
        return params, cls(groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=True)

    (ours, ours_opt), (ref, ref_opt) = make(LocalShardAdamW), make(torch.optim.AdamW)
    for step in range(8):
        gen = torch.Generator().manual_seed(step)
        grads = [torch.randn(p.shape, generator=gen) for p in ours]
        for params, opt in ((ours, ours_opt), (ref, ref_opt)):
            for i, (p, g) in enumerate(zip(params, grads)):
                p.grad = None if (step, i) == (4, 1) else g.clone()
            for group in opt.param_groups:
                group["lr"] = 1e-3 * (step + 1)
            opt.param_groups[0]["betas"] = (0.9, 0.95) if step < 6 else (0.8, 0.9)
            opt.grad_scale = torch.tensor(3.0 + step)
            opt.found_inf = torch.tensor(1.0 if step == 3 else 0.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if step == 5:  # as a resume does: load_state_dict with other tensors
            ours_opt.load_state_dict(copy.deepcopy(ours_opt.state_dict()))
        for p, q in zip(ours, ref):
            assert torch.equal(p, q)
            assert ours_opt.state[p].keys() == ref_opt.state[q].keys() == {"step", "exp_avg", "exp_avg_sq"}
            assert all(
                torch.equal(ours_opt.state[p][k], ref_opt.state[q][k]) for k in ("step", "exp_avg", "exp_avg_sq")
            )
    assert float(ours_opt.state[ours[0]]["step"]) == 7 and float(ours_opt.state[ours[1]]["step"]) == 6


# --- data order -----------------------------------------------------------------------------------


def _block_ids(plan: DataPlan, order: torch.Tensor, step: int) -> list[int]:
    # tokens are 0..N-1, so a block's first token divided by seq_length is its index
    return [int(row[0]) // plan.blocks.seq_length for mb in plan.micro_batches(order, step) for row in mb.input_ids]


@pytest.mark.parametrize("world,micro,accum", [(1, 4, 2), (2, 2, 2), (4, 1, 2), (8, 1, 1)])
def test_every_block_once_per_epoch_and_same_global_batches_at_any_world_size(world, micro, accum):
    tokens = np.arange(8 * 103 + 1)
    blocks = PackedBlocks(tokens, 8)
    reference = DataPlan(blocks, seed=3, global_batch=8, micro_batch=8, world_size=1, rank=0)
    plans = [
        DataPlan(blocks, seed=3, global_batch=world * micro * accum, micro_batch=micro, world_size=world, rank=r)
        for r in range(world)
    ]
    order = plans[0].epoch_order(0)
    seen = []
    for step in range(plans[0].steps_per_epoch):
        step_ids = [i for p in plans for i in _block_ids(p, order, step)]
        assert sorted(step_ids) == sorted(_block_ids(reference, reference.epoch_order(0), step))
        seen += step_ids
    assert len(seen) == len(set(seen)) == 96  # 103 blocks, partial global batch of 7 dropped
    assert not torch.equal(plans[0].epoch_order(0), plans[0].epoch_order(1))


def test_packed_blocks_cover_every_transition():
    blocks = PackedBlocks(np.arange(21), 5)
    batch = blocks.gather(list(range(len(blocks))))
    assert batch.input_ids.shape == batch.labels.shape == (4, 5) and batch.position_ids is None
    assert batch.input_ids.flatten().tolist() == list(range(20))
    assert batch.labels.flatten().tolist() == list(range(1, 21))


# --- training runs --------------------------------------------------------------------------------


def test_loss_falls_and_metrics_are_complete(tmp_path, dataset_dir, scratch_model):
    proc = run_trainer(
        [
            *trainer_args("learn", dataset_dir, scratch_model, tmp_path),
            "-b",
            "4",
            "--num-epochs",
            "2",
            "--eval-freq",
            "10",
            "--log-freq",
            "5",
            "--profile-steps",
            "3:4",
        ]
    )
    assert proc.returncode == 0, output_of(proc)
    rows = read_metrics(tmp_path / "learn")
    assert rows[-1]["loss"] < 0.6 * rows[0]["loss"], [r["loss"] for r in rows]
    for key in (
        "step",
        "epoch",
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "time_data_ms",
        "time_forward_ms",
        "time_backward_ms",
        "time_update_ms",
        "mem_curr_alloc_gb",
        "mem_peak_alloc_gb",
        "mem_reserved_gb",
    ):
        assert key in rows[-1], key
    all_rows = [json.loads(x) for x in (tmp_path / "learn" / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in all_rows if "val_loss" in r]
    assert vals and vals[-1]["val_loss"] < vals[0]["val_loss"]
    assert math.isclose(vals[-1]["val_ppl"], math.exp(vals[-1]["val_loss"]), rel_tol=1e-6)
    assert (tmp_path / "learn" / "config.yaml").is_file()
    out = output_of(proc)
    assert "[rank0]" in out and "step=5" in out
    # --profile-steps 3:4: each rank's trace and operator table, the step loop's phases named in both
    assert "--profile-steps 3:4: trace and operator table in" in out
    for rank in range(2):
        events = json.loads((tmp_path / "learn" / "profile" / f"rank{rank}.json").read_text())["traceEvents"]
        names = {e.get("name") for e in events}
        table = (tmp_path / "learn" / "profile" / f"rank{rank}.txt").read_text()
        for phase in ("forward", "backward", "update"):
            assert phase in names and phase in table, (rank, phase)
        assert sum(e.get("name") == "update" for e in events) == 2  # steps 3 and 4, no more


@pytest.mark.parametrize(("first_step", "profiled"), [(1, [2, 3]), (3, [3]), (5, [])])
def test_profile_steps_cover_the_range_once_also_when_resumed_inside_it(tmp_path, first_step, profiled):
    """--profile-steps 2:3 from step 1, from a resume at step 3 (the rest of the range) and at step 5 (nothing)."""
    from types import SimpleNamespace

    from fsdp_lib.train.metrics import PhaseTimer
    from fsdp_lib.train.profiling import StepProfiler

    cfg = SimpleNamespace(profile_steps="2:3", experiment_dir=tmp_path)
    timer = PhaseTimer(torch.device("cpu"))
    with StepProfiler(cfg, SimpleNamespace(rank=0, device=torch.device("cpu")), first_step, 6) as profiler:
        for step in range(first_step, 7):
            profiler.step_begins(step)
            with timer.phase("update"):
                torch.ones(4).add_(step)
            profiler.step_ended(step)
    trace = tmp_path / "profile" / "rank0.json"
    if not profiled:
        assert not trace.exists()
        return
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e.get("name") == "update" for e in events) == len(profiled)


def test_profile_steps_beyond_the_last_step_are_said(tmp_path, capsys):
    from types import SimpleNamespace

    from fsdp_lib.train.profiling import StepProfiler

    cpu = SimpleNamespace(rank=0, device=torch.device("cpu"))
    StepProfiler(SimpleNamespace(profile_steps="8:9", experiment_dir=tmp_path), cpu, 1, 6)
    assert "--profile-steps 8:9: this launch trains steps 1..6; nothing is profiled" in capsys.readouterr().out
    StepProfiler(SimpleNamespace(profile_steps="2:3", experiment_dir=tmp_path), cpu, 5, 6)  # resumed after the range
    assert "--profile-steps 2:3: this launch trains steps 5..6; nothing is profiled" in capsys.readouterr().out
    StepProfiler(SimpleNamespace(profile_steps="2:3", experiment_dir=tmp_path), cpu, 3, 6)
    assert "nothing is profiled" not in capsys.readouterr().out


def test_a_profile_that_cannot_be_written_neither_stops_training_nor_hides_the_error(tmp_path, capsys):
    from types import SimpleNamespace

    from fsdp_lib.train.profiling import StepProfiler

    (tmp_path / "file").write_text("")  # its profile folder would go under a file
    cfg = SimpleNamespace(profile_steps="1:1", experiment_dir=tmp_path / "file")
    cpu = SimpleNamespace(rank=0, device=torch.device("cpu"))
    with StepProfiler(cfg, cpu, 1, 3) as profiler:  # the run goes on after the failed write
        profiler.step_begins(1)
        profiler.step_ended(1)
    assert "rank 0's profile was not written" in capsys.readouterr().out
    with pytest.raises(ValueError, match="the run's own error"), StepProfiler(cfg, cpu, 1, 3) as profiler:
        profiler.step_begins(1)
        raise ValueError("the run's own error")


def _eight_steps(save: Path, dataset_dir: Path, model: Path, nproc: int, *extra: str) -> dict[int, float]:
    args = [
        *trainer_args("run", dataset_dir, model, save),
        "--max-steps",
        "8",
        "--seed",
        "7",
        "-b",
        "2",
        *extra,
    ]
    proc = run_trainer(args, nproc=nproc)
    assert proc.returncode == 0, output_of(proc)
    (save / "run" / "launch.log").write_text(output_of(proc))
    return losses_by_step(save / "run")


@pytest.fixture(scope="module")
def full_shard_run(tmp_path_factory, dataset_dir, scratch_model) -> tuple[Path, dict[int, float]]:
    """2 processes, --sharding full, batch 2 x accum 1: the reference the other layouts must reproduce (its save
    folder, with the token cache, and its losses)."""
    save = tmp_path_factory.mktemp("full")
    return save, _eight_steps(save, dataset_dir, scratch_model, 2)


@pytest.fixture(scope="module")
def full_shard_losses(full_shard_run) -> dict[int, float]:
    return full_shard_run[1]


def test_a_damaged_token_cache_is_rebuilt_not_trained_on(tmp_path, dataset_dir, scratch_model, full_shard_run):
    """A byte flipped in a copy of the reference run's token cache: the rerun says so, rebuilds the cache and trains
    to the reference losses. Failure markers other launches left beside it (a preempted tokenisation, an
    experiment stopped beside this one) are not this launch's: its waiting rank stopped on them, blaming its own
    rank 0 ("tokenisation failed on local rank 0: KeyboardInterrupt('SIGTERM')"); a dead launch's is removed."""
    import os
    import shutil
    import socket

    save, expected = full_shard_run
    shutil.copytree(save / ".token_cache", tmp_path / ".token_cache")
    (tokens,) = (tmp_path / ".token_cache").glob("*/train.tokens")
    raw = bytearray(tokens.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    tokens.write_bytes(bytes(raw))
    host = socket.gethostname()
    alive, dead = (
        tokens.with_name(f"train.failed.{os.getpid()}.{host}"),
        tokens.with_name(f"train.failed.1999999999.{host}"),
    )
    for marker in (tokens.with_name("train.failed"), alive, dead):  # the first: the name before this launch's own
        marker.write_text("KeyboardInterrupt('SIGTERM')")
    args = [*trainer_args("run", dataset_dir, scratch_model, tmp_path), "--max-steps", "8", "--seed", "7", "-b", "2"]
    proc = run_trainer(args)
    log = output_of(proc)
    assert proc.returncode == 0, log
    assert alive.exists() and not dead.exists()
    assert "WARNING: the token cache of the train split is damaged" in log and "checksum mismatch" in log, log
    assert "token cache of the validation split verified" in log and "tokenising train split" in log
    assert losses_by_step(tmp_path / "run") == expected


def test_one_process_accumulating_equals_two_processes(tmp_path, dataset_dir, scratch_model, full_shard_losses):
    one = _eight_steps(tmp_path, dataset_dir, scratch_model, 1, "--grad-accum-steps", "2")
    assert sorted(one) == sorted(full_shard_losses) == list(range(1, 9))
    for step in one:
        assert one[step] == pytest.approx(full_shard_losses[step], abs=1e-5), (step, one, full_shard_losses)
    assert one[8] < one[1]


@pytest.mark.parametrize(
    "layout",
    [  # a sharding and a recomputation setting per launch (the reference: full sharding, every layer recomputed)
        ["--sharding", "grad-op", "--activation-checkpointing", "off"],
        ["--sharding", "none", "--ac-every-n-layers", "2"],
        ["--sharding", "hybrid", "--hybrid-shard-size", "1"],
        ["--cpu-offload", "on"],
    ],
    ids=lambda x: " ".join(x),
)
def test_sharding_offload_and_checkpointing_do_not_change_the_math(
    tmp_path, dataset_dir, scratch_model, full_shard_losses, layout
):
    got = _eight_steps(tmp_path, dataset_dir, scratch_model, 2, *layout)
    for step, loss in full_shard_losses.items():
        assert got[step] == pytest.approx(loss, abs=1e-5), (step, got, full_shard_losses)


def test_bf16_mixed_precision_trains(tmp_path, dataset_dir, scratch_model, full_shard_losses):
    from fsdp_lib.runtime import cpu_bf16_warning, cpu_has_bf16_matmuls

    got = _eight_steps(tmp_path, dataset_dir, scratch_model, 2, "--precision", "bf16")
    assert got[8] < got[1]
    # said once where torch emulates bf16 matmuls on this machine's CPU (the development VM's), and only there
    said = (tmp_path / "run" / "launch.log").read_text().count("WARNING: --precision bf16 on a CPU without native bf16")
    assert said == (cpu_bf16_warning("bf16", torch.device("cpu"), cpu_has_bf16_matmuls) is not None)
    assert got[1] == pytest.approx(full_shard_losses[1], abs=0.05)  # same init and data, bf16 rounding only


@pytest.mark.parametrize(
    "cpuinfo,says",
    [
        ("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n", False),  # AVX2 only (this VM's EPYC)
        ("flags\t\t: fpu avx2 avx512f avx512bw avx512vl\n", True),  # AVX-512 core (Skylake-SP, Ice Lake)
        ("flags\t\t: fpu avx2 avx512f avx512_bf16\n", True),
        ("flags\t\t: fpu avx2 amx_bf16 amx_tile\n", True),  # Sapphire Rapids
        ("Features\t: fp asimd sve bf16 i8mm\n", True),  # aarch64 (Graviton 3, Grace)
        ("Features\t: fp asimd\n", False),
        ("vendor_id\t: x\n", None),  # no flags to tell by
    ],
)
def test_the_cpus_flags_say_whether_it_has_bf16_matmuls(cpuinfo, says):
    from fsdp_lib.runtime import cpu_flags_say_bf16

    assert cpu_flags_say_bf16(cpuinfo) is says


@pytest.mark.parametrize(
    "precision,device,native,warned",
    [("bf16", "cpu", False, True), ("bf16", "cpu", True, False), ("bf16", "cpu", None, False),
     ("fp32", "cpu", False, False), ("bf16", "cuda", False, False)],
)  # fmt: skip
def test_bf16_is_warned_about_where_torch_emulates_it(precision, device, native, warned):
    from fsdp_lib.runtime import cpu_bf16_warning

    asked = []

    def native_bf16() -> bool | None:
        asked.append(True)
        return native

    warning = cpu_bf16_warning(precision, torch.device(device), native_bf16)
    assert (warning is not None) == warned
    assert asked == ([True] if (precision, device) == ("bf16", "cpu") else [])  # the CPU is asked only then
    assert warning is None or ("--precision bf16" in warning and "--precision fp32" in warning)


def test_a_nan_loss_skips_its_step_and_too_many_in_a_row_stop_the_run(tmp_path, dataset_dir, scratch_model):
    """A non-finite loss at step 3: that update is skipped and training goes on (finite losses after it); then three
    in a row (5, 6, 7) reach --max-bad-steps 3 and stop the run. Step 3 and steps 5-6 are three bad steps too, but
    not consecutive: the count starts again after the good step 4."""
    args = [*trainer_args("nan", dataset_dir, scratch_model, tmp_path), "--max-steps", "8", "--max-bad-steps", "3"]
    proc = run_trainer(args, env={"FSDP_TRAIN_NAN_AT_STEPS": "3,5,6,7"})
    assert proc.returncode != 0
    assert "3 consecutive steps had a non-finite loss" in output_of(proc), output_of(proc)
    rows = {r["step"]: r for r in read_metrics(tmp_path / "nan")}
    assert math.isnan(rows[3]["loss"]) and math.isnan(rows[3]["grad_norm"])
    assert rows[2]["skipped_steps"] == 0 and rows[3]["skipped_steps"] == 1 and rows[4]["skipped_steps"] == 1
    # had the NaN update been applied, every later loss would be NaN
    assert math.isfinite(rows[4]["loss"]) and 8 not in rows, sorted(rows)


@pytest.mark.parametrize("sharding", ["full", "hybrid"])
def test_sharded_loading_gives_exactly_the_from_pretrained_weights(pretrained_model, sharding):
    import subprocess

    cmd = torchrun_command("tests/workers/fsdp_load_check.py", [str(pretrained_model), sharding])
    proc = subprocess.run(
        cmd,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TENSORS EQUAL" in proc.stdout
    files, threads = map(int, re.search(r"READ (\d+) FILES WITH (\d+) THREADS", proc.stdout).groups())
    assert files >= 3 and threads >= 2, proc.stdout


def test_dry_run_prints_the_plan_and_trains_nothing(tmp_path, dataset_dir, scratch_model, capsys):
    code = ft.main(
        [
            *io_args("dry", dataset_dir, scratch_model, tmp_path),
            "--seq-length",
            "64",
            "--dry-run",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "seq_length: 64" in out and "2 x LlamaDecoderLayer" in out and "16 B/param" in out
    assert "activations per GPU" in out and "longest --seq-length that fits one GPU" in out
    assert f"a run would start at step 0 (no checkpoint in {tmp_path / 'dry' / 'checkpoint'})" in out
    assert not (tmp_path / "dry").exists()
    # the plan is in the bytes of --precision (fp32: no mixed precision) and no longer than the model's positions
    assert "--precision auto planned as bf16" in out and "(bf16 weights + bf16 grads)" in out
    assert "(the model's max_position_embeddings; memory allows" in out
    peft = ["--peft", "lora", "--seq-length", "64", "--dry-run"]
    plans = {}
    for precision in ("bf16", "fp32"):
        assert ft.main([*io_args("dry", dataset_dir, scratch_model, tmp_path), *peft, "--precision", precision]) == 0
        plans[precision] = capsys.readouterr().out
    assert "lora: base 4 B/param (fp32)" in plans["fp32"] and "(fp32 weights + fp32 grads)" in plans["fp32"]
    template = tmp_path / "t.jinja"  # plain text renders nothing with a chat template: said, not dropped in silence
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert (
        ft.main([*io_args("dry", dataset_dir, scratch_model, tmp_path), *peft, "--chat-template", str(template)]) == 0
    )
    assert f"WARNING: --chat-template {template} is not used: the data is plain text" in capsys.readouterr().out
    per_token = {p: re.search(r"activations per GPU: ([\d.]+) KB/token", out)[1] for p, out in plans.items()}
    assert float(per_token["fp32"]) > 1.9 * float(per_token["bf16"]), per_token
    # what the run refuses about the data before tokenising it, the dry run refuses too (it said "nothing trained")
    import datasets

    chat = make_chat_dataset(tmp_path / "chat", n=8, validation=False)
    prompts = tmp_path / "prompts"
    datasets.Dataset.from_dict({"prompt": ["1 plus 1?"], "answer": ["2"]}).save_to_disk(str(prompts))
    pairs = tmp_path / "pairs"  # TRL's standard strings: not "conversations", as the message said
    datasets.Dataset.from_dict({"prompt": ["1 plus 1?"], "chosen": [" 2"], "rejected": [" 3"]}).save_to_disk(str(pairs))
    for data, extra, said in [
        (chat, [], "holds conversations, which are rendered with the chat template, but the tokenizer of --model-name"),
        (pairs, [], "holds preference data, whose prompts and responses (strings too: one turn each) are rendered"),
        (
            prompts,
            ["--reward", "accuracy", "--max-new-tokens", "16", "--fp8", "emulate"],
            "(--objective auto: grpo), and generation through",
        ),
        (dataset_dir, ["--objective", "dpo"], "--objective dpo: --dataset-name"),
    ]:
        code = ft.main([*io_args("dry", data, scratch_model, tmp_path), "--seq-length", "64", "--dry-run", *extra])
        assert code == 1 and said in capsys.readouterr().out, (data, extra)
    assert not (tmp_path / "dry").exists()


def test_long_context_planner_arithmetic():
    """The rule against the GPU peaks it was checked with (the 1B preset, -b 1, activation checkpointing, one
    H200, BENCHMARKS.md rows 11 and 16): within 10% over or 3% under each, and what --context-parallel changes."""
    from fsdp_lib.model.memory_plan import activation_bytes_per_token, longest_sequence, offloaded_bytes_per_token

    per_token = activation_bytes_per_token(2048, 8192, 16, 512)  # Llama-3.2-1B shapes: 8 kv heads of 64
    state = 1_038_682_112 * 16 + 0.26e9  # fp32 weights, grads, AdamW moments + the unsharded root unit
    offloaded = activation_bytes_per_token(2048, 8192, 16, 512, offload=True, mlp_tiles=8)
    for seq, rule, peak in ((8192, per_token, 18.07e9), (262144, per_token, 69.97e9), (393216, per_token, 98.47e9),
                            (786432, offloaded, 84.88e9)):  # fmt: skip
        predicted = state + rule * seq + 2048 * 32000 * 4
        assert -0.03 < (predicted - peak) / peak < 0.10, (seq, predicted, peak)
    split = activation_bytes_per_token(2048, 8192, 16, 512, context_parallel=2)
    assert per_token < split < per_token * 1.2  # the all-to-all copies, per token
    one, eight = (longest_sequence(80e9, state, split, 0, 1, n) for n in (1, 8))
    assert one % 1024 == 0 and eight % 8192 == 0 and 7.5 * one < eight <= 8 * one + 8192
    assert activation_bytes_per_token(2048, 8192, 16, 512, checkpointing=False) > 5 * per_token
    assert longest_sequence(16e9, state, per_token, 0, 1, 1) == 0  # the state alone does not fit
    # --tiled-mlp bounds the recomputed layer's MLP; --activation-offload moves the 16 layer inputs to the host
    tiled = activation_bytes_per_token(2048, 8192, 16, 512, mlp_tiles=8)
    assert tiled == per_token - (4 * 8192 - 2048 - 4 * 8192 // 8 + 2 * 8192 - 2 * 8192 // 8) * 2
    assert offloaded == tiled - 15 * 2048 * 2 and offloaded_bytes_per_token(2048, 8192, 16, 512) == 16 * 2048 * 2
    assert longest_sequence(80e9, state, offloaded, 0, 1, 1) > 2 * longest_sequence(80e9, state, per_token, 0, 1, 1)
    # --context-parallel 16 over 8 key/value heads: each head copied to 2 processes, so attention saves twice the k
    # and v per token, and the all-to-alls move twice as much of them
    copied = activation_bytes_per_token(2048, 8192, 16, 512, context_parallel=16, kv_copies=2)
    assert copied - activation_bytes_per_token(2048, 8192, 16, 512, context_parallel=16) == (2 + 2 * 2) * 512 * 2


def test_the_dry_runs_long_context_plan_counts_copied_key_value_heads():
    from transformers import LlamaConfig, LlamaForCausalLM

    from fsdp_lib.config import TrainConfig
    from fsdp_lib.model.build import long_context_plan

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=1, vocab_size=256)  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    plans = {
        n: long_context_plan(model, TrainConfig(seq_length=4096, context_parallel=n), 1e9, "bf16") for n in (1, 2, 4)
    }
    per_token = {
        n: float(re.search(r"activations per GPU: ([\d.]+) KB/token", plan).group(1)) for n, plan in plans.items()
    }
    assert "copied" not in plans[1] and "each key/value head copied to 2 processes" in plans[2], plans[2]
    assert "each key/value head copied to 4 processes" in plans[4] and per_token[4] > per_token[2] > per_token[1]


def test_the_planner_counts_ac_every_n_layers_and_the_shard_group(monkeypatch):
    """--dry-run planned every layer checkpointed under --ac-every-n-layers 2 (the 7B configs': 0.56 MB/token
    where half the layers keep all they save, ~3.1 MB), and the state sharded over every process under --sharding
    none (each GPU holds it all), hybrid (its shard group) and grad-op (every layer's weights kept unsharded)."""
    from fsdp_lib.config import TrainConfig
    from fsdp_lib.model.build import sharding_group_size
    from fsdp_lib.model.memory_plan import activation_bytes_per_token, checkpointed_layers, offloaded_bytes_per_token

    mistral = (4096, 14336, 32, 1024)
    every, half = (activation_bytes_per_token(*mistral, every_n=n) for n in (1, 2))
    saved = (6 * 4096 + 2 * 1024 + 4 * 14336) * 2  # what one layer keeps for backward, per token
    assert half - every == 15 * saved - 16 * 4096 * 2 and 2.9e6 < half < 3.0e6  # 16 layers kept, no recompute on top
    assert (
        every
        < half
        < activation_bytes_per_token(*mistral, every_n=32)
        < activation_bytes_per_token(*mistral, checkpointing=False)
    )
    assert [checkpointed_layers(32, n) for n in (1, 2, 3, 32, 64)] == [32, 16, 11, 1, 1]
    assert offloaded_bytes_per_token(*mistral, every_n=2) == (16 * 4096 * 2 + 16 * saved)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for sharding, size, expected in (
        ("full", 0, 32),
        ("grad-op", 0, 32),
        ("none", 0, 1),
        ("hybrid", 4, 4),
        ("hybrid", 0, 8),
    ):  # fmt: skip (8 per node assumed outside torchrun)
        assert sharding_group_size(TrainConfig(sharding=sharding, hybrid_shard_size=size), 32) == expected
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert sharding_group_size(TrainConfig(sharding="hybrid"), 32) == 8


def test_the_dry_run_states_the_shard_group_s_model_state(tmp_path, dataset_dir, scratch_model, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    states = {}
    for sharding in ("full", "none", "grad-op"):
        args = [*io_args("dry", dataset_dir, scratch_model, tmp_path), "--seq-length", "64", "--dry-run"]
        assert ft.main([*args, "--sharding", sharding]) == 0
        out = capsys.readouterr().out
        states[sharding] = re.search(r"this run's model state per GPU: ([\d.]+ \w+) \((.*)\)$", out, re.M).groups()
    assert "sharded over the 8 processes" in states["full"][1]
    assert "--sharding none shards over 1 of the 8 processes" in states["none"][1]
    assert "kept unsharded from forward to backward" in states["grad-op"][1]
    assert len({value for value, _ in states.values()}) == 3


def test_hub_id_resolves_from_the_offline_cache(tmp_path, dataset_dir, scratch_model):
    """-m org/name is looked up in HF_HOME's hub cache (the layout model_download.py fills), never online."""
    import shutil
    import subprocess
    import sys

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf_home" / "hub" / "models--acme--tiny-llama"
    shutil.copytree(scratch_model, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {**__import__("os").environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"}
    args = ["-e", "hub", "-d", str(dataset_dir), "--seq-length", "32", "--dry-run"]

    def dry_run(model_name: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "fsdp_train.py", *args, "-m", model_name]
        return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)

    found = dry_run("acme/tiny-llama")
    assert found.returncode == 0, found.stdout + found.stderr
    assert f"snapshots/{commit}" in found.stdout
    missing = dry_run("acme/other")
    assert missing.returncode == 2 and "not in the local cache" in missing.stdout


def test_token_stream_is_the_tokenizer_output_plus_eos(tmp_path, dataset_dir, scratch_model):
    import datasets
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(scratch_model)
    limit = tokenizer.model_max_length
    split = datasets.load_from_disk(str(dataset_dir))["train"]
    count = tokenize_to_file(split, tokenizer, tmp_path / "t.tokens", batch_rows=7)
    assert tokenizer.model_max_length == limit, "the run exports this tokenizer: its limit is the model's again"
    stream = np.fromfile(tmp_path / "t.tokens", dtype=token_dtype(len(tokenizer)))
    expected = [i for text in split["text"] for i in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
    assert count == len(stream) and stream.tolist() == expected
    sums = tmp_path / "t.sums.json"  # size and CRC-32 of every file, recorded when written
    assert sorted(json.loads(sums.read_text())) == ["t.docs", "t.tokens"] and recorded_problems(sums) == []
    with open(tmp_path / "t.tokens", "r+b") as fh:
        fh.seek(5)
        byte = fh.read(1)
        fh.seek(5)
        fh.write(bytes([byte[0] ^ 0x80]))
    (problem,) = recorded_problems(sums)
    assert "t.tokens: checksum mismatch" in problem
    with open(tmp_path / "t.docs", "ab") as fh:
        fh.write(b"\0")
    assert any("t.docs: " in p and "were written" in p for p in recorded_problems(sums))
    sums.unlink()
    assert "no checksums were recorded" in recorded_problems(sums)[0]


def test_torchrun_variables_set_in_part_are_refused_before_any_process_group(monkeypatch):
    """WORLD_SIZE=2 left in a shell trained one process with the accumulation of two (half the global batch asked
    for); RANK alone, or RANK and WORLD_SIZE without MASTER_ADDR, ended in a traceback."""
    from fsdp_lib.checks import validate_config

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    cfg = TrainConfig(experiment_name="x", dataset_name=["d"], model_name="m")
    monkeypatch.setenv("WORLD_SIZE", "2")
    said = validate_config(cfg, 2)
    assert said[0].startswith("WORLD_SIZE=2 is set but RANK is not: torchrun sets both"), said
    assert not any("RANK" in p for p in validate_config(TrainConfig(**{**vars(cfg), "dry_run": True}), 2))  # plans 2
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("RANK", "0")
    assert validate_config(cfg, 1)[0].startswith("RANK=0 is set but WORLD_SIZE is not")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert validate_config(cfg, 2)[0].startswith("RANK and WORLD_SIZE are set but MASTER_ADDR and MASTER_PORT are not")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert not any("torchrun sets" in p for p in validate_config(cfg, 2))
