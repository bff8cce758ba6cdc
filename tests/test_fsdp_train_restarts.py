"""Restarts without a person: under `torchrun --max-restarts`, a rank killed with SIGKILL (mid-step, or while a
checkpoint is written) makes torchrun restart the group, which connects (its store keys apart from the dead
group's), resumes from the newest intact checkpoint and trains to the losses of an uninterrupted run, bit for bit.
A launch whose ranks cannot all connect fails after --init-timeout-s with the flag named, instead of hanging."""

from __future__ import annotations

import datetime as dt
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from fsdp_lib.runtime import restart_safe_store
from fsdp_lib.testing import launch_env, torchrun_command, worker_pid
from tests.fsdp_helpers import REPO_ROOT, TRAIN_SCRIPT, losses_by_step, output_of, run_trainer, trainer_args

RUN = ["--max-steps", "16", "--ckpt-freq", "4", "-b", "2", "--lr-schedule", "constant", "--seed", "5"]
TEN_S = dt.timedelta(seconds=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_single_node_restart_puts_the_groups_keys_under_its_attempt(monkeypatch, capsys):
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False, timeout=TEN_S)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    for key, value in {**env, "TORCHELASTIC_RESTART_COUNT": "3", "TORCHELASTIC_MAX_RESTARTS": "5"}.items():
        monkeypatch.setenv(key, value)
    store = restart_safe_store(0, 2, 2, TEN_S)
    store.set("rank_0", "address")
    assert server.get("fsdp_train/attempt_3/rank_0") == b"address"  # apart from the dead attempts' keys
    # across nodes the agents count restarts differently: no prefix, a warning naming the fix instead
    assert restart_safe_store(0, 4, 2, TEN_S) is None
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in capsys.readouterr().out
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")  # torchrun without a shared store, or plain python
    assert restart_safe_store(0, 2, 2, TEN_S) is None


def test_a_rank_that_never_arrives_fails_the_launch_after_init_timeout(inputs, tmp_path):
    """Rank 0 of a world of 2 started alone: it stops after --init-timeout-s 3, naming the flag, not after the
    collective timeout (30 minutes)."""
    dataset, model = inputs
    env = launch_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"})
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    args = [*trainer_args("alone", dataset, model, tmp_path), "--init-timeout-s", "3"]
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(TRAIN_SCRIPT), *args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=180)  # fmt: skip
    assert proc.returncode == 1, output_of(proc)
    assert "rank 0 of 2 could not set up the process group within --init-timeout-s 3" in output_of(proc)
    assert time.monotonic() - start < 120


def restarting_run(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    command = torchrun_command(TRAIN_SCRIPT, args, 2)
    command.insert(command.index("--standalone") + 1, "--max-restarts=2")
    return subprocess.Popen(command, cwd=REPO_ROOT, env=launch_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(inputs, tmp_path_factory) -> dict[int, float]:
    save = tmp_path_factory.mktemp("restart_reference")
    proc = run_trainer([*trainer_args("run", *inputs, save), *RUN])
    assert proc.returncode == 0, output_of(proc)
    return losses_by_step(save / "run")


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["mid-step", "checkpoint-write"])
def test_torchrun_restarts_the_group_and_it_resumes_bit_identically(inputs, uninterrupted, moment, tmp_path):
    args = [*trainer_args("run", *inputs, tmp_path), *RUN]
    env = {"FSDP_TRAIN_STEP_DELAY_S": "0.2"}
    if moment == "checkpoint-write":  # rank 1 dies inside DCP's write of step 8 (first attempt only)
        env["FSDP_TRAIN_FAULT"] = "kill_during_write@1:8"
    proc = restarting_run(args, env)
    try:
        if moment == "mid-step":  # kill -9 of rank 1 once step 6 is logged: between checkpoints 4 and 8
            deadline = time.monotonic() + 120
            while max(losses_by_step(tmp_path / "run"), default=0) < 6:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
                time.sleep(0.05)
            pid = worker_pid(proc.pid, 1)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
        log = proc.communicate(timeout=240)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, log
    assert "failed (exitcode: -9) local_rank: 1" in log, log  # the group was restarted, not run once
    assert f"resumed from {tmp_path / 'run' / 'checkpoint'}" in log
    assert losses_by_step(tmp_path / "run") == uninterrupted
