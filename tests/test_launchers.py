"""scripts/slurm_submit.sh, scripts/multinode_launch.sh and configs/*.yaml, tested without SLURM or GPUs.

Slurm's commands are replaced by fakes on PATH: `scontrol` prints host names and records requeues, `srun` runs
its task command locally and handles signals the way the real srun does (src/srun/libsrun/srun_job.c: SIGTERM
becomes SIGKILL for the tasks, SIGUSR1 is forwarded to every process of the step). The end-to-end tests start the real torchrun on CPU with
a stub fsdp_train.py that records its arguments and, like the trainer, saves and exits 0 on SIGTERM.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fsdp_lib.config import ON_OFF, TrainConfig
from tests.fsdp_helpers import wait_until

REPO_ROOT = Path(__file__).resolve().parent.parent
SLURM_SUBMIT = REPO_ROOT / "scripts" / "slurm_submit.sh"
MULTINODE_LAUNCH = REPO_ROOT / "scripts" / "multinode_launch.sh"
CONFIG_FILES = sorted((REPO_ROOT / "configs").glob("*.yaml"))

# The keys a config may use, their choices and types: straight from fsdp_train.py's config dataclass.
TRAINER_FIELDS = {f.name.replace("_", "-"): f for f in dataclasses.fields(TrainConfig)}


def allowed_config_keys() -> frozenset[str]:
    return frozenset(TRAINER_FIELDS)


ON_OFF_KEYS = {k for k, f in TRAINER_FIELDS.items() if f.metadata.get("choices") == ON_OFF}
CHOICES = {k: set(f.metadata["choices"]) for k, f in TRAINER_FIELDS.items() if f.metadata.get("choices")}
INT_KEYS = {k for k, f in TRAINER_FIELDS.items() if str(f.type) == "int"}
FLOAT_KEYS = {k for k, f in TRAINER_FIELDS.items() if str(f.type) == "float"}
REAL_MODEL_CONFIGS = {
    "llama3.2_1b.yaml": "meta-llama/Llama-3.2-1B",
    "llama3.2_3b_instruct.yaml": "meta-llama/Llama-3.2-3B-Instruct",
    "mistral_7b_v0.3.yaml": "mistralai/Mistral-7B-v0.3",
    "qwen2.5_7b.yaml": "Qwen/Qwen2.5-7B",
    "llama3.1_8b_lora.yaml": "meta-llama/Llama-3.1-8B-Instruct",
    "llama3.1_70b_qlora.yaml": "meta-llama/Llama-3.1-70B-Instruct",
    "llama3.1_8b_128k.yaml": "meta-llama/Llama-3.1-8B",
    "llama3_8b_1m_4nodes.yaml": "gradientai/Llama-3-8B-Instruct-Gradient-1048k",
}
# The positions each named model's config.json declares (max_position_embeddings): a config training past them is
# refused by the trainer (the 1M config named Llama-3.1-8B, 131,072, and could never start).
MODEL_POSITIONS = {
    "meta-llama/Llama-3.2-1B": 131072,
    "meta-llama/Llama-3.2-3B-Instruct": 131072,
    "mistralai/Mistral-7B-v0.3": 32768,
    "Qwen/Qwen2.5-7B": 131072,
    "meta-llama/Llama-3.1-8B-Instruct": 131072,
    "meta-llama/Llama-3.1-70B-Instruct": 131072,
    "meta-llama/Llama-3.1-8B": 131072,
    "gradientai/Llama-3-8B-Instruct-Gradient-1048k": 1048576,
}


def load_config(path: Path) -> dict[str, object]:
    config = yaml.safe_load(path.read_text())
    assert isinstance(config, dict), f"{path.name}: not a mapping"
    return {key.replace("_", "-"): value for key, value in config.items()}


# ---------------------------------------------------------------------------------------------------------------
# Configs


def test_all_expected_configs_exist() -> None:
    names = {path.name for path in CONFIG_FILES}
    assert set(REAL_MODEL_CONFIGS) | {"demo_tiny.yaml"} <= names


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_config_keys_are_trainer_flags_with_valid_values(path: Path) -> None:
    config = load_config(path)
    unknown = set(config) - allowed_config_keys()
    assert not unknown, f"{path.name}: keys that are not fsdp_train.py flags: {sorted(unknown)}"
    for key, value in config.items():
        if key in ON_OFF_KEYS:
            assert value in ("on", "off"), f'{path.name}: {key}: {value!r}; quote it ("on"/"off"), YAML reads a bool'
        elif key in CHOICES:
            assert value in CHOICES[key], f"{path.name}: {key}: {value!r} not in {sorted(CHOICES[key])}"
        elif key in INT_KEYS:
            assert type(value) is int and value >= 0, f"{path.name}: {key}: {value!r} is not a whole number"
        elif key in FLOAT_KEYS:
            assert type(value) in (int, float), f"{path.name}: {key}: {value!r} is not a number (write 2.0e-5)"


@pytest.mark.parametrize("name", sorted(REAL_MODEL_CONFIGS))
def test_model_config_names_its_model_and_leaves_the_run_to_the_user(name: str) -> None:
    config = load_config(REPO_ROOT / "configs" / name)
    assert config["model-name"] == REAL_MODEL_CONFIGS[name]
    positions = MODEL_POSITIONS[REAL_MODEL_CONFIGS[name]]
    assert int(config.get("seq-length", 2048)) <= positions, f"{name}: past {positions} positions, refused"
    assert "dataset-name" not in config and "experiment-name" not in config
    for key in ("batch-size", "grad-accum-steps", "seq-length", "precision", "cpu-offload", "activation-checkpointing"):
        assert key in config, f"{name}: {key} must be chosen (and explained) in the config"
    assert config["precision"] == "bf16"
    adapters = config.get("peft", "none") != "none"  # LoRA/QLoRA train at about 10x full fine-tuning's rate
    assert 0 < config["min-lr"] < config["lr"] <= (1e-3 if adapters else 1e-4)
    if config["activation-checkpointing"] == "off":
        assert "ac-every-n-layers" not in config, f"{name}: ac-every-n-layers has no effect without checkpointing"


def test_demo_config_is_tiny_fp32_and_leaves_paths_to_the_demo() -> None:
    config = load_config(REPO_ROOT / "configs" / "demo_tiny.yaml")
    assert config["seq-length"] == 128
    assert config["precision"] == "fp32"
    assert 100 <= config["max-steps"] <= 1000
    assert not {"model-name", "dataset-name", "experiment-name"} & set(config)


# ---------------------------------------------------------------------------------------------------------------
# Fakes: a repository with a stub trainer, Slurm's commands


STUB_TRAINER = r'''
"""Stub fsdp_train.py: records argv and environment. Stops like the trainer: SIGTERM or SIGINT -> "save" for a
second and exit 0; a SIGINT after an earlier stop signal means "now": exit 130 without saving."""
import json, os, signal, sys, time
from pathlib import Path

out = Path(os.environ["STUB_OUT"])
rank = os.environ.get("RANK", "0")
signals = []


def on_signal(signum, frame):
    if signals and signum == signal.SIGINT:
        os._exit(130)
    signals.append(signum)


signal.signal(signal.SIGTERM, on_signal)
signal.signal(signal.SIGINT, on_signal)
keys = ("WORLD_SIZE", "LOCAL_RANK", "OMP_NUM_THREADS", "HF_HUB_OFFLINE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
record = {"argv": sys.argv[1:], "cwd": os.getcwd(), "env": {k: os.environ.get(k) for k in keys}}
(out / f"argv.{rank}.json").write_text(json.dumps(record))
(out / f"started.{rank}").touch()
if os.environ.get("STUB_MODE") == "finish":
    sys.exit(0)
deadline = time.monotonic() + 60
while not signals and time.monotonic() < deadline:
    time.sleep(0.05)
if not signals:
    sys.exit(3)
time.sleep(1.0)  # the checkpoint: a SIGKILL during it leaves no saved.<rank>
(out / f"saved.{rank}").write_text(str(len(signals)))
sys.exit(0)
'''

FAKE_SCONTROL = r"""#!/usr/bin/env bash
printf '%s\n' "$*" >> "$FAKE_SLURM_LOG/scontrol.calls"
if [[ $1 == show && $2 == hostnames ]]; then printf '%s\n' $FAKE_HOSTNAMES; fi
"""

FAKE_SRUN = r"""#!/usr/bin/env bash
# Runs the task command (what follows srun's --options) once, locally. Signals as the real srun handles them.
printf '%s\n' "$@" > "$FAKE_SLURM_LOG/srun.args"
[[ ${FAKE_SRUN_MUST_NOT_RUN:-0} == 1 ]] && { echo "fake srun: must not run here" >&2; exit 99; }
while [[ $# -gt 0 && $1 == --* ]]; do shift; done
"$@" &
task=$!
trap 'echo TERM >> "$FAKE_SLURM_LOG/srun.signals"; kill -KILL $task' TERM HUP
# slurmstepd delivers a forwarded signal to every process of the step (the whole cgroup), not just the task.
descendants() { local child; for child in $(pgrep -P "$1"); do echo "$child"; descendants "$child"; done; }
trap 'echo USR1 >> "$FAKE_SLURM_LOG/srun.signals"; kill -USR1 $task $(descendants $task) 2>/dev/null' USR1
while :; do
  wait $task; status=$?
  kill -0 $task 2>/dev/null || exit $status
done
"""


@pytest.fixture()
def fake_repo(tmp_path: Path) -> Path:
    """A checkout with the real launch scripts (linked) and a stub fsdp_train.py."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for script in (SLURM_SUBMIT, MULTINODE_LAUNCH):
        (repo / "scripts" / script.name).symlink_to(script)
    (repo / "fsdp_train.py").write_text(STUB_TRAINER)
    (repo / "stub_out").mkdir()
    return repo


@pytest.fixture()
def slurm_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def clean_env(**overrides: str) -> dict[str, str]:
    """The test's environment without launcher or Slurm variables leaking in, plus overrides."""
    leaky = ("SLURM_", "NNODES", "NODE_RANK", "MASTER_", "NPROC_PER_NODE", "GPUS_PER_NODE", "TOTAL_BATCH_SIZE")
    leaky += ("MICRO_BATCH_SIZE", "EXPERIMENT", "DATASET", "MODEL", "CONFIG", "DRY_RUN", "REPO_DIR", "OMP_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if not k.startswith(leaky)}
    env["PYTHON"] = sys.executable
    env.update(overrides)
    return env


def slurm_env(repo: Path, bin_dir: Path, **overrides: str) -> dict[str, str]:
    env = clean_env(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        FAKE_SLURM_LOG=str(bin_dir),
        FAKE_HOSTNAMES="gpu01 gpu02 gpu03 gpu04",
        SLURM_SUBMIT_DIR=str(repo),
        SLURM_JOB_ID="12345",
        SLURM_JOB_NODELIST="gpu[01-04]",
        SLURM_NNODES="4",
        SLURM_CPUS_PER_TASK="64",
        GPUS_PER_NODE="8",
        STUB_OUT=str(repo / "stub_out"),
    )
    env.update(overrides)
    return env


def run_script(script: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=60)


def torchrun_line(stdout: str) -> list[str]:
    lines = [shlex.split(line) for line in stdout.splitlines() if "torch.distributed.run" in line]
    assert len(lines) == 1, stdout
    return lines[0]


def flag_value(words: list[str], flag: str) -> str:
    assert flag in words, f"{flag} missing from {words}"
    return words[words.index(flag) + 1]


# ---------------------------------------------------------------------------------------------------------------
# Dry runs: the computed commands


def test_scripts_pass_bash_syntax_check() -> None:
    for script in (SLURM_SUBMIT, MULTINODE_LAUNCH):
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr


def test_slurm_dry_run_derives_rendezvous_grad_accum_and_passes_arguments(fake_repo: Path, slurm_bin: Path) -> None:
    env = slurm_env(fake_repo, slurm_bin, DRY_RUN="1", FAKE_SRUN_MUST_NOT_RUN="1", TOTAL_BATCH_SIZE="256")
    env.update(MICRO_BATCH_SIZE="2", EXPERIMENT="exp1", DATASET="hf_datasets/corpus", MODEL="meta-llama/Llama-3.2-1B")
    env["NODE_RANK"] = "3"  # left over in the submitting shell: must not switch the nodes to static ranks
    result = run_script(fake_repo / "scripts" / "slurm_submit.sh", env, "--lr", "1e-5", "--max-steps", "10")
    assert result.returncode == 0, result.stderr
    srun_line = shlex.split(result.stdout.splitlines()[0])
    assert srun_line[0] == "srun"
    assert {"--nodes=4", "--ntasks=4", "--ntasks-per-node=1", "--cpus-per-task=64", "--export=ALL"} <= set(srun_line)
    assert srun_line[-5:] == [str(fake_repo / "scripts" / "multinode_launch.sh"), "--lr", "1e-5", "--max-steps", "10"]

    words = torchrun_line(result.stdout)
    assert flag_value(words, "--nnodes") == "4"
    assert flag_value(words, "--nproc-per-node") == "8"
    assert flag_value(words, "--rdzv-backend") == "c10d"
    assert flag_value(words, "--rdzv-endpoint") == "gpu01:29845"  # first node; port 29500 + 12345 % 1000
    assert flag_value(words, "--rdzv-id") == "12345"
    assert "--node-rank" not in words and "--standalone" not in words
    assert flag_value(words, "--max-restarts") == "2"  # a dead rank restarts the group, which resumes
    trainer_args = words[words.index(str(fake_repo / "fsdp_train.py")) + 1 :]
    assert flag_value(trainer_args, "--grad-accum-steps") == "4"  # 256 / (2 x 4 nodes x 8 GPUs)
    assert flag_value(trainer_args, "--batch-size") == "2"
    assert flag_value(trainer_args, "-e") == "exp1"
    assert flag_value(trainer_args, "-d") == "hf_datasets/corpus"
    assert flag_value(trainer_args, "-m") == "meta-llama/Llama-3.2-1B"
    assert trainer_args[-4:] == ["--lr", "1e-5", "--max-steps", "10"]  # last, so they override the derived ones
    assert "show hostnames gpu[01-04]" in (slurm_bin / "scontrol.calls").read_text()


@pytest.mark.parametrize(
    ("total", "micro", "expected"),
    [
        ("100", "2", ["TOTAL_BATCH_SIZE=100 is not divisible", "= 64", "such as 64 or 128"]),
        ("32", "2", ["TOTAL_BATCH_SIZE=32 is smaller than one micro-batch", "= 64"]),
        ("0", "2", ["TOTAL_BATCH_SIZE=0 must be a positive integer"]),
        ("64", "two", ["MICRO_BATCH_SIZE=two must be a positive integer"]),
    ],
)
def test_slurm_rejects_a_total_batch_that_does_not_split(
    fake_repo: Path, slurm_bin: Path, total: str, micro: str, expected: list[str]
) -> None:
    env = slurm_env(fake_repo, slurm_bin, TOTAL_BATCH_SIZE=total, MICRO_BATCH_SIZE=micro, SLURM_NNODES="4")
    env["FAKE_SRUN_MUST_NOT_RUN"] = "1"
    result = run_script(fake_repo / "scripts" / "slurm_submit.sh", env, "-e", "x")
    assert result.returncode == 2, result.stdout + result.stderr
    for text in expected:
        assert text in result.stderr
    assert not (slurm_bin / "srun.args").exists(), "srun started although the batch arithmetic was wrong"


def test_micro_batch_comes_from_the_config_when_not_given(fake_repo: Path, slurm_bin: Path) -> None:
    (fake_repo / "run.yaml").write_text("batch_size: 4\nseq-length: 512\n")
    env = slurm_env(fake_repo, slurm_bin, DRY_RUN="1", TOTAL_BATCH_SIZE="256", CONFIG="run.yaml")
    result = run_script(fake_repo / "scripts" / "slurm_submit.sh", env)
    assert result.returncode == 0, result.stderr
    words = torchrun_line(result.stdout)
    assert flag_value(words, "--config") == "run.yaml"
    assert flag_value(words, "--batch-size") == "4"
    assert flag_value(words, "--grad-accum-steps") == "2"  # 256 / (4 x 32)


@pytest.mark.parametrize(
    ("given", "config", "accum"),
    [
        (["--context-parallel", "4"], "", "8"),  # 256 / (4 x 32 / 4): 8 data-parallel groups
        (["--context-parallel=8"], "", "16"),
        ([], "context-parallel: 2\n", "4"),
        (["--context_parallel", "1"], "context-parallel: 2\n", "2"),  # the command line's wins
    ],
)
def test_total_batch_counts_data_parallel_groups_under_context_parallel(
    fake_repo: Path, slurm_bin: Path, given: list[str], config: str, accum: str
) -> None:
    """With --context-parallel N the processes of one context group share each sequence: TOTAL_BATCH_SIZE=2 on 2
    processes at CP 2 trained a global batch of 1 (the trainer's own log said so), silently."""
    (fake_repo / "run.yaml").write_text("batch-size: 4\n" + config)
    env = slurm_env(fake_repo, slurm_bin, DRY_RUN="1", TOTAL_BATCH_SIZE="256", CONFIG="run.yaml")
    result = run_script(fake_repo / "scripts" / "slurm_submit.sh", env, *given)
    assert result.returncode == 0, result.stderr
    assert flag_value(torchrun_line(result.stdout), "--grad-accum-steps") == accum
    if config:  # the same file given as a --config argument instead of CONFIG
        del env["CONFIG"]
        result = run_script(fake_repo / "scripts" / "slurm_submit.sh", env, "--config", "run.yaml", *given)
        assert result.returncode == 0, result.stderr
        assert flag_value(torchrun_line(result.stdout), "--grad-accum-steps") == accum


@pytest.mark.parametrize(
    ("config", "args", "expected"),
    [
        ("batch-size: 8\n\tlr: 1\n", [], "CONFIG=run.yaml cannot be read as YAML"),
        ("batch-size: 8.0\n", [], "the config run.yaml's batch-size (8.0) must be a positive integer"),
        ("batch-size: 4\n", ["--context-parallel", "3"], "--context-parallel 3 does not divide the 32 processes"),
        ("batch-size: 4\ncontext-parallel: two\n", [], "the config run.yaml's context-parallel two must be a positive"),
    ],
)
def test_launcher_config_problems_are_one_line(
    fake_repo: Path, slurm_bin: Path, config: str, args: list[str], expected: str
) -> None:
    (fake_repo / "run.yaml").write_text(config)
    env = slurm_env(fake_repo, slurm_bin, DRY_RUN="1", TOTAL_BATCH_SIZE="256", CONFIG="run.yaml")
    result = run_script(fake_repo / "scripts" / "slurm_submit.sh", env, *args)
    assert result.returncode == 2 and expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "conflicting",
    [["--grad-accum-steps", "3"], ["-b", "4"], ["--batch-size=4"], ["-b4"], ["--global-batch-size", "64"]],
)
def test_batch_flags_in_arguments_conflict_with_total_batch(
    fake_repo: Path, slurm_bin: Path, conflicting: list[str]
) -> None:
    env = slurm_env(fake_repo, slurm_bin, DRY_RUN="1", TOTAL_BATCH_SIZE="256", MICRO_BATCH_SIZE="2")
    result = run_script(fake_repo / "scripts" / "slurm_submit.sh", env, "--lr", "1e-5", *conflicting)
    assert result.returncode == 2
    assert f"{conflicting[0]} in the arguments conflicts with TOTAL_BATCH_SIZE" in result.stderr


def test_global_batch_size_beside_micro_batch_size_alone_is_the_run_s_total(fake_repo: Path, slurm_bin: Path) -> None:
    env = slurm_env(fake_repo, slurm_bin, DRY_RUN="1", MICRO_BATCH_SIZE="4")
    result = run_script(fake_repo / "scripts" / "slurm_submit.sh", env, "--global-batch-size", "256")
    assert result.returncode == 0, result.stderr
    words = torchrun_line(result.stdout)
    assert flag_value(words, "--batch-size") == "4" and flag_value(words, "--global-batch-size") == "256"


def test_slurm_script_outside_a_job_says_how_to_submit(fake_repo: Path, slurm_bin: Path) -> None:
    env = slurm_env(fake_repo, slurm_bin)
    del env["SLURM_JOB_ID"]
    result = run_script(fake_repo / "scripts" / "slurm_submit.sh", env)
    assert result.returncode == 2
    assert "SLURM_JOB_ID is not set" in result.stderr and "multinode_launch.sh" in result.stderr


@pytest.mark.parametrize(
    ("extra_env", "expected", "absent"),
    [
        ({"NNODES": "1"}, ["--standalone"], ["--rdzv-backend", "--node-rank"]),
        (
            {"NNODES": "2", "MASTER_ADDR": "10.0.0.1"},
            ["--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.1:29500", "--rdzv-id", "fsdp_train"],
            ["--standalone", "--node-rank"],
        ),
        (
            {"NNODES": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "6000", "NODE_RANK": "1"},
            ["--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "6000"],
            ["--standalone", "--rdzv-backend"],
        ),
    ],
    ids=["single-node", "c10d", "static-node-rank"],
)
def test_multinode_rendezvous_modes(
    fake_repo: Path, extra_env: dict[str, str], expected: list[str], absent: list[str]
) -> None:
    env = clean_env(DRY_RUN="1", NPROC_PER_NODE="4", TOTAL_BATCH_SIZE="64", MICRO_BATCH_SIZE="2", **extra_env)
    result = run_script(fake_repo / "scripts" / "multinode_launch.sh", env, "-e", "run", "--seed", "3")
    assert result.returncode == 0, result.stderr
    words = torchrun_line(result.stdout)
    command = " ".join(words)
    assert " ".join(expected) in command
    for flag in absent:
        assert flag not in words
    nodes = int(extra_env["NNODES"])
    assert flag_value(words, "--grad-accum-steps") == str(64 // (2 * 4 * nodes))
    assert "--max-restarts" not in words  # MAX_RESTARTS unset: torchrun's default, no restart
    assert words[-4:] == ["-e", "run", "--seed", "3"]


@pytest.mark.parametrize(
    ("extra_env", "message"),
    [
        ({"NNODES": "2"}, "NNODES=2 needs MASTER_ADDR"),
        ({"NNODES": "2", "MASTER_ADDR": "h", "NODE_RANK": "2"}, "NODE_RANK=2 must be between 0 and NNODES-1 (1)"),
        ({"NNODES": "1", "CONFIG": "missing.yaml"}, "CONFIG=missing.yaml not found"),
        ({"NNODES": "1", "MAX_RESTARTS": "two"}, "MAX_RESTARTS=two must be a whole number >= 0"),
        ({"NNODES": "1", "MASTER_PORT": "99999"}, "MASTER_PORT=99999 must be a TCP port, 1 to 65535"),
        ({"NNODES": "1", "NODE_RANK": "1"}, "NODE_RANK=1 must be between 0 and NNODES-1 (0)"),
    ],
)
def test_multinode_rejects_incomplete_settings(fake_repo: Path, extra_env: dict[str, str], message: str) -> None:
    env = clean_env(DRY_RUN="1", NPROC_PER_NODE="4", **extra_env)
    result = run_script(fake_repo / "scripts" / "multinode_launch.sh", env)
    assert result.returncode == 2
    assert message in result.stderr


@pytest.mark.parametrize(
    ("extra_env", "expected"),
    [
        ({"CUDA_VISIBLE_DEVICES": "0,1,2"}, "3"),
        ({"CUDA_VISIBLE_DEVICES": "GPU-6b7d2a1c-1d2e-3f4a-5b6c-7d8e9f0a1b2c, 1"}, "2"),
        ({"CUDA_VISIBLE_DEVICES": "0,-1,2"}, "1"),  # CUDA stops at the first entry that is no device
        ({"CUDA_VISIBLE_DEVICES": "NPROC", "NPROC_PER_NODE": "02"}, "2"),  # leading zeros are decimal, not octal
        ({"NNODES": "01", "NODE_RANK": "0", "NPROC_PER_NODE": "08"}, "8"),  # one node: standalone, NODE_RANK 0 ok
    ],
)
def test_multinode_counts_the_visible_gpus_as_cuda_does(fake_repo: Path, extra_env: dict, expected: str) -> None:
    result = run_script(fake_repo / "scripts" / "multinode_launch.sh", clean_env(DRY_RUN="1", **extra_env))
    assert result.returncode == 0, result.stderr
    words = torchrun_line(result.stdout)
    assert flag_value(words, "--nproc-per-node") == expected and "--standalone" in words


@pytest.mark.parametrize("hidden", ["-1", "NoDevFiles", ""])
def test_multinode_with_every_gpu_hidden_asks_for_nproc_per_node(fake_repo: Path, hidden: str) -> None:
    result = run_script(
        fake_repo / "scripts" / "multinode_launch.sh", clean_env(DRY_RUN="1", CUDA_VISIBLE_DEVICES=hidden)
    )
    assert result.returncode == 2 and "set NPROC_PER_NODE" in result.stderr


def test_multinode_requires_a_trainer_next_to_it(tmp_path: Path) -> None:
    result = run_script(MULTINODE_LAUNCH, clean_env(DRY_RUN="1", NPROC_PER_NODE="1", REPO_DIR=str(tmp_path)))
    assert result.returncode == 2
    assert f"{tmp_path}/fsdp_train.py not found" in result.stderr


def test_sbatch_header_requests_one_task_per_node_requeue_and_appending_logs() -> None:
    directives = [
        line.split(None, 1)[1] for line in SLURM_SUBMIT.read_text().splitlines() if line.startswith("#SBATCH")
    ]
    assert "--ntasks-per-node=1" in directives
    assert "--requeue" in directives and "--open-mode=append" in directives
    assert any(d.startswith("--signal=B:") for d in directives), "the time-limit signal must go to the batch shell"


# ---------------------------------------------------------------------------------------------------------------
# End to end: real torchrun on CPU, stub trainer, real signals


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def time_limit_signal() -> signal.Signals:
    """The signal the #SBATCH --signal=B:SIG@seconds line asks Slurm to send the batch shell."""
    for line in SLURM_SUBMIT.read_text().splitlines():
        if line.startswith("#SBATCH --signal=B:"):
            return signal.Signals["SIG" + line.split("B:", 1)[1].split("@")[0]]
    raise AssertionError("no #SBATCH --signal=B:... line")


@pytest.mark.slow
def test_multinode_usr1_makes_the_ranks_save_and_torchrun_exit_zero(fake_repo: Path) -> None:
    out = fake_repo / "stub_out"
    env = clean_env(NPROC_PER_NODE="2", STUB_OUT=str(out), TOTAL_BATCH_SIZE="8", MICRO_BATCH_SIZE="2")
    launcher = subprocess.Popen(
        ["bash", str(fake_repo / "scripts" / "multinode_launch.sh"), "-e", "e2e", "--lr", "3e-4"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_until(lambda: all((out / f"started.{rank}").exists() for rank in (0, 1)), launcher)
    launcher.send_signal(signal.SIGUSR1)
    output = launcher.communicate(timeout=60)[0]

    assert launcher.returncode == 0, output
    for rank in (0, 1):
        assert (out / f"saved.{rank}").read_text() == "1", output  # one SIGTERM, from the launcher only
        record = json.loads((out / f"argv.{rank}.json").read_text())
        assert flag_value(record["argv"], "--grad-accum-steps") == "2"  # 8 / (2 x 2 processes)
        assert record["argv"][-4:] == ["-e", "e2e", "--lr", "3e-4"]
        assert record["cwd"] == str(fake_repo)
        assert record["env"]["HF_HUB_OFFLINE"] == "1" and record["env"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        assert int(record["env"]["OMP_NUM_THREADS"]) >= 1
    assert "death signal" not in output, "torchrun itself was signalled and would SIGKILL the ranks after 30 s"


@pytest.mark.slow
def test_multinode_ctrl_c_reaches_the_ranks_once_and_they_save(fake_repo: Path) -> None:
    out = fake_repo / "stub_out"
    launcher = subprocess.Popen(
        ["bash", str(fake_repo / "scripts" / "multinode_launch.sh"), "-e", "e2e"],
        env=clean_env(NPROC_PER_NODE="2", STUB_OUT=str(out)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, like a shell's foreground job
    )
    wait_until(lambda: all((out / f"started.{rank}").exists() for rank in (0, 1)), launcher)
    os.killpg(launcher.pid, signal.SIGINT)  # Ctrl-C: the launcher and torchrun get it, the ranks do not
    output = launcher.communicate(timeout=60)[0]

    # A second stop signal (say a SIGTERM from the launcher on top of torchrun's SIGINT) would abort the save.
    for rank in (0, 1):
        assert (out / f"saved.{rank}").read_text() == "1", output
    assert launcher.returncode == 1, output  # torchrun exits 1 whenever it was signalled itself


@pytest.mark.slow
@pytest.mark.parametrize(("restarts", "requeued"), [("0", True), ("20", False)])
def test_slurm_time_limit_signal_saves_then_requeues(
    fake_repo: Path, slurm_bin: Path, restarts: str, requeued: bool
) -> None:
    out = fake_repo / "stub_out"
    env = slurm_env(fake_repo, slurm_bin, FAKE_HOSTNAMES="localhost", SLURM_NNODES="1", SLURM_JOB_ID="4242")
    env.update(GPUS_PER_NODE="2", MASTER_PORT=str(free_port()), TOTAL_BATCH_SIZE="8", MICRO_BATCH_SIZE="2")
    env.update(EXPERIMENT="resumable", SLURM_RESTART_COUNT=restarts, MAX_REQUEUES="20")
    batch_shell = subprocess.Popen(
        ["bash", str(fake_repo / "scripts" / "slurm_submit.sh"), "--seed", "7"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_until(lambda: all((out / f"started.{rank}").exists() for rank in (0, 1)), batch_shell)
    batch_shell.send_signal(time_limit_signal())  # what Slurm does at time limit - N seconds
    output = batch_shell.communicate(timeout=60)[0]

    assert batch_shell.returncode == 0, output
    assert (out / "saved.0").exists() and (out / "saved.1").exists(), output
    assert (slurm_bin / "srun.signals").read_text().split() == ["USR1"], "srun must never get SIGTERM (it SIGKILLs)"
    record = json.loads((out / "argv.0.json").read_text())
    assert flag_value(record["argv"], "-e") == "resumable"
    assert flag_value(record["argv"], "--grad-accum-steps") == "2"
    assert record["argv"][-2:] == ["--seed", "7"]
    calls = (slurm_bin / "scontrol.calls").read_text().splitlines()
    assert ("requeue 4242" in calls) == requeued, output


@pytest.mark.slow
def test_slurm_job_that_finishes_is_not_requeued(fake_repo: Path, slurm_bin: Path) -> None:
    env = slurm_env(fake_repo, slurm_bin, FAKE_HOSTNAMES="localhost", SLURM_NNODES="1", STUB_MODE="finish")
    env.update(GPUS_PER_NODE="2", MASTER_PORT=str(free_port()), EXPERIMENT="done")
    result = run_script(fake_repo / "scripts" / "slurm_submit.sh", env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (fake_repo / "stub_out" / "started.1").exists()
    assert "--ntasks-per-node=1" in (slurm_bin / "srun.args").read_text().split()
    assert "requeue" not in (slurm_bin / "scontrol.calls").read_text()


EXIT_SCRIPT = """
import atexit, sys, threading, time
from pathlib import Path
from fsdp_lib.interrupts import exit_without_teardown
out = Path(sys.argv[1])
atexit.register(lambda: out.with_name("atexit").write_text("ran"))
if sys.argv[2] == "thread":  # a non-daemon thread still working: the normal exit, which waits for it
    threading.Thread(target=lambda: (time.sleep(0.3), out.with_name("thread").write_text("done"))).start()
print("last line", end="")  # no newline: still in the buffer when the process ends
exit_without_teardown(3)
"""


@pytest.mark.parametrize("case", ["plain", "thread"])
def test_tools_end_without_teardown_but_after_atexit_threads_and_output(tmp_path: Path, case: str) -> None:
    """exit_without_teardown (every tool's last call): the exit code, the atexit handlers, buffered output and a
    non-daemon thread's work all survive skipping the interpreter's teardown."""
    proc = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT, str(tmp_path / "x"), case],
        capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert proc.returncode == 3 and proc.stdout == "last line", (proc.stdout, proc.stderr)
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").is_file() == (case == "thread")


def test_setup_env_installs_once_for_test_and_demo_and_again_when_requirements_change(tmp_path: Path) -> None:
    """make test (requirements + dev) then make demo (requirements only) installs nothing the second time: the
    stamps once disagreed, so each switch reinstalled everything, and offline the pip upgrade failed the target."""
    for name in ("requirements.txt", "requirements-dev.txt"):
        (tmp_path / name).write_text((REPO_ROOT / name).read_text())
    calls = tmp_path / "pip_calls"
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    # A venv's python whose pip records each call and, for "--upgrade pip", fails as it does offline.
    python.write_text(f'#!/bin/sh\necho "$*" >> {calls}\ncase "$*" in *"--upgrade pip"*) exit 1;; esac\nexit 0\n')
    python.chmod(0o755)

    def setup(*files: str) -> subprocess.CompletedProcess:
        argv = ["bash", str(REPO_ROOT / "scripts" / "setup_env.sh"), "torch==2.13.0", *files]
        return subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=60)

    def installs() -> int:
        lines = calls.read_text().splitlines() if calls.exists() else []
        calls.unlink(missing_ok=True)
        return sum("install --quiet" in line and "--upgrade pip" not in line for line in lines)

    first = setup("requirements-dev.txt")
    assert first.returncode == 0, first.stderr
    assert "could not upgrade pip (offline?)" in first.stdout and installs() == 2  # torch, then the requirements
    assert setup().returncode == 0 and installs() == 0  # make demo after make test
    assert setup("requirements-dev.txt").returncode == 0 and installs() == 0
    (tmp_path / "requirements.txt").write_text((REPO_ROOT / "requirements.txt").read_text() + "rich\n")
    assert setup().returncode == 0 and installs() == 2


def test_setup_env_mends_a_broken_venv_and_names_a_missing_or_old_python(tmp_path: Path) -> None:
    """A .venv whose base Python was removed (a dangling bin/python), one without pip (a venv made where
    python3-venv is missing) or one whose packages are gone under a valid stamp failed on every make with
    'No such file or directory' or a traceback; no Python, or one older than 3.10, went on to pip's errors."""
    (tmp_path / "requirements.txt").write_text((REPO_ROOT / "requirements.txt").read_text())
    calls, marker = tmp_path / "calls", tmp_path / "packages_gone"
    venv_python = (
        f'#!/bin/sh\necho "$*" >> {calls}\ncase "$*" in *find_spec*) [ -e {marker} ] && exit 1;; esac\nexit 0\n'
    )
    base = tmp_path / "python3"  # a base Python whose `-m venv --clear DIR` writes the recording venv python
    base.write_text(
        '#!/bin/sh\ncase "$1" in -c) exit "${OLD:-0}";; esac\n'
        f'mkdir -p "$4/bin" && cat > "$4/bin/python" <<"EOF"\n{venv_python}EOF\nchmod +x "$4/bin/python"\n'
    )
    base.chmod(0o755)

    def setup(python: Path | str = base, **env: str) -> subprocess.CompletedProcess:
        argv = ["bash", str(REPO_ROOT / "scripts" / "setup_env.sh"), "torch==2.13.0"]
        environment = {**os.environ, "PYTHON": str(python), **env}
        return subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=60, env=environment)

    def installs() -> int:
        lines = calls.read_text().splitlines() if calls.exists() else []
        calls.unlink(missing_ok=True)
        return sum("install --quiet" in line and "--upgrade pip" not in line for line in lines)

    missing = setup(tmp_path / "nowhere" / "python3")
    assert missing.returncode == 2 and "install Python 3.10 or newer, or set PYTHON" in missing.stderr
    old = setup(OLD="1")
    assert old.returncode == 2 and "needs 3.10 or newer" in old.stderr and not (tmp_path / ".venv").exists()
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").symlink_to(tmp_path / "removed_python")  # the base Python is gone
    mended = setup()
    assert mended.returncode == 0 and "does not work" in mended.stdout and installs() == 2, mended.stderr
    assert setup().returncode == 0 and installs() == 0  # installed: nothing to do
    marker.write_text("")  # the stamp says installed, the packages are gone
    assert setup().returncode == 0 and installs() == 2
    # a venv whose python runs but has no pip (uv venv): refused with the fix, never emptied and made again
    pipless = tmp_path / ".venv" / "bin" / "python"
    pipless.write_text('#!/bin/sh\ncase "$*" in *pip*) exit 1;; esac\nexit 0\n')
    (tmp_path / ".venv" / "lib_of_the_user").write_text("kept")
    refused = setup()
    assert refused.returncode == 2 and "has no pip: install it there" in refused.stderr, refused.stderr
    assert (tmp_path / ".venv" / "lib_of_the_user").read_text() == "kept"
