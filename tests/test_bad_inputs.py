"""Bad input across the tools, as a careless user gives it: each case is refused with a message naming the flag (or
the folder) and the fix and a non-zero exit, and every byte that existed before is still there afterwards. Most
cases run no training step: the tools refuse before any work. This table holds the cases that cross tools (one tool
pointed at another's folders) and the trainer's; tests/test_bad_inputs_data_hf.py and test_bad_inputs_tools.py hold
data_hf's own and organize_data's and model_download's."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

import data_hf
import fsdp_train
from tests.bad_inputs import (
    Case,
    check_refused,
    data_hf_case,
    make_raw,
    make_user_folders,
    model_download_case,
    organize_case,
    trainer_case,
    trainer_flags,
)

CASES = [
    data_hf_case(
        "data_hf --overwrite onto a training experiment",
        lambda r: ["--data_folder", r / "raw", "--save_dir", r / "outputs" / "exp", "--overwrite"],
        "--save_dir",
        "a training experiment of fsdp_train.py",
        "replaces only a dataset",
        "choose another --save_dir",
    ),
    data_hf_case(
        "data_hf --overwrite onto a model folder",
        lambda r: ["--data_folder", r / "raw", "--save_dir", r / "model", "--overwrite"],
        "--save_dir",
        "a model folder (config.json)",
        "choose another --save_dir",
    ),
    data_hf_case(
        "data_hf --overwrite onto organize_data's split folders",
        lambda r: ["--data_folder", r / "raw", "--save_dir", r / "splits", "--overwrite"],
        "split folders of organize_data.py",
        "choose another --save_dir",
    ),
    data_hf_case(
        "data_hf --overwrite onto a folder of the user's own files",
        lambda r: ["--data_folder", r / "splits", "--save_dir", r / "raw", "--overwrite"],
        "not a dataset written by data_hf.py",
        "refusing to delete it even with --overwrite",
    ),
    data_hf_case(
        "data_hf reading a dataset it already wrote",
        lambda r: ["--data_folder", r / "dataset", "--save_dir", r / "again"],
        "--data_folder",
        "is a dataset",
        "not raw files",
        "fsdp_train.py -d",
    ),
    data_hf_case(
        "data_hf reading a training experiment",
        lambda r: ["--data_folder", r / "outputs" / "exp", "--save_dir", r / "again"],
        "--data_folder",
        "a training experiment of fsdp_train.py",
        "pass the folder that holds your raw files",
    ),
    data_hf_case(
        "data_hf reading a model folder",
        lambda r: ["--data_folder", r / "model", "--save_dir", r / "again"],
        "--data_folder",
        "a model folder",
        "pass the folder that holds your raw files",
    ),
    data_hf_case(
        "data_hf --format auto on conversations that are all invalid",
        lambda r: ["--data_folder", r / "bad_chat", "--save_dir", r / "again"],
        "--format auto: all 4 record(s) have the shape of conversations or preference pairs but none could be used",
        "unknown_role",
        "pass --format text",
    ),
    data_hf_case(
        "data_hf --format auto on preference pairs whose responses are all identical",
        lambda r: ["--data_folder", r / "same_pairs", "--save_dir", r / "again"],
        "--format auto: all 4 record(s)",
        "identical_responses",
    ),
    model_download_case(
        "model_download --init --overwrite onto a training experiment",
        lambda r: [
            "--init",
            "tiny",
            "--tokenizer-from",
            r / "dataset",
            "--local-dir",
            r / "outputs" / "exp",
            "--overwrite",
        ],
        "--local-dir",
        "a training experiment of fsdp_train.py",
        "--overwrite replaces only a model folder",
    ),
    model_download_case(
        "model_download --init --overwrite onto a dataset",
        lambda r: ["--init", "tiny", "--tokenizer-from", r / "dataset", "--local-dir", r / "dataset", "--overwrite"],
        "--local-dir",
        "is a dataset",
    ),
    data_hf_case(
        "data_hf with a million worker processes",
        lambda r: ["--data_folder", r / "raw", "--save_dir", r / "again", "--num-proc", "1000000"],
        "--num-proc 1000000 must be between 1 and",
        "each worker is a process with its own memory",
    ),
    organize_case(
        "organize_data with a billion split folders",
        lambda r: ["--src-dir", r / "raw", "--dst-root", r / "new_splits", "--num-dirs", "1000000000", "--dry-run"],
        "--num-dirs must be between 1 and 10,000",
    ),
    organize_case(
        "organize_data with no split folders",
        lambda r: ["--src-dir", r / "raw", "--dst-root", r / "new_splits", "--num-dirs", "0"],
        "--num-dirs must be between 1 and 10,000",
    ),
    trainer_case(
        "fsdp_train on a model whose safetensors file was cut short",
        lambda r: trainer_flags(r, "run", "cut_weights"),
        "--model-name",
        "model.safetensors",
        "truncated",
        "fetch the model again",
    ),
    trainer_case(
        "fsdp_train on a model whose tokenizer.json is not JSON",
        lambda r: trainer_flags(r, "run", "bad_tokenizer"),
        "tokenizer.json is not valid JSON",
        "restore it or fetch the model again",
    ),
    trainer_case(
        "fsdp_train on a model whose embedding is smaller than its tokenizer",
        lambda r: trainer_flags(r, "run", "small_vocab"),
        "the tokenizer has ids up to",
        "but the model's embedding has",
        "Use the model's own tokenizer, or resize the embedding",
    ),
    trainer_case(
        "fsdp_train with --sample-prompts that are not UTF-8",
        lambda r: [*trainer_flags(r, "run"), "--sample-prompts", r / "latin1_prompts.txt"],
        "--sample-prompts",
        "not UTF-8 text (byte 18 is 0xe9)",
        "save it as UTF-8",
    ),
    trainer_case(
        "fsdp_train with a --chat-template that is not UTF-8",
        lambda r: [*trainer_flags(r, "run"), "--chat-template", r / "latin1_prompts.txt"],
        "--chat-template",
        "not UTF-8 text",
    ),
    trainer_case(
        "fsdp_train with the token cache as the experiment",
        lambda r: trainer_flags(r, ".token_cache"),
        "--experiment-name '.token_cache'",
        "the project's own folders",
        "choose a plain name",
    ),
    trainer_case(
        "fsdp_train with an experiment named like a dataset folder under --save-dir",
        lambda r: trainer_flags(r, "corpus"),
        "--experiment-name corpus",
        "is a dataset",
        "not an experiment",
        "choose another --experiment-name or --save-dir",
    ),
]


@pytest.fixture(scope="module")
def user_folders(tmp_path_factory, inputs) -> Path:
    return make_user_folders(tmp_path_factory.mktemp("user"), inputs[1])


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_refused_by_name_and_touches_nothing(case: Case, user_folders: Path, capsys) -> None:
    check_refused(case, user_folders, capsys)


def test_a_full_disk_is_named_even_when_the_library_lost_the_errno(tmp_path: Path, monkeypatch) -> None:
    """torch's zip writer turns ENOSPC into 'unexpected pos 704 vs 598'; the OS error is said in words either way."""
    import shutil
    from collections import namedtuple

    from fsdp_lib.errors import explain_write_error

    usage = namedtuple("usage", "total used free")
    lost = RuntimeError("[enforce fail at inline_container.cc:783] . PytorchStreamWriter failed writing file "
                        "data/0: unexpected pos 704 vs 598")  # fmt: skip
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100 * 2**30, 100 * 2**30 - 2**20, 2**20))
    said = explain_write_error(lost, tmp_path)
    assert "unexpected pos 704 vs 598" in said and f"only 1 MiB are free on the file system of {tmp_path}" in said
    assert said.endswith("no space left on device?")
    wrapped = RuntimeError("write failed")
    wrapped.__cause__ = OSError(30, "Read-only file system", str(tmp_path / "x.distcp"))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100 * 2**30, 2**30, 99 * 2**30))
    assert explain_write_error(wrapped, tmp_path) == (
        f"Read-only file system: {tmp_path / 'x.distcp'} (RuntimeError: write failed)"
    )


