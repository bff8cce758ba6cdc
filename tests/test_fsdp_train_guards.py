"""fsdp_train.py guards around a run: one run per experiment (the lock), workers that die with torchrun,
and errors that end the output as one clear message."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import types
from pathlib import Path

import pytest

import fsdp_train as ft
from fsdp_lib.config import load_config
from fsdp_lib.errors import ExperimentLockedError
from fsdp_lib.lock import LOCK_FILE, LOCK_STALE_S, ExperimentLock
from tests.fsdp_helpers import (
    descendants,
    kill_tree,
    output_of,
    run_trainer,
    trainer_args,
    wait_for_step,
    wait_until,
)


def flags(inputs, save_dir: Path, *extra: str) -> list[str]:
    dataset, model = inputs
    return [*trainer_args("run", dataset, model, save_dir), "--max-steps", "6", "--ckpt-freq", "2", "-b", "2", *extra]


def ends_with(output: str, message: str) -> bool:
    """torchrun closes its failure report with a line of '='; what comes before it must be the message."""
    lines = [line.strip() for line in output.strip().splitlines()]
    while lines and set(lines[-1]) <= {"="}:
        lines.pop()
    return bool(lines) and message in lines[-1]


# --- the experiment lock: unit level ------------------------------------------------------------


def test_lock_refuses_a_live_holder_and_takes_over_a_dead_one(tmp_path, capsys):
    held = ExperimentLock(tmp_path / "exp")
    held.acquire()
    record = json.loads(held.path.read_text())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    with pytest.raises(ExperimentLockedError, match=f"pid {os.getpid()}"):
        ExperimentLock(tmp_path / "exp").acquire()
    held.release()
    assert not held.path.exists()

    # a lock left by a process that no longer exists (kill -9): taken over, with a message
    gone = {**record, "pid": 2**22 + 12345, "process_start": "1"}
    held.path.write_text(json.dumps(gone))
    lock = ExperimentLock(tmp_path / "exp")
    lock.acquire()
    assert "taking over the lock of a run that is gone" in capsys.readouterr().out
    assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    lock.release()


def test_a_lock_deleted_under_a_live_run_is_put_back_and_one_taken_by_another_run_ends_it(tmp_path, monkeypatch):
    """`rm run.lock` under a live run let a second launch train the same experiment beside it (interleaved
    metrics, checkpoints of two runs); the holder now puts a deleted lock back, and stops once another run holds it."""
    import fsdp_lib.lock as lock_module

    monkeypatch.setattr(lock_module, "LOCK_REFRESH_S", 0.02)
    exits = []
    monkeypatch.setattr(lock_module.os, "_exit", exits.append)
    held = ExperimentLock(tmp_path / "exp")
    held.acquire()
    record = held.path.read_text()
    held.path.unlink()
    wait_until(held.path.exists, timeout=5)
    assert held.path.read_text() == record
    intruder = {**json.loads(record), "pid": os.getpid() + 1}
    held.path.write_text(json.dumps(intruder))
    wait_until(lambda: exits == [1], timeout=5)
    held.release()
    assert json.loads(held.path.read_text()) == intruder  # the other run's lock is left to it


def test_lock_from_another_host_is_stale_only_when_no_longer_refreshed(tmp_path):
    exp = tmp_path / "exp"
    exp.mkdir()
    path = exp / LOCK_FILE
    path.write_text(json.dumps({"host": "other-node", "pid": 1, "started_at": "earlier"}))
    with pytest.raises(ExperimentLockedError, match="host other-node, pid 1"):
        ExperimentLock(exp).acquire()
    old = time.time() - LOCK_STALE_S - 60
    os.utime(path, (old, old))
    lock = ExperimentLock(exp)
    lock.acquire()
    lock.release()


@pytest.mark.parametrize("mode", ["--dry-run", "--export-only"])
def test_dry_run_and_export_only_respect_the_lock(inputs, tmp_path, mode, capsys):
    held = ExperimentLock(tmp_path / "run")
    held.acquire()
    try:
        code = ft.main([*flags(inputs, tmp_path), mode])
    finally:
        held.release()
    out = capsys.readouterr().out
    assert code == 1
    assert f"is in use by another run: host {socket.gethostname()}, pid {os.getpid()}" in out
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [], "nothing touched"


# --- the experiment lock: two real launches -------------------------------------------------------


@pytest.mark.slow
def test_second_launch_is_refused_quickly_and_a_killed_run_is_taken_over(inputs, tmp_path):
    exp = tmp_path / "run"
    first = run_trainer(flags(inputs, tmp_path), background=True, env={"FSDP_TRAIN_STEP_DELAY_S": "10"})
    try:
        # config.yaml: written once the run has built its data and model, just before its first step
        wait_until(lambda: (exp / LOCK_FILE).is_file() and (exp / "config.yaml").is_file(), first)
        holder = json.loads((exp / LOCK_FILE).read_text())
        config_mtime = (exp / "config.yaml").stat().st_mtime_ns
        started = time.monotonic()
        second = run_trainer(flags(inputs, tmp_path), timeout=120)
        refused_after = time.monotonic() - started
        out = output_of(second)
        assert second.returncode != 0
        message = f"is in use by another run: host {holder['host']}, pid {holder['pid']}"
        assert message in out
        assert ends_with(out, f"delete {exp / LOCK_FILE}."), out[-2000:]
        assert out.count(message) <= 2, "printed once by rank 0, and once more by torchrun as the root cause"
        assert refused_after < 60, refused_after
        print(f"second launch refused after {refused_after:.1f}s")
        assert (exp / "config.yaml").stat().st_mtime_ns == config_mtime, "the refused launch touched nothing"
        assert first.poll() is None, "the first run goes on"
    finally:
        kill_tree(first.pid, signal.SIGKILL)  # every process at once: the lock file stays behind
        first.wait()
    assert (exp / LOCK_FILE).is_file()
    rerun = run_trainer(flags(inputs, tmp_path))
    assert rerun.returncode == 0, output_of(rerun)
    assert "taking over the lock of a run that is gone" in output_of(rerun)
    assert not (exp / LOCK_FILE).exists(), "released at the end"


# --- errors: one clear message ---------------------------------------------------------------------


def test_abbreviations_are_refused_and_help_shows_each_flag_once(inputs, tmp_path, capsys):
    code = ft.main([*flags(inputs, tmp_path), "--max-step", "3"])
    assert code == 2
    assert "unrecognized arguments: --max-step 3" in capsys.readouterr().out
    assert load_config(["--max_steps", "3", "--seq_length", "8"]).max_steps == 3, "snake_case aliases still work"
    with pytest.raises(SystemExit):
        ft.main(["--help"])
    help_text = capsys.readouterr().out
    assert "--seed SEED, --seed SEED" not in help_text and "--seed SEED" in help_text
    assert "--seq_length" not in help_text and "--seq-length SEQ_LENGTH" in help_text
    required = help_text.split("required (on the command line or in --config):")[1]
    for flag in ("-e, --experiment-name", "-d, --dataset-name", "-m, --model-name"):
        assert flag in required
    assert "-e EXPERIMENT_NAME -d DATASET_NAME -m MODEL_NAME" in help_text.splitlines()[0]


def test_mistyped_model_folder_says_no_such_folder(inputs, tmp_path, monkeypatch, capsys):
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    code = ft.main(["-e", "x", "-d", str(inputs[0]), "-m", "models/typo"])
    out = capsys.readouterr().out
    assert code == 2
    assert "--model-name models/typo: no such folder" in out and "cache" not in out


@pytest.mark.slow
def test_torchrun_output_ends_with_the_one_error_message(inputs, tmp_path):
    proc = run_trainer([*flags(inputs, tmp_path), "--max-step", "3"], timeout=120)
    out = output_of(proc)
    assert proc.returncode != 0
    assert ends_with(out, "unrecognized arguments: --max-step 3 (see fsdp_train.py --help)"), out[-3000:]
    assert out.count("unrecognized arguments") == 2, "rank 0 prints it once; torchrun repeats it as the root cause"
    assert "usage:" not in out
    assert "error_file: <N/A>" not in out.split("Root Cause")[1]


# --- workers die with torchrun ---------------------------------------------------------------------


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # a zombie has stopped; only its exit status waits to be collected


@pytest.mark.slow
def test_kill9_of_torchrun_leaves_no_worker_alive(inputs, tmp_path):
    # 2 s after each step: the 5 steps left after step 1 outlast the kill below by seconds
    proc = run_trainer(flags(inputs, tmp_path), background=True, env={"FSDP_TRAIN_STEP_DELAY_S": "2"})
    workers: list[int] = []
    try:
        wait_for_step(tmp_path / "run", 1, proc)
        workers = descendants(proc.pid)
        assert len(workers) >= 2
        killed_at = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)  # torchrun alone, as the OOM killer or a dying node agent does
        proc.wait()
        while any(alive(pid) for pid in workers) and time.monotonic() - killed_at < 30:
            time.sleep(0.1)
        survivors = [pid for pid in workers if alive(pid)]
        print(f"workers gone {time.monotonic() - killed_at:.1f}s after kill -9 of torchrun")
        assert not survivors, f"workers still running 30 s after torchrun died: {survivors}"
    finally:
        kill_tree(proc.pid, signal.SIGKILL)
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_missing_transformers_internals_name_the_installed_and_the_tested_versions(monkeypatch):
    """Weights load and export through transformers 5's conversion internals; without them (transformers 4, or a
    release that moved them) the error says which transformers is installed and which ones are supported."""
    import sys

    import transformers

    from fsdp_lib.errors import TrainError
    from fsdp_lib.model.hf_weights import core_model_loading

    core_model_loading()  # the installed one has them
    monkeypatch.setitem(sys.modules, "transformers.core_model_loading", None)  # import of it raises ImportError
    with pytest.raises(TrainError) as refused:
        core_model_loading()
    assert f"transformers {transformers.__version__} lacks" in str(refused.value)
    assert "install transformers>=5.17,<6" in str(refused.value)


def test_a_signal_before_the_first_step_stops_at_once_and_after_it_at_the_step_boundary(capsys):
    """Tokenising, loading and a DPO reference pass take minutes with no step to save at: SIGINT or a preemption's
    SIGTERM there stops the run at once (it only logged "will checkpoint at the end of this step" and went on, so a
    SIGTERM met its SIGKILL). Once training, the first signal asks for a checkpoint; a second Ctrl-C is now."""
    from fsdp_lib.runtime import StopRequest

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    previous_hook, seen = sys.unraisablehook, []
    sys.unraisablehook = seen.append
    try:
        stop = StopRequest()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with pytest.raises(KeyboardInterrupt) as interrupt:
                stop._handle(sig, None)
            assert interrupt.value.args == (sig.name,) and not stop.requested
        stop.training = True
        stop._handle(signal.SIGTERM, None)
        stop._handle(signal.SIGTERM, None)  # a scheduler's repeated SIGTERM: still the checkpoint
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):
            stop._handle(signal.SIGINT, None)
        # Ctrl-C, then Ctrl-C again as torchrun passes it on to its workers (SIGTERM): now, as a second Ctrl-C
        stop = StopRequest()
        stop.training = True
        stop._handle(signal.SIGINT, None)
        with pytest.raises(KeyboardInterrupt) as interrupt:
            stop._handle(signal.SIGTERM, None)
        assert interrupt.value.args == ("SIGINT",)
        # before training, a KeyboardInterrupt Python dropped (raised in a weakref callback, "Exception ignored in")
        # still stops the run: the tokenising loops and the start of training look at the flag it left
        from fsdp_lib.runtime import raise_if_stopped

        stop = StopRequest()
        raise_if_stopped()  # nothing asked
        try:
            stop._handle(signal.SIGTERM, None)
        except KeyboardInterrupt:
            pass  # dropped
        dropped = types.SimpleNamespace(exc_value=KeyboardInterrupt("SIGTERM"))
        sys.unraisablehook(dropped)  # Python's "Exception ignored in ..." traceback: not printed for this one
        assert "KeyboardInterrupt" not in capsys.readouterr().err and seen == []
        other = types.SimpleNamespace(exc_value=ValueError("in a __del__"))
        sys.unraisablehook(other)  # anything else: the hook that was in place (pytest's, here a recorder)
        assert seen == [other]
        for look in (raise_if_stopped, stop.start_training):
            with pytest.raises(KeyboardInterrupt) as interrupt:
                look()
            assert interrupt.value.args == ("SIGTERM",) and not stop.training
    finally:
        from fsdp_lib.runtime import clear_stop_request

        clear_stop_request()  # the flag would stop this worker's next in-process tokenisation
        assert sys.unraisablehook == seen.append  # the hook in place before the run's is back
        sys.unraisablehook = previous_hook
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_partial_token_files_are_removed_on_an_error_and_after_a_kill(tmp_path):
    """A tokenisation stopped by an error or Ctrl-C deletes its staged files; one killed with -9 leaves them, and
    the next tokenisation deletes those of dead processes of this host (not a live writer's, not another host's)."""
    import subprocess

    from fsdp_lib.integrity import remove_stale_staged, staged_writes

    final = {"tokens": tmp_path / "train.tokens", "docs": tmp_path / "train.docs"}
    with pytest.raises(KeyboardInterrupt), staged_writes(final) as (handles, tmp):
        handles["tokens"].write(b"partial")
        raise KeyboardInterrupt
    assert not list(tmp_path.iterdir())
    dead = subprocess.Popen(["true"])  # a pid that no longer runs
    dead.wait()
    host = socket.gethostname()
    left = [tmp_path / f"train.tokens.tmp{dead.pid}.{host}", tmp_path / f"train.docs.tmp{dead.pid}.{host}"]
    kept = [tmp_path / f"train.tokens.tmp{os.getpid()}.{host}", tmp_path / f"train.tokens.tmp{dead.pid}.other-host"]
    for path in left + kept:
        path.write_bytes(b"x")
    assert remove_stale_staged(tmp_path) == sorted(p.name for p in left)
    assert sorted(tmp_path.iterdir()) == sorted(kept)
