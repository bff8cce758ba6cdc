"""Checkpoints that never lose work: kill -9, kills inside a save, SIGTERM, resume at another world size,
pruning, refusals, write failures, corrupt checkpoints, async saves and the Hugging Face export."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.fsdp_helpers import (
    killed_at_step,
    losses_by_step,
    make_model,
    output_of,
    run_trainer,
    trainer_args,
    wait_for_step,
    wait_until,
)

pytestmark = pytest.mark.slow

STEPS = 10


def flags(inputs, save_dir: Path, exp: str = "run", *extra: str) -> list[str]:
    dataset, model = inputs
    return [
        *trainer_args(exp, dataset, model, save_dir),
        "--max-steps",
        str(STEPS),
        "--ckpt-freq",
        "4",
        "-b",
        "2",
        *extra,
    ]


@pytest.fixture(scope="module")
def reference_run(inputs, tmp_path_factory) -> Path:
    """The uninterrupted run every resumed run must reproduce (its --save-dir)."""
    save = tmp_path_factory.mktemp("reference")
    proc = run_trainer(flags(inputs, save))
    assert proc.returncode == 0, output_of(proc)
    return save


@pytest.fixture(scope="module")
def reference(reference_run) -> dict[int, float]:
    """Its losses by step."""
    losses = losses_by_step(reference_run / "run")
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


@pytest.fixture(scope="module")
def four_steps(inputs, tmp_path_factory) -> Path:
    """A finished 4-step run (checkpoint step_00000004) that tests copy and then damage, refuse or extend: one
    launch for all of them. Returns its --save-dir."""
    save = tmp_path_factory.mktemp("four_steps")
    args = flags(inputs, save)
    args[args.index("--max-steps") + 1] = "4"
    proc = run_trainer(args)
    assert proc.returncode == 0, output_of(proc)
    return save


def copy_run(save: Path, to: Path, exp: str = "run") -> None:
    """The experiment `exp` of `save` copied under `to` (the token cache is left behind: a rerun rebuilds it)."""

    shutil.copytree(save / exp, to / exp)


def checkpoints(save: Path, exp: str = "run") -> list[str]:
    root = save / exp / "checkpoint"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def test_kill9_every_process_then_rerun_is_bit_identical(inputs, reference, tmp_path):
    tensorboard = ["--tensorboard", "on"]  # not pinned by the checkpoint; on here for its steps after the resume
    killed_at_step([*flags(inputs, tmp_path), *tensorboard], tmp_path / "run", 6, delay_s="0.25")
    assert checkpoints(tmp_path) == ["step_00000004"]
    rerun = run_trainer([*flags(inputs, tmp_path), *tensorboard])
    assert rerun.returncode == 0, output_of(rerun)
    assert "resumed from" in output_of(rerun) and "at step 4" in output_of(rerun)
    # the checkpoint replaces every weight: the model folder's are not read (the losses below show none is missed)
    assert "resuming: every weight comes from the checkpoint" in output_of(rerun)
    assert "loaded pretrained weights" not in output_of(rerun)
    assert "the start-up checks chose" not in output_of(rerun), "probed on initialised shards, they chose the same"
    saved = json.loads(next((tmp_path / "run" / "checkpoint").glob("step_*/train_state.json")).read_text())
    assert saved["fingerprint"]["start_up_choices"]["document_masking"] in ("varlen", "position_ids", "one_row")
    resumed = losses_by_step(tmp_path / "run")
    assert sorted(resumed) == list(range(1, STEPS + 1)), "metrics.jsonl keeps one line per step"
    for step in range(5, STEPS + 1):
        assert resumed[step] == reference[step], (step, resumed[step], reference[step])  # bit for bit
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    steps = [event.step for event in events.Scalars("loss")]
    assert steps == list(range(1, STEPS + 1)), "the killed run's steps 5 and 6 are purged, not shown twice"


@pytest.mark.parametrize(
    "fault,resume_step",
    [("kill_during_write@1:8", 4), ("kill_after_rename@0:8", 8)],
)  # kill_before_rename@0:8: test_a_moved_model_folder_still_resumes
def test_killed_inside_a_save_resumes_from_newest_complete(inputs, reference, tmp_path, fault, resume_step):
    crashed = run_trainer(flags(inputs, tmp_path), env={"FSDP_TRAIN_FAULT": fault})
    assert crashed.returncode != 0
    assert "step_00000004" in checkpoints(tmp_path)
    # rank 0, when rank 1 is killed, says its peer is gone and what to do, one line (it printed gloo's "Connection
    # closed by peer" traceback, which buried the killed rank's cause in torchrun's summary); a surviving rank 1 is
    # ended by torchrun, which saw rank 0 go
    said = output_of(crashed)
    if "@1" in fault:
        assert "another process of this launch stopped" in said and "rerun the same command to resume" in said, said
        assert "gloo/transport" not in said.split("another process of this launch stopped")[0], said
    rerun = run_trainer(flags(inputs, tmp_path))
    out = output_of(rerun)
    assert rerun.returncode == 0, out
    assert f"at step {resume_step}" in out
    if resume_step == 4:
        assert "removing incomplete checkpoint" in out
    assert not any(name.startswith(".tmp") for name in checkpoints(tmp_path))
    resumed = losses_by_step(tmp_path / "run")
    assert all(resumed[s] == reference[s] for s in range(resume_step + 1, STEPS + 1))


def test_a_log_window_open_at_the_save_continues_after_the_resume_on_another_process_count(inputs, tmp_path):
    """--log-freq 3 with a checkpoint at step 2: the killed run's steps 1-2 were never logged. The resumed run's
    step-3 line covers steps 1-3 like the uninterrupted run's (it covered step 3 alone: loss_avg and trained_tokens
    of one step), also when the run was killed on 2 processes and resumed on 1 (the window's sums travel in the
    checkpoint, summed over the ranks)."""
    from tests.fsdp_helpers import read_metrics

    def args(save: Path) -> list[str]:
        a = flags(inputs, save, "run", "--global-batch-size", "4", "--ckpt-freq", "2")
        a[a.index("--max-steps") + 1], a[a.index("--log-freq") + 1] = "6", "3"
        return a

    reference = run_trainer(args(tmp_path / "reference"), nproc=1)
    assert reference.returncode == 0, output_of(reference)
    killed = run_trainer(args(tmp_path), env={"FSDP_TRAIN_FAULT": "kill_after_rename@0:2"})
    assert killed.returncode != 0 and checkpoints(tmp_path) == ["step_00000002"]
    assert not read_metrics(tmp_path / "run"), "nothing logged before the kill"
    rerun = run_trainer(args(tmp_path), nproc=1)
    assert rerun.returncode == 0 and "at step 2" in output_of(rerun), output_of(rerun)
    expected = {r["step"]: r for r in read_metrics(tmp_path / "reference" / "run")}
    got = {r["step"]: r for r in read_metrics(tmp_path / "run")}
    assert sorted(got) == sorted(expected) == [3, 6]
    for step in (3, 6):
        assert got[step]["trained_tokens"] == expected[step]["trained_tokens"]
        for key in ("loss", "loss_avg"):
            assert got[step][key] == pytest.approx(expected[step][key], rel=1e-5), (step, key)


def test_sigterm_saves_at_the_interrupted_step_and_rerun_finishes(inputs, reference, tmp_path):
    proc = run_trainer(flags(inputs, tmp_path), background=True, env={"FSDP_TRAIN_STEP_DELAY_S": "0.25"})
    wait_for_step(tmp_path / "run", 5, proc)
    os.kill(proc.pid, signal.SIGTERM)  # torchrun forwards it to the workers, as on preemption
    out, _ = proc.communicate(timeout=60)
    stopped = int(out.split("stopped at step ")[1].split()[0])
    assert 5 <= stopped < STEPS
    assert f"step_{stopped:08d}" in checkpoints(tmp_path)
    rerun = run_trainer(flags(inputs, tmp_path))
    assert rerun.returncode == 0, output_of(rerun)
    assert f"at step {stopped}" in output_of(rerun)
    resumed = losses_by_step(tmp_path / "run")
    assert all(resumed[s] == reference[s] for s in range(stopped + 1, STEPS + 1))


def test_a_stop_during_evaluation_cuts_it_short_and_a_second_ctrl_c_stops_at_once(inputs, tmp_path):
    """Ctrl-C (or a preemption's SIGTERM) while the validation pass runs: the pass stops at its next micro-batch
    rather than at its end and, at step 0, the run stops without training a step or saving (it went on to train
    and save step 1), exit 0; on the rerun a second Ctrl-C ends it at once, in one line (exit 130, no traceback).
    One process (no torchrun), so the signals reach the trainer itself."""
    import subprocess

    def launch(env: dict[str, str], *extra: str) -> subprocess.Popen[str]:
        args = [*flags(inputs, tmp_path), "--eval-freq", "100", *extra]
        return run_trainer(args, nproc=1, env=env, background=True, cwd=tmp_path)

    def read_until(proc: subprocess.Popen[str], text: str) -> str:
        seen = ""
        for line in proc.stdout:
            seen += line
            if text in line:
                return seen
        raise AssertionError(f"{text!r} never printed:\n{seen}")

    proc = launch({"FSDP_TRAIN_EVAL_DELAY_S": "2"})  # every evaluation micro-batch: 2 s more
    said = read_until(proc, "training steps 1..")  # the step-0 evaluation starts
    proc.send_signal(signal.SIGINT)
    said += proc.communicate(timeout=60)[0]
    assert proc.returncode == 0 and "Traceback" not in said, said
    assert "evaluation cut short by the stop request" in said and "stopped on request before the first step" in said
    assert not (tmp_path / "run" / "checkpoint").exists() or not any((tmp_path / "run" / "checkpoint").iterdir())
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or '"val_loss"' not in metrics.read_text(), "no figures from a partial pass"

    # from scratch, without the step-0 evaluation: both signals come once the loop runs (step 1 takes 3 s)
    proc = launch({"FSDP_TRAIN_STEP_DELAY_S": "3", "FSDP_TRAIN_EVAL_DELAY_S": "0"}, "--eval-at-start", "off")
    said = read_until(proc, "training steps 1..")
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)  # "now": inside the step
    said += proc.communicate(timeout=60)[0]
    assert proc.returncode == 130 and "Traceback" not in said, said
    assert "stopped at once by Ctrl-C, without saving; rerun the same command to resume" in said

    # a second Ctrl-C while the stop's checkpoint is being written: the save is abandoned, one line, exit 130 (it was
    # "writing checkpoint ... failed ... fix the cause (a full disk, ...)" and exit 1)
    env = {"FSDP_TRAIN_STEP_DELAY_S": "1", "FSDP_TRAIN_EVAL_DELAY_S": "0", "FSDP_TRAIN_SAVE_DELAY_S": "20"}
    proc = launch(env, "--eval-at-start", "off")
    said = read_until(proc, "training steps 1..")
    proc.send_signal(signal.SIGINT)
    wait_until(lambda: any((tmp_path / "run" / "checkpoint").glob(".tmp_step_*")), timeout=60)
    time.sleep(2)  # into the write phase (FSDP_TRAIN_SAVE_DELAY_S), where DCP wraps what interrupts it
    proc.send_signal(signal.SIGINT)
    said += proc.communicate(timeout=60)[0]
    assert proc.returncode == 130 and "Traceback" not in said and "failed" not in said, said
    assert "stopped at once by Ctrl-C, without saving" in said  # the interrupt itself, or what it cut short


def _constant_lr_run(inputs, nproc: int, steps: int, save: Path):
    """Same global batch (4) at 1 or 2 processes; constant LR so a shorter first run has the same schedule."""
    args = flags(inputs, save, "run", "--grad-accum-steps", str(2 // nproc), "--lr-schedule", "constant")
    args[args.index("--max-steps") + 1] = str(steps)
    args[args.index("--warmup-steps") + 1] = "0"
    return run_trainer(args, nproc=nproc)


@pytest.fixture(scope="module")
def constant_lr_reference(inputs, tmp_path_factory) -> dict[int, float]:
    save = tmp_path_factory.mktemp("const_ref")
    assert _constant_lr_run(inputs, 2, 10, save).returncode == 0
    return losses_by_step(save / "run")


@pytest.mark.parametrize("first,second", [(2, 1), (1, 2)])
def test_resume_at_another_world_size_with_the_same_global_batch(
    inputs, constant_lr_reference, tmp_path, first, second
):
    assert _constant_lr_run(inputs, first, 5, tmp_path).returncode == 0
    resumed = _constant_lr_run(inputs, second, 10, tmp_path)
    assert resumed.returncode == 0, output_of(resumed)
    assert f"world size changed ({first} -> {second})" in output_of(resumed)
    got = losses_by_step(tmp_path / "run")
    for step in range(6, 11):
        assert got[step] == pytest.approx(constant_lr_reference[step], abs=1e-5)


def test_keep_last_prunes_old_checkpoints(inputs, tmp_path):
    proc = run_trainer(flags(inputs, tmp_path, "run", "--ckpt-freq", "2", "--keep-last", "2"), nproc=1)
    assert proc.returncode == 0, output_of(proc)
    assert checkpoints(tmp_path) == ["step_00000008", "step_00000010"]
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    assert state["step"] == 10 and state["latest_checkpoint"].endswith("step_00000010")


def test_a_refused_resume_names_the_setting_not_the_internal_key(tmp_path, monkeypatch):
    """A chat template edited in place, --data-weights, --loss-on and the adapters' settings were named by internal
    keys ("data_format: checkpoint 'chat:bab0...' vs now ...", "peft.start: checkpoint 'init' vs now 'f1ec...'")."""
    from fsdp_lib.config import TrainConfig
    from fsdp_lib.experiment_dir import packing_refusal
    from fsdp_lib.train.checkpoint import Checkpointer

    cfg = TrainConfig(experiment_name="x", save_dir=str(tmp_path), data_weights="3,1")

    def said(key: str, was, now, config: dict | None = None) -> str:
        ckpt = Checkpointer(cfg, None, {key: now})
        return ckpt._difference(key, {"fingerprint": {key: was}, "config": config or {}})

    mixture = said("data_format", "mixture[text; text]:weights-[0.5, 0.5]", "mixture[text; text]:weights-[0.75, 0.25]",
                   {"data_weights": "1,1"})  # fmt: skip
    assert mixture == "--data-weights: checkpoint '1,1' vs now '3,1'", mixture
    cfg.data_weights = ""
    template = said("data_format", "chat:bab0e3c8:loss-on-assistant", "chat:7cf79f0c:loss-on-all")
    assert template.startswith("the chat template: checkpoint bab0e3c8 (the model folder's) vs now 7cf79f0c"), template
    assert template.endswith("; --loss-on: checkpoint assistant vs now all"), template
    masking = said("data_format", "text:document-masking-on", "text:document-masking-off")
    assert masking == "--document-masking: checkpoint on vs now off", masking
    peft = said("peft", {"mode": "lora", "rank": 4, "start": "init"}, {"mode": "lora", "rank": 8, "start": "f1ec"})
    assert peft == "--lora-rank: checkpoint 4 vs now 8; --adapter (init: none): checkpoint 'init' vs now 'f1ec'", peft
    cfg.adapter = "/data/adapter-b"  # the folders, which the hashes do not name
    moved = said("peft", {"mode": "lora", "start": "aa11"}, {"mode": "lora", "start": "bb22"}, {"adapter": "/data/a"})
    assert (
        moved == "--adapter (init: none): checkpoint 'aa11' vs now 'bb22' (--adapter /data/a then, /data/adapter-b now)"
    )
    edited = said(
        "peft", {"mode": "lora", "start": "aa11"}, {"mode": "lora", "start": "bb22"}, {"adapter": cfg.adapter}
    )
    assert edited.endswith(
        "(--adapter /data/adapter-b then, /data/adapter-b now (the same folder: its files changed since the run started))"
    )
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rel_adapter").mkdir()
    cfg.adapter = "rel_adapter"  # relative on the command line, absolute in the saved config: the same folder
    relative = said("peft", {"mode": "lora", "start": "aa11"}, {"mode": "lora", "start": "bb22"},
                    {"adapter": str(Path("rel_adapter").resolve())})  # fmt: skip
    assert relative.endswith("(the same folder: its files changed since the run started))"), relative
    cfg.adapter = ""
    assert "conversations are packed" not in packing_refusal("text", "text:packing-whole", {})
    assert "conversations are packed" in packing_refusal("mixture[text; chat:ab]", "mixture[text; chat:ab]:w", {})
    kind = said("data_format", "chat:bab0e3c8:loss-on-assistant", "text")  # converted again as text
    assert kind == "the data's kind: checkpoint chat vs now text", kind
    cfg.data_weights = "3,1"
    both = said("data_format", "mixture[text; chat:aa]:w", "mixture[text; chat:bb]:w", {"data_weights": "1,1"})
    assert both.startswith("--data-weights: checkpoint '1,1' vs now '3,1'; the chat template: checkpoint aa"), both
    # the objectives' settings (objective.num_generations, objective.reference 'copy', ...)
    grpo = {"objective": "grpo", "num_generations": 4, "beta": 0.0, "reference": "none", "epsilon": [0.2, 0.2]}
    changed = {**grpo, "num_generations": 2, "beta": 0.1, "reference": "copy", "num_iterations": 2}
    assert said("objective", grpo, changed) == (
        "--grpo-beta: checkpoint 0.0 vs now 0.1; --num-generations: checkpoint 4 vs now 2; --num-iterations: "
        "checkpoint 1 vs now 2; --reference: checkpoint 'none' vs now 'live'"
    )
    dpo = {"loss": "sigmoid", "beta": 0.1, "reference": "precomputed-aa"}
    precomputed = said("objective", dpo, {**dpo, "beta": 0.2, "reference": "precomputed-bb"})
    assert precomputed.startswith(
        "--dpo-beta: checkpoint 0.1 vs now 0.2; --reference: checkpoint 'precomputed, key aa (of"
    )
    assert "key bb (of the starting weights, --adapter, --precision, --attn-implementation)'" in precomputed
    live = {"loss": "kto", "beta": 0.1, "reference": "copy", "reference_weights": "w1"}
    weights = said("objective", live, {**live, "reference_weights": "w2"})
    assert weights.startswith("the frozen reference's weights (--model-name's files, read again by a resume;"), weights


def test_a_live_reference_resumes_only_from_the_weights_it_started_with():
    """--reference live (and GRPO's KL copy) is read from the model folder again by a resume: new weights there
    made another reference, silently. Its weights' identity is pinned; a checkpoint of an older version, which has
    none, still resumes."""
    from fsdp_lib.experiment_dir import without_reference_weights

    live = {"loss": "sigmoid", "beta": 0.1, "reference": "copy"}
    assert without_reference_weights(live, {**live, "reference_weights": "w"})  # an older checkpoint
    assert not without_reference_weights({**live, "reference_weights": "v"}, {**live, "reference_weights": "w"})
    assert not without_reference_weights(live, {**live, "beta": 0.2, "reference_weights": "w"})


def test_a_forced_resume_onto_fewer_blocks_goes_on_at_the_next_epoch():
    """--force-resume onto data whose epoch is shorter than the saved position (24 samples into an epoch of 20 now)
    crashed gathering an empty step (numpy: 'need at least one array to stack'); it goes on at the next epoch's start
    and says so. A position inside the epoch stays as it is."""
    from fsdp_lib.state import TrainState

    state = TrainState(step=6, epoch=0, samples_in_epoch=24)
    said = state.fit_epoch(global_batch=4, steps_per_epoch=5)
    assert said and "24 samples into epoch 0, is past the end of this data's epoch (20 samples" in said
    assert (state.step, state.epoch, state.samples_in_epoch) == (6, 1, 0)
    inside = TrainState(step=3, epoch=2, samples_in_epoch=12)
    assert inside.fit_epoch(4, 5) is None and (inside.epoch, inside.samples_in_epoch) == (2, 12)


def test_incompatible_resume_is_refused_and_force_resume_overrides(inputs, four_steps, tmp_path):
    """A changed setting is refused by name and --force-resume overrides it; a changed model is refused naming the
    two model folders (not only their hashes), and --force-resume cannot load weights of another shape and says
    the checkpoint is intact (it used to advise moving the healthy checkpoint aside)."""
    from fsdp_lib.testing import llama_sizes

    dataset, model = inputs
    args = flags(inputs, tmp_path)
    args[args.index("--max-steps") + 1] = "4"
    copy_run(four_steps, tmp_path)
    config = next(tmp_path.glob("*/config.yaml"))
    written = config.read_bytes()
    changed = [*args, "--seq-length", "16", "--max-steps", "8"]
    refused = run_trainer(changed)
    assert refused.returncode != 0
    said = output_of(refused)  # refused from the checkpoint's train_state.json, before any tokenising or loading
    assert "--seq-length: checkpoint 32 vs now 16" in said and "--force-resume" in said
    assert "tokenis" not in said and "loaded pretrained weights" not in said, said
    assert checkpoints(tmp_path) == ["step_00000004"]
    assert config.read_bytes() == written, "the refused run rewrote config.yaml with its settings"
    # another model, forced: the change names both folders (not only their hashes, as the refusal without
    # --force-resume words it too), the weights cannot load, and the message says the checkpoint is intact
    other = make_model(tmp_path / "wider", with_weights=True, dtype="bfloat16", sizes=llama_sizes(64, 2, 128))
    forced_model = run_trainer([*args, "-m", str(other), "--force-resume"])
    said = output_of(forced_model)
    assert forced_model.returncode != 0
    assert f"model: checkpoint {str(model)!r} (" in said and f"vs now {str(other)!r} (" in said
    assert "cannot be loaded into this one, even with --force-resume. The checkpoint is intact" in said
    assert "fsdp_lib" not in said, "a traceback of our code"  # (torchrun prints its own)
    assert checkpoints(tmp_path) == ["step_00000004"]
    # adapters forced onto a full-weights checkpoint: DCP finds no adapter tensors; the checkpoint is intact (it
    # advised moving the healthy checkpoint aside, and quoted DCP's per-rank traceback)
    forced_peft = run_trainer([*args, "--max-steps", "6", "--peft", "lora", "--force-resume"], nproc=1)
    said = output_of(forced_peft)
    assert forced_peft.returncode == 1 and "was saved with other settings (" in said
    assert "peft: checkpoint 'none' vs now {'mode': 'lora', 'rank': 16," in said
    assert "even with --force-resume (RuntimeError: Missing key in checkpoint state_dict: " in said, said
    assert "The checkpoint is intact" in said and "Move that folder aside" not in said and "Traceback" not in said
    assert checkpoints(tmp_path) == ["step_00000004"]
    # forced, the pinned change is named; what may change (length of the run, logging, checkpoint frequency) is not
    forced = run_trainer([*changed, "--force-resume", "--log-freq", "2", "--ckpt-freq", "3", "--weight-decay", "0.5"])
    said = output_of(forced)
    assert forced.returncode == 0 and "at step 4" in said, said
    (warning,) = [line for line in said.splitlines() if "because of --force-resume" in line]
    assert "seq_length" in warning and not any(k in warning for k in ("max_steps", "log_freq", "ckpt_freq")), warning
    assert "step_00000008" in checkpoints(tmp_path)
    # every changed flag is said, and applies: the optimizer's hyperparameters are the flags', not the checkpoint's
    (noted,) = [line for line in said.splitlines() if "resuming with settings changed since step_00000004" in line]
    for change in ("--max-steps 8 (was 4)", "--seq-length 16 (was 32)", "--weight-decay 0.5 (was 0.0)"):
        assert change in noted, noted
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(tmp_path / "run" / "checkpoint" / "step_00000008"), str(tmp_path / "resumed.pt"))
    groups = torch.load(tmp_path / "resumed.pt", weights_only=False)["optim"]["param_groups"]
    assert [group["weight_decay"] for group in groups] == [0.5, 0.0]  # (norms and biases never decay)


@pytest.mark.parametrize("fault", ["ckpt_write@1:8", "side_files_write@0:8"])
def test_failed_write_fails_every_rank_and_keeps_the_previous_checkpoint(inputs, reference, tmp_path, fault):
    """A disk-full error on one rank, inside DCP's write or in the files a rank writes alone: no hang."""
    proc = run_trainer(flags(inputs, tmp_path), env={"FSDP_TRAIN_FAULT": fault}, timeout=180)
    out = output_of(proc)
    assert proc.returncode != 0
    assert "writing checkpoint .tmp_step_00000008 failed" in out and "(step_00000004) is intact" in out
    assert "No space left on device" in out and "(RANK " not in out, "DCP's per-rank traceback in the message"
    assert checkpoints(tmp_path) == ["step_00000004"]
    rerun = run_trainer(flags(inputs, tmp_path))
    assert rerun.returncode == 0 and losses_by_step(tmp_path / "run")[STEPS] == reference[STEPS]


def test_corrupt_checkpoint_is_an_error_not_a_restart(inputs, four_steps, tmp_path):
    args = flags(inputs, tmp_path)
    args[args.index("--max-steps") + 1] = "4"
    copy_run(four_steps, tmp_path)
    state_file = tmp_path / "run" / "checkpoint" / "step_00000004" / "train_state.json"
    state_file.write_text(state_file.read_text()[:20])
    rerun = run_trainer([*args, "--grad-accum-steps", "2"], nproc=1)  # one process: the same global batch
    assert rerun.returncode != 0
    assert str(state_file) in output_of(rerun)
    assert "resumed from" not in output_of(rerun) and "training steps 1.." not in output_of(rerun)


def test_a_checkpoint_copied_under_a_newer_name_is_not_resumed_from(inputs, four_steps, tmp_path):
    """cp -r step_4 step_9: by its name the newest, it resumed at step 4 on every rerun, so the steps after it were
    trained again each time; now it is set aside as damaged, naming both steps."""
    args = flags(inputs, tmp_path)
    args[args.index("--max-steps") + 1] = "4"
    copy_run(four_steps, tmp_path)
    root = tmp_path / "run" / "checkpoint"
    shutil.copytree(root / "step_00000004", root / "step_00000009")
    rerun = run_trainer(args)
    said = output_of(rerun)
    assert rerun.returncode == 0, said
    assert "step 4, but the folder is named step 9 (copied or renamed by hand?)" in said
    assert "resumed from" in said and "step_00000004 at step 4" in said
    assert checkpoints(tmp_path) == ["corrupt_step_00000009", "step_00000004"]


def test_an_async_checkpoint_is_committed_once_written_not_at_the_next_save(inputs, tmp_path):
    """--async-ckpt on, --ckpt-freq 4, kill -9 at step 6: the step-4 save finished writing seconds earlier (steps
    slowed to 1 s), so it is a complete checkpoint. It stayed .tmp_step_00000004 until the step-8 save committed
    it, and the rerun started from step 0."""
    killed_at_step(flags(inputs, tmp_path, "run", "--async-ckpt", "on"), tmp_path / "run", 6, delay_s="1.0")
    assert checkpoints(tmp_path) == ["step_00000004"]


def test_async_checkpoints_give_the_same_run(inputs, reference, reference_run, tmp_path):
    """And the same checkpoints, byte for byte: the later saves reuse the first one's staging copy (host_staging),
    which must hold each save's own state, not an earlier one's."""
    proc = run_trainer(flags(inputs, tmp_path, "run", "--async-ckpt", "on"))
    assert proc.returncode == 0, output_of(proc)
    assert checkpoints(tmp_path) == ["step_00000004", "step_00000008", "step_00000010"]
    assert losses_by_step(tmp_path / "run") == reference
    for step in checkpoints(tmp_path):
        shards = sorted((reference_run / "run" / "checkpoint" / step).glob("*.distcp"))
        assert shards, step
        for shard in shards:
            assert (tmp_path / "run" / "checkpoint" / step / shard.name).read_bytes() == shard.read_bytes(), shard


def test_export_round_trip_reproduces_the_trained_model(inputs, reference_run, tmp_path):
    """The reference run's export (the run of flags(), read only here) against its last DCP checkpoint."""
    from safetensors import safe_open
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    final = reference_run / "run" / "final"
    exported = AutoModelForCausalLM.from_pretrained(final, local_files_only=True, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(final, local_files_only=True)
    names = set()
    for f in final.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            names |= set(fh.keys())
            assert {fh.get_tensor(k).dtype for k in fh.keys()} == {torch.bfloat16}, "exported in the original dtype"
    assert "lm_head.weight" not in names, "tied head is not duplicated"
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    # Independent path: the last DCP checkpoint, consolidated on one process, into a plain HF model.
    dcp_to_torch_save(str(reference_run / "run" / "checkpoint" / "step_00000010"), str(tmp_path / "full.pt"))
    full = torch.load(tmp_path / "full.pt", weights_only=False)["model"]
    trained = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(final), dtype=torch.float32)
    trained.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in full.items()}, strict=False)
    trained.tie_weights()
    ids = tokenizer("3 plus 4 is 7. 5 plus", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.allclose(exported(ids).logits, trained(ids).logits, atol=1e-5)
    original = AutoModelForCausalLM.from_pretrained(inputs[1], dtype=torch.float32)
    assert not torch.equal(original.model.embed_tokens.weight, exported.model.embed_tokens.weight), "it trained"


def test_export_only_rewrites_final_from_the_newest_checkpoint(inputs, four_steps, tmp_path):
    args = flags(inputs, tmp_path)
    args[args.index("--max-steps") + 1] = "4"
    copy_run(four_steps, tmp_path)

    own = {f.name: f.read_bytes() for f in (tmp_path / "run" / "final").iterdir()}  # the run's own export
    shutil.rmtree(tmp_path / "run" / "final")
    # a full disk inside DCP's Hugging Face writer on rank 1: one message (it was DCP's per-rank traceback), no final
    full = run_trainer([*args, "--export-only"], env={"FSDP_TRAIN_FAULT": "export_write@1"})
    said = output_of(full)
    assert full.returncode != 0 and "No space left on device" in said and "fix it and rerun the same command" in said
    assert "(RANK 1)" not in said and not (tmp_path / "run" / "final").exists(), said
    # on one process, another --seq-length (the global batch and a pinned setting differ) and a dataset that no
    # longer exists: nothing trains, so no dataset is read and the checkpoint is exported as saved, without a note
    # (a resume would refuse these); the model is compared, as a resume compares it
    args[args.index("-d") + 1] = str(tmp_path / "deleted_dataset")
    proc = run_trainer([*args, "--export-only", "--seq-length", "16"], nproc=1)
    said = output_of(proc)
    assert proc.returncode == 0, said
    assert "--export-only: exporting" in said and "(step 4)" in said and "settings differ" not in said, said
    # every weight from the checkpoint (the model folder's are not read, no probe runs): the run's export, byte
    # for byte
    assert "weights are not read" in said and "documents kept apart" not in said, said
    assert {f.name: f.read_bytes() for f in (tmp_path / "run" / "final").iterdir()} == own
    # final/ holding a newer step than the newest intact checkpoint (its own was damaged, or pruned) is not replaced
    # by the older export: it may be the only copy of that step
    record = tmp_path / "run" / "final" / ".export.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "step": 6}))
    kept = {f.name: f.read_bytes() for f in (tmp_path / "run" / "final").iterdir()}
    proc = run_trainer([*args, "--export-only", "--seq-length", "16"], nproc=1)
    said = output_of(proc)
    assert proc.returncode != 0 and "holds the export of step 6, newer than step 4" in said, said
    assert "Traceback" not in said and {f.name: f.read_bytes() for f in (tmp_path / "run" / "final").iterdir()} == kept


def test_export_only_checks_what_an_export_needs(inputs, tmp_path, capsys):
    """--export-only: a missing checkpoint is the one problem named; with one, the dataset, objective, batch and
    chat-template settings are not checked (nothing trains); the tokenizer gets --chat-template where the run
    applied it (the file is checked then), a template other than the run's is warned about (it would be exported
    with the model), and a differing tokenizer or base is refused unless --force-resume."""
    from fsdp_lib.checks import validate_config
    from fsdp_lib.config import TrainConfig, load_config
    from fsdp_lib.data.chat import chat_template_hash, export_tokenizer
    from fsdp_lib.errors import CheckpointError, TrainError
    from fsdp_lib.train.checkpoint import Checkpointer

    odd = {"dataset_name": [str(tmp_path / "gone")], "objective": "grpo", "seq_length": 100_000, "batch_size": 3,
           "chat_template": str(tmp_path / "moved.jinja")}  # fmt: skip
    cfg = TrainConfig(experiment_name="run", save_dir=str(tmp_path), export_only=True, **odd)
    problems = validate_config(cfg, 2)
    assert len(problems) == 1 and "holds no checkpoint, so there is nothing to export" in problems[0]
    (tmp_path / "run" / "checkpoint").mkdir(parents=True)  # an empty folder: still nothing to export
    assert validate_config(cfg, 2) == problems
    (tmp_path / "run" / "checkpoint" / "step_00000004").mkdir()
    assert validate_config(cfg, 2) == [
        f"--model-name/-m is required (no {tmp_path / 'run' / 'config.yaml'} to take it from)"
    ]
    (tmp_path / "run" / "config.yaml").write_text("seq-length: 64\n")
    assert validate_config(cfg, 2) == [f"--model-name/-m is required ({tmp_path / 'run' / 'config.yaml'} names none)"]
    (tmp_path / "run" / "config.yaml").write_text("model_name: [cut short by a full disk\n")
    assert validate_config(cfg, 2) == [
        f"--model-name/-m is required ({tmp_path / 'run' / 'config.yaml'} cannot be read as YAML settings, and no "
        "checkpoint keeps a copy of them)"
    ]
    # a damaged (or deleted) config.yaml: the run's settings come from the newest checkpoint's copy
    kept = {"config": {"model_name": str(inputs[1]), "lora_rank": 4, "seq_length": 64}}
    (tmp_path / "run" / "checkpoint" / "step_00000004" / "train_state.json").write_text(json.dumps(kept))
    exported = load_config(["-e", "run", "--save-dir", str(tmp_path), "--export-only"])
    assert (exported.model_name, exported.lora_rank, exported.seq_length) == (str(inputs[1]), 4, 1024)
    (tmp_path / "run" / "config.yaml").unlink()
    assert load_config(["-e", "run", "--save-dir", str(tmp_path), "--export-only"]).model_name == str(inputs[1])
    cfg.model_name = str(inputs[1])
    assert validate_config(cfg, 2) == []
    cfg.export_only = False  # a training run with the same flags is refused
    assert any("--dataset-name" in p for p in validate_config(cfg, 2))

    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    cfg = TrainConfig(chat_template=str(template), export_only=True)
    # a checkpoint keeps the template its run's tokenizer held: exported as it is, with or without the file
    kept = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    saved = {"data_format": "chat:0000000000000000:loss-on-assistant", "chat_template": kept}
    assert export_tokenizer(cfg, inputs[1], saved).chat_template == kept
    assert "WARNING: --export-only: --chat-template" in capsys.readouterr().out  # the file is not the run's
    saved["data_format"] = "text:document-masking-on"  # the template rendered no data (e.g. .jsonl sample prompts)
    assert export_tokenizer(cfg, inputs[1], saved).chat_template == kept and not capsys.readouterr().out
    assert export_tokenizer(cfg, inputs[1], {**saved, "chat_template": None}).chat_template is None
    # an earlier version's checkpoint keeps data_format alone: the file where the run applied it
    tokenizer = export_tokenizer(cfg, inputs[1], {"data_format": "text:document-masking-on"})  # no template
    assert tokenizer.chat_template is None and "WARNING" not in capsys.readouterr().out
    legacy = {"data_format": "chat:0000000000000000:loss-on-assistant"}
    trained = chat_template_hash(export_tokenizer(cfg, inputs[1], legacy))
    assert "WARNING: --export-only: the run trained with chat template 0000000000000000" in capsys.readouterr().out
    tokenizer = export_tokenizer(cfg, inputs[1], {"data_format": f"mixture[chat:{trained}:loss-on-all; text]:w"})
    assert tokenizer.chat_template == template.read_text() and "WARNING" not in capsys.readouterr().out
    grpo = {"data_format": "prompts:text"}
    assert export_tokenizer(cfg, inputs[1], grpo).chat_template == template.read_text()  # GRPO's: always
    template.rename(tmp_path / "elsewhere.jinja")
    tokenizer = export_tokenizer(cfg, inputs[1], {"data_format": "text:document-masking-on"})
    assert tokenizer.chat_template is None  # not needed: no error
    assert export_tokenizer(cfg, inputs[1], {**grpo, "chat_template": kept}).chat_template == kept  # file moved
    with pytest.raises(TrainError, match="template.jinja: no such file"):
        export_tokenizer(cfg, inputs[1], grpo)

    saved = {"fingerprint": {"model": "m", "tokenizer": "t1", "peft": "none", "seq_length": 32}, "config": {}}
    now = {"model": "m", "tokenizer": "t1", "peft": "none"}
    cfg = TrainConfig(experiment_name="run", save_dir=str(tmp_path), export_only=True, model_name="other")
    Checkpointer(cfg, None, now).check_compatible(saved, tmp_path, None)  # seq_length: not an export's concern
    with pytest.raises(CheckpointError, match="cannot export .*tokenizer: checkpoint 't1' vs now 't2'.*--force-resume"):
        Checkpointer(cfg, None, {**now, "tokenizer": "t2"}).check_compatible(saved, tmp_path, None)
    cfg.force_resume = True
    Checkpointer(cfg, None, {**now, "tokenizer": "t2"}).check_compatible(saved, tmp_path, None)
    assert "WARNING: exporting" in capsys.readouterr().out


def test_partial_last_metrics_line_is_dropped_with_a_note(inputs, four_steps, tmp_path):
    args = flags(inputs, tmp_path)
    args[args.index("--max-steps") + 1] = "4"
    copy_run(four_steps, tmp_path)
    metrics = tmp_path / "run" / "metrics.jsonl"
    with open(metrics, "a") as fh:
        fh.write('{"time": "2026-01-01T00:00:00", "step": 5, "lo')  # disk full while logging: no newline
    rerun = run_trainer(flags(inputs, tmp_path, "run", "--grad-accum-steps", "2"), nproc=1)  # the same global batch
    out = output_of(rerun)
    assert rerun.returncode == 0, out
    assert "dropped 1 incomplete line(s)" in out and "at step 4" in out
    assert sorted(losses_by_step(tmp_path / "run")) == list(range(1, STEPS + 1)), "one line per step"


def test_metrics_write_failure_stops_after_a_checkpoint(inputs, reference, tmp_path):
    proc = run_trainer(flags(inputs, tmp_path), env={"FSDP_TRAIN_FAULT": "metrics_write:6"})
    out = output_of(proc)
    assert proc.returncode != 0
    assert f"cannot write {tmp_path / 'run' / 'metrics.jsonl'}" in out and "No space left on device" in out
    assert 'fsdp_train.py", line' not in out, "one message, no traceback of the trainer"
    assert checkpoints(tmp_path)[-1] == "step_00000006", "the step whose metrics failed is checkpointed"
    rerun = run_trainer(flags(inputs, tmp_path))
    assert rerun.returncode == 0 and "at step 6" in output_of(rerun), output_of(rerun)
    assert losses_by_step(tmp_path / "run")[STEPS] == reference[STEPS]


def flip_bytes(path: Path, count: int = 8) -> None:
    """Flip `count` bytes in the middle of a file, as a bad disk or a faulty copy would."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, middle + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_flipped_bytes_are_detected_and_the_previous_checkpoint_is_used(inputs, reference, reference_run, tmp_path):
    copy_run(reference_run, tmp_path)  # the finished run of flags(), damaged here in a copy
    assert checkpoints(tmp_path) == ["step_00000004", "step_00000008", "step_00000010"]
    damaged = tmp_path / "run" / "checkpoint" / "step_00000010" / "__1_0.distcp"
    flip_bytes(damaged)
    rerun = run_trainer(flags(inputs, tmp_path))
    out = output_of(rerun)
    assert rerun.returncode == 0, out
    assert f"{damaged}: checksum mismatch" in out
    assert "RESUMING FROM THE OLDER CHECKPOINT step_00000008" in out and "at step 8" in out
    assert "corrupt_step_00000010" in checkpoints(tmp_path), "moved aside out of the step_* namespace"
    assert "step_00000010" in checkpoints(tmp_path), "saved again by the resumed run"
    assert losses_by_step(tmp_path / "run") == reference, "steps 9 and 10 retrained to the same losses"


@pytest.mark.parametrize("damage", ["flipped", "checksums lost"])
def test_a_damaged_only_checkpoint_stops_the_run_instead_of_restarting(inputs, four_steps, tmp_path, damage):
    """A flipped byte, or a checksums.json lost since the save (a partial copy: it was loaded unverified, as an
    older version's checkpoint without one is)."""
    args = flags(inputs, tmp_path)
    args[args.index("--max-steps") + 1] = "4"
    copy_run(four_steps, tmp_path)
    damaged = tmp_path / "run" / "checkpoint" / "step_00000004" / "__0_0.distcp"
    flip_bytes(damaged)
    if damage == "checksums lost":
        (damaged.parent / "checksums.json").unlink()
    rerun = run_trainer([*args, "--max-steps", "6"])
    out = output_of(rerun)
    assert rerun.returncode != 0
    said = f"{damaged}: checksum mismatch" if damage == "flipped" else "missing, though the checkpoint was written with"
    assert "no intact checkpoint" in out and said in out, out
    assert "training steps 1.." not in out and checkpoints(tmp_path) == ["step_00000004"], "nothing moved"


def test_folders_not_named_like_a_step_are_ignored(inputs, four_steps, tmp_path):

    args = flags(inputs, tmp_path)
    args[args.index("--max-steps") + 1] = "8"
    copy_run(four_steps, tmp_path)
    root = tmp_path / "run" / "checkpoint"
    shutil.copytree(root / "step_00000004", root / "step_00000008.bad")  # a user moved a later checkpoint aside
    rerun = run_trainer([*args, "--keep-last", "1", "--grad-accum-steps", "2"], nproc=1)  # the same global batch
    assert rerun.returncode == 0, output_of(rerun)
    assert "at step 4" in output_of(rerun)
    assert checkpoints(tmp_path) == ["step_00000008", "step_00000008.bad"], "neither resumed from nor pruned"


@pytest.mark.parametrize("checksum", ["stale", "updated"])
def test_garbage_rng_file_is_a_clear_error(inputs, four_steps, tmp_path, checksum):
    """Garbage in rng_rank00001.pt: caught by its checksum, or (a file that matches its checksum but is not a
    torch.save payload, e.g. from another torch) by a clear message when loading it."""
    args = flags(inputs, tmp_path)
    args[args.index("--max-steps") + 1] = "4"
    copy_run(four_steps, tmp_path)
    folder = tmp_path / "run" / "checkpoint" / "step_00000004"
    rng_file = folder / "rng_rank00001.pt"
    rng_file.write_bytes(b"not a pickle at all " * 10)
    if checksum == "updated":
        from fsdp_lib.integrity import file_checksum
        from fsdp_lib.train.checkpoint import CHECKSUM_FILE

        recorded = json.loads((folder / CHECKSUM_FILE).read_text())
        recorded["files"][rng_file.name] = file_checksum(rng_file)
        (folder / CHECKSUM_FILE).write_text(json.dumps(recorded))
    rerun = run_trainer([*args, "--max-steps", "6"])
    out = output_of(rerun)
    assert rerun.returncode != 0
    assert str(rng_file) in out
    expected = "no intact checkpoint" if checksum == "stale" else "cannot restore the random number generators"
    assert expected in out
    assert "UnpicklingError" not in out.split(str(rng_file))[0] and 'fsdp_train.py", line' not in out


def test_checkpoint_of_the_previous_layout_resumes(tmp_path):
    """A checkpoint written by the single-file fsdp_train.py of commit ed51a19 (tests/fixtures/make_legacy_run.py)
    resumes under the current code, and steps 3-4 train to the losses the old code got after the same checkpoint."""

    fixture = Path(__file__).parent / "fixtures" / "legacy_run"
    work = tmp_path / "legacy_run"
    shutil.copytree(fixture, work)
    expected = json.loads((work / "expected.json").read_text())
    args = ["-e", "run", "-d", "corpus", "-m", "model", "--save-dir", "outputs", *expected["flags"]]
    rerun = run_trainer(args, cwd=work)  # the relative paths the fixture was made with
    out = output_of(rerun)
    assert rerun.returncode == 0, out
    assert "resumed from" in out and "at step 2" in out
    resumed = losses_by_step(work / "outputs" / "run")
    assert sorted(resumed) == [1, 2, 3, 4]
    for step, loss in expected["losses"].items():
        assert resumed[int(step)] == pytest.approx(loss, rel=1e-6, abs=0), (step, resumed[int(step)], loss)


def test_a_moved_model_folder_still_resumes(inputs, reference, tmp_path):
    """The model's fingerprint is its architecture, not the folder it was read from: after moving the model folder
    (or HF_HOME to another disk) the same run resumes, and trains as the uninterrupted reference did. The crash is
    a kill after step 8's shards are written and before the folder is renamed: the rerun removes the incomplete
    checkpoint and resumes from step 4 (the third case of test_killed_inside_a_save_resumes_from_newest_complete)."""

    dataset, model = inputs
    first = shutil.copytree(model, tmp_path / "models" / "a")
    crashed = run_trainer(flags((dataset, first), tmp_path), env={"FSDP_TRAIN_FAULT": "kill_before_rename@0:8"})
    assert crashed.returncode != 0 and "step_00000004" in checkpoints(tmp_path)
    assert "step_00000008" not in checkpoints(tmp_path)
    moved = first.rename(tmp_path / "elsewhere")
    rerun = run_trainer(flags((dataset, moved), tmp_path))
    assert rerun.returncode == 0, output_of(rerun)
    assert "at step 4" in output_of(rerun) and "removing incomplete checkpoint" in output_of(rerun)
    assert not any(name.startswith(".tmp") for name in checkpoints(tmp_path))
    resumed = losses_by_step(tmp_path / "run")
    assert all(resumed[s] == reference[s] for s in range(5, STEPS + 1))


def test_a_refused_resume_names_the_flag_that_restores_the_run():
    """The dataset refused by its hashes alone (after --data-slice changed), the global batch with "restore the
    original settings" (after another process count): the message now names the flag."""
    from fsdp_lib.config import TrainConfig
    from fsdp_lib.errors import CheckpointError
    from fsdp_lib.train.checkpoint import Checkpointer

    saved = {
        "fingerprint": {"dataset": "9a02", "global_batch_size": 8},
        "config": {"data_slice": "", "dataset_name": ["d"]},
    }
    cfg = TrainConfig(dataset_name=["d"], data_slice="0:100")
    with pytest.raises(CheckpointError) as refused:
        Checkpointer(cfg, None, {"dataset": "685c", "global_batch_size": 4}).check_compatible(
            saved, Path("step_4"), None
        )
    said = str(refused.value)
    assert "dataset: checkpoint '9a02' vs now '685c' (--data-slice: checkpoint '' vs now '0:100')" in said
    assert "global_batch_size: checkpoint 8 vs now 4 (--global-batch-size 8 keeps it on any process count that" in said
    cfg.data_slice = ""
    with pytest.raises(CheckpointError, match="the same -d: its files changed since the checkpoint"):
        Checkpointer(cfg, None, {"dataset": "685c", "global_batch_size": 8}).check_compatible(saved, Path("s"), None)


def test_a_failed_extra_writer_thread_fails_the_save(monkeypatch):
    """DCP's extra writer threads (thread_count > 1) dropped their errors: the file they failed to write was missing
    from a checkpoint that still committed (checksums of the rest), and a thread traceback was printed."""
    import threading

    from fsdp_lib.train.checkpoint import _writer_thread_failures

    others: list = []
    monkeypatch.setattr(threading, "excepthook", others.append)

    def _write_files_from_queue() -> None:  # DCP's writer loop, by name
        raise OSError(27, "File too large")

    def elsewhere() -> None:
        raise ValueError("not a write")

    with _writer_thread_failures() as failed:
        for target in (_write_files_from_queue, elsewhere):
            thread = threading.Thread(target=target)
            thread.start()
            thread.join()
    assert [type(e) for e in failed] == [OSError] and failed[0].errno == 27
    assert [type(args.exc_value) for args in others] == [ValueError]  # another thread's error: the usual hook
    assert threading.excepthook == others.append
    # the writer loop is known by its name in the installed torch: a rename would drop the errors again
    from torch.distributed.checkpoint import filesystem

    assert callable(filesystem._write_files_from_queue)


def test_the_same_data_planned_otherwise_is_refused_by_its_block_count():
    """A version that tokenises, skips or packs the same files otherwise (a chat run from before conversations
    without a reply were skipped) resumed on other blocks under the same dataset fingerprint, in silence: the
    blocks per epoch are pinned, and explained only where no named change (dataset, packing, ...) explains them."""
    from fsdp_lib.config import TrainConfig
    from fsdp_lib.errors import CheckpointError
    from fsdp_lib.train.checkpoint import Checkpointer

    saved = {"fingerprint": {"dataset": "9a02", "data_format": "chat:1", "epoch_blocks": 120}, "config": {}}
    ckpt = Checkpointer(TrainConfig(), None, {"dataset": "9a02", "data_format": "chat:1", "epoch_blocks": 118})
    with pytest.raises(CheckpointError, match="the train data make 118 blocks .* where the checkpoint's run made 120"):
        ckpt.check_compatible(saved, Path("step_4"), None)
    ckpt.fingerprint["data_format"] = "chat:1:packing-whole"
    with pytest.raises(CheckpointError) as refused:
        ckpt.check_compatible(saved, Path("step_4"), None)
    assert "--packing: checkpoint stream vs now whole" in str(refused.value) and "make 118" not in str(refused.value)
    older = {"fingerprint": {"dataset": "9a02", "data_format": "chat:1"}, "config": {}}  # before the count: not checked
    ckpt.fingerprint["data_format"] = "chat:1"
    ckpt.check_compatible(older, Path("step_4"), None)


def test_writer_threads_still_failing_after_the_save_failed_print_no_traceback(capsys):
    """A full disk failed the main thread's own checkpoint writes first: DCP's writer threads, not joined, failed
    after the collecting hook was gone and printed a thread traceback above the run's one-line error."""
    import threading

    from fsdp_lib.train.checkpoint import _writer_thread_failures

    def _write_files_from_queue() -> None:  # DCP's writer thread, slower to fail than the main thread
        time.sleep(0.3)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="main thread"), _writer_thread_failures() as failed:
        threading.Thread(target=_write_files_from_queue, name="Thread-9 (_write_files_from_queue)").start()
        raise OSError(28, "main thread")
    assert [str(exc) for exc in failed] == ["[Errno 28] No space left on device"]
    assert "Traceback" not in capsys.readouterr().err