@pytest.mark.parametrize("signum, expected", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_or_sigterm_ends_data_hf_and_model_download_with_one_line(
    signum: int, expected: int, tmp_path: Path, monkeypatch, capsys, ctrl_c_raises
) -> None:
    """Interrupted mid-run: one line, the shell's exit code, no traceback, nothing half-written left behind."""
    import model_download

    def interrupted(*args, **kwargs) -> None:
        os.kill(os.getpid(), signum)

    raw = make_raw(tmp_path / "raw")
    monkeypatch.setattr(data_hf, "print_summary", interrupted)  # after the conversion, before the publish
    assert data_hf.main(["--data_folder", str(raw), "--save_dir", str(tmp_path / "ds")]) == expected
    assert capsys.readouterr().err.strip().splitlines()[-1] == "data_hf: interrupted; nothing was written"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw"]  # no dataset, no temporary folder

    monkeypatch.setattr(model_download, "run_download", interrupted)
    assert model_download.main(["--model-name", "org/name", "--local-dir", str(tmp_path / "m")]) == expected
    said = capsys.readouterr()
    assert said.out.strip().splitlines()[-1].startswith("model_download.py: interrupted; rerun the same command")
    assert "Traceback" not in said.out + said.err


def test_an_os_error_in_the_trainer_is_one_message_with_the_path(inputs, tmp_path: Path, monkeypatch, capsys) -> None:
    """A read-only --save-dir (the lock file cannot be created): the OS error in words, no traceback. Simulated: the
    tests run as root, whom no permission stops."""
    from fsdp_lib import lock

    dataset, model = inputs

    def read_only(*args, **kwargs) -> None:
        raise OSError(30, "Read-only file system", str(tmp_path / "outputs" / "run" / "run.lock"))

    monkeypatch.setattr(lock.ExperimentLock, "acquire", read_only)
    argv = ["-e", "run", "-d", str(dataset), "-m", str(model), "--save-dir", str(tmp_path / "outputs")]
    assert fsdp_train.main([*argv, "--seq-length", "64"]) == 1
    said = capsys.readouterr().out
    assert f"Read-only file system: {tmp_path / 'outputs' / 'run' / 'run.lock'}" in said
    assert "fix it and rerun the same command" in said and "Traceback" not in said
