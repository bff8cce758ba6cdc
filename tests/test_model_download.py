"""model_download.py: hub downloads against a fake hub on 127.0.0.1, offline verification, --init presets.

Downloads run the CLI in a subprocess: huggingface_hub reads HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE when it is
imported, and this test process has it imported with HF_HUB_OFFLINE=1 (conftest.py).
"""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hub_server import FakeHub, closed_port
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

import fsdp_lib.hub.scratch as scratch
import model_download as md
from fsdp_lib.hub.console import ToolError
from fsdp_lib.hub.download import check_free_space, explain_hub_error
from fsdp_lib.hub.plan import glob_escape, plan_download
from fsdp_lib.hub.presets import SIZE_PRESETS, preset_config_kwargs, preset_parameter_count
from fsdp_lib.hub.verify import VERIFICATION_RECORD, read_verification_record
from fsdp_lib.hub.weights import ExpectedTensor, compare_weights
from fsdp_lib.lock import FolderLock
from fsdp_lib.model.hf_files import TensorInfo, read_safetensors_header
from fsdp_lib.model.memory_plan import format_memory_plan, training_memory_plan
from fsdp_lib.records.schema import PREFERENCE_COLUMNS
from tests.fsdp_helpers import wait_until

REPO_ID = "org/tiny"
# Served next to the model but useless for training: a download must leave them alone.
UNNEEDED_FILES = {
    "README.md": b"# tiny\n",
    ".gitattributes": b"*.safetensors filter=lfs\n",
    "pytorch_model.bin": b"\0" * 64,  # a .bin beside safetensors: safetensors win
    "original/consolidated.00.pth": b"\0" * 64,
}
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def tokenize(text):\n    return text.split()\n",
    '{"name": "example", "values": [1, 2, 3]}',
    "Offline training needs every file on disk before the job starts.",
] * 50


ROUNDTRIP_TEXTS = ["The lazy dog.", "  two leading spaces\tand a tab\n", "unseen: ünïcödé 日本語 🙂 ZZZ", ""]


# ---------------------------------------------------------------------------------------------------------
# fixtures: a corpus, a tiny model made by --init, the same model re-saved in shards and served by a fake hub
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import datasets

    path = tmp_path_factory.mktemp("corpus") / "dataset"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"text": CORPUS}), "test": datasets.Dataset.from_dict({"text": ["x"]})}
    ).save_to_disk(str(path))
    return path


@pytest.fixture(scope="module")
def tiny_model(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("init") / "tiny"
    argv = ["--init", "tiny", "--tokenizer-from", str(corpus), "--local-dir", str(folder), "--with-weights"]
    assert md.main([*argv, "--dtype", "float32"]) == 0
    return folder


@pytest.fixture(scope="module")
def served_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model as a hub repo holds it: safetensors in 3 shards with an index, config, tokenizer."""
    folder = tmp_path_factory.mktemp("served") / "tiny"
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model.save_pretrained(folder, max_shard_size="200KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / name, folder / name)
    assert len(list(folder.glob("model-*-of-*.safetensors"))) == 3
    return folder


@pytest.fixture
def hub(served_model: Path) -> Iterator[FakeHub]:
    fake = FakeHub()
    fake.add_folder(REPO_ID, served_model, extra=UNNEEDED_FILES)
    fake.start()
    yield fake
    fake.stop()


def run_cli(
    args: list[str],
    hf_home: Path,
    endpoint: str,
    offline: bool = False,
    background: bool = False,
    env_extra: dict[str, str] | None = None,
) -> subprocess.CompletedProcess | subprocess.Popen:
    """model_download.py in a fresh interpreter against `endpoint`; `background` returns the running process."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(
        HF_HOME=str(hf_home),
        HF_ENDPOINT=endpoint,
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        HF_HUB_DISABLE_TELEMETRY="1",
    )
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    env.update(env_extra or {})
    command = [sys.executable, str(Path(md.__file__)), *args]
    if background:
        return subprocess.Popen(  # Ctrl-C as a terminal's, also when the suite runs as a background job (SIGINT ignored)
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)


def snapshot_of(hf_home: Path, hub: FakeHub) -> Path:
    return hf_home / "hub" / "models--org--tiny" / "snapshots" / hub.repos[REPO_ID].commit


def assert_same_files(folder: Path, served: Path) -> None:
    for path in served.iterdir():
        assert (folder / path.name).read_bytes() == path.read_bytes(), path.name


# ---------------------------------------------------------------------------------------------------------
# download against the fake hub
# ---------------------------------------------------------------------------------------------------------


def test_download_fetches_training_files_only_then_verifies_offline(
    hub: FakeHub, served_model: Path, tmp_path: Path, capsys, monkeypatch
):
    hf_home = tmp_path / "hf_home"
    hub.repos[REPO_ID].gated_token = "hf_from_env"  # also shows HF_TOKEN reaches the hub
    result = run_cli(["--model-name", REPO_ID], hf_home, hub.url, env_extra={"HF_TOKEN": "hf_from_env"})
    assert result.returncode == 0, result.stderr

    snapshot = snapshot_of(hf_home, hub)
    assert_same_files(snapshot, served_model)
    fetched = {
        record.path.split("/resolve/")[1].split("/", 1)[1]
        for record in hub.requests
        if record.method == "GET" and "/resolve/" in record.path
    }
    assert fetched == {path.name for path in served_model.iterdir()}  # not README, .bin or original/
    record = read_verification_record(snapshot)
    assert record is not None and record["source"]["commit"] == hub.repos[REPO_ID].commit
    assert f"parameters:   {record['num_params']:,}" in result.stdout
    assert "activations NOT included" in result.stdout and "with --cpu-offload" in result.stdout

    # The training machine: no hub at all, HF_HUB_OFFLINE=1, load by name from the copied HF_HOME.
    requests_before = len(hub.requests)
    offline = run_cli(
        ["--model-name", REPO_ID, "--verify-only", "--checksums"],
        hf_home,
        f"http://127.0.0.1:{closed_port()}",
        offline=True,
    )
    assert offline.returncode == 0, offline.stderr
    assert "verified org/tiny @ main" in offline.stdout
    # fsdp_train.py -m org/tiny finds it offline, although the snapshot lacks what the download skipped (a README):
    # huggingface_hub's tree listing calls such a snapshot incomplete
    from huggingface_hub import constants

    from fsdp_lib.offline import resolve_model_dir

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    assert resolve_model_dir(REPO_ID) == snapshot
    assert f"checksums: {len(list(served_model.iterdir()))} file(s) match the hub's" in offline.stdout
    assert len(hub.requests) == requests_before

    # A byte changed at the file's own size: the headers and sizes still pass; only the checksums see it.
    shard = snapshot / "model-00002-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))  # through the symlink, into the blob
    assert md.main(["--verify-only", "--local-dir", str(snapshot)]) == 0
    assert md.main(["--verify-only", "--local-dir", str(snapshot), "--checksums"]) == 1
    said = capsys.readouterr().err
    assert "model-00002-of-00003.safetensors differs from the hub's copy" in said and "--force-download" in said


@pytest.fixture(scope="module")
def wide_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A single-file model of ~18 MB: huggingface_hub reads the body in 10 MiB chunks and can only resume
    from a chunk boundary, so a resume test needs a file with more than one chunk."""
    folder = tmp_path_factory.mktemp("served") / "wide"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    wide = {"hidden_size": 384, "intermediate_size": 1536, "num_attention_heads": 6}
    config = LlamaConfig(
        **{**preset_config_kwargs(SIZE_PRESETS["tiny"], len(tokenizer)), **wide},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder, max_shard_size="1GB")
    tokenizer.save_pretrained(folder)
    assert (folder / "model.safetensors").stat().st_size > 15 * 2**20
    return folder


def test_dropped_connection_is_resumed_with_a_range_request(hub: FakeHub, wide_model: Path, tmp_path: Path):
    """The server closes the connection two thirds into the weights; huggingface_hub retries within the same
    run from the last complete 10 MiB chunk (Range: bytes=N-), so the run completes byte-identical."""
    hub.add_folder("org/wide", wide_model, gated_token="hf_flag")  # also shows --token reaches the hub
    size = (wide_model / "model.safetensors").stat().st_size
    hub.drop_after["model.safetensors"] = size * 2 // 3
    out = tmp_path / "model"
    argv = ["--model-name", "org/wide", "--local-dir", str(out), "--token", "hf_flag"]
    result = run_cli(argv, tmp_path / "hf_home", hub.url)
    assert result.returncode == 0, result.stderr

    first, second = hub.file_gets("model.safetensors")
    assert first.range is None and not first.completed
    resumed_at = int(second.range.removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_at <= size * 2 // 3  # the bytes before it were kept, not fetched again
    assert_same_files(out, wide_model)
    assert read_verification_record(out) is not None


@pytest.mark.slow
def test_killed_download_never_looks_complete_and_a_rerun_finishes_it(hub: FakeHub, served_model: Path, tmp_path: Path):
    """Kill the process mid-shard (power cut, Ctrl-C): nothing claims to be complete, offline verification
    names the missing shard, and a rerun fetches only what is missing."""
    hf_home = tmp_path / "hf_home"
    shard = "model-00003-of-00003.safetensors"
    others = [path.name for path in served_model.glob("model-0000[12]-*.safetensors")]
    hub.hang_after[shard] = (served_model / shard).stat().st_size // 2
    snapshot = snapshot_of(hf_home, hub)
    process = run_cli(["--model-name", REPO_ID], hf_home, hub.url, background=True)
    try:
        assert hub.hanging.wait(timeout=120), "the download never reached the stalled shard"
        # the other shards download in parallel threads: let them land so the rerun can be shown to skip them
        wait_until(lambda: all((snapshot / name).exists() for name in others), timeout=60)
    finally:
        process.kill()
        process.communicate()
    hub.release.set()

    assert read_verification_record(snapshot) is None
    broken = run_cli(
        ["--model-name", REPO_ID, "--verify-only"], hf_home, f"http://127.0.0.1:{closed_port()}", offline=True
    )
    assert broken.returncode == 1  # the folder says its download did not finish, and how to finish it
    unfinished = (
        f"did not finish (.model_download_incomplete); finish it with: python model_download.py --model-name {REPO_ID}"
    )
    assert unfinished in broken.stderr
    from fsdp_lib.model.hf_files import model_folder_problems

    assert unfinished in model_folder_problems(snapshot)[0]  # the trainer refuses it too

    rerun = run_cli(["--model-name", REPO_ID], hf_home, hub.url)
    assert rerun.returncode == 0, rerun.stderr
    assert_same_files(snapshot, served_model)
    assert read_verification_record(snapshot) is not None and not (snapshot / ".model_download_incomplete").exists()
    assert len(hub.file_gets(shard)) == 2
    for name in [*others, "config.json", "tokenizer.json"]:
        assert len(hub.file_gets(name)) == 1, f"{name} was fetched again"
    assert "partial file(s)" in rerun.stdout  # the killed run's .incomplete file is reported


@pytest.mark.parametrize("where", ["cache", "local_dir"])
def test_bytes_damaged_on_the_way_are_caught_removed_and_fetched_again(
    hub: FakeHub, served_model: Path, tmp_path: Path, where: str
):
    """A shard served with one byte changed (its size and ETag right) passed the download's verification, which read
    headers and sizes, and a rerun kept it: every download now checks every byte against the hub's checksums and
    removes what differs, so the rerun it asks for fetches it again."""
    hf_home = tmp_path / "hf_home"
    shard = "model-00002-of-00003.safetensors"
    hub.damage_once.add(shard)
    local = ["--local-dir", str(tmp_path / "model")] if where == "local_dir" else []
    damaged = run_cli(["--model-name", REPO_ID, *local], hf_home, hub.url)
    assert damaged.returncode == 1 and "Traceback" not in damaged.stderr
    assert f"{shard} of {REPO_ID} arrived with bytes that differ from the hub's checksum" in damaged.stderr
    folder = tmp_path / "model" if local else snapshot_of(hf_home, hub)
    assert not (folder / shard).exists() and (folder / ".model_download_incomplete").exists()
    rerun = run_cli(["--model-name", REPO_ID, *local], hf_home, hub.url)
    assert rerun.returncode == 0, rerun.stderr
    assert "checksums: " in rerun.stdout and not (folder / ".model_download_incomplete").exists()
    assert_same_files(folder, served_model)
    assert len(hub.file_gets(shard)) == 2


def test_a_rerun_that_fetches_nothing_never_marks_a_finished_download_unfinished(
    hub: FakeHub, served_model: Path, tmp_path: Path
):
    """A rerun of a finished download wrote the unfinished-download marker before fetching nothing; interrupted (in
    its verification, here), it left a model the trainer had trained from refused as unfinished."""
    hf_home = tmp_path / "hf_home"
    assert run_cli(["--model-name", REPO_ID], hf_home, hub.url).returncode == 0
    snapshot = snapshot_of(hf_home, hub)
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import fsdp_lib.hub.verify as verify\n"
        "def interrupted(*args, **kwargs):\n    raise KeyboardInterrupt\n"
        "verify.verify_and_record = interrupted\n"
    )
    path = os.pathsep.join([str(shim), str(Path(md.__file__).parent)])
    rerun = run_cli(["--model-name", REPO_ID], hf_home, hub.url, env_extra={"PYTHONPATH": path})
    assert rerun.returncode == 130, rerun.stdout + rerun.stderr
    assert not (snapshot / ".model_download_incomplete").exists()
    from fsdp_lib.model.hf_files import model_folder_problems

    assert model_folder_problems(snapshot) == []


def test_only_what_a_download_fetched_is_checked_and_plain_files_use_the_listing(tmp_path: Path):
    """Checksums come from the hub's listing (an LFS file's SHA-256, else its blob id), so a cache on a file system
    without links (plain files, no blob names) is checked too (it failed every download); files the run did not
    fetch, such as a user's edited README in a --local-dir, are neither read nor removed."""
    import hashlib

    from fsdp_lib.hub.download import HubSnapshot, check_fetched

    weights, readme = b"weights" * 100, b"my own notes"
    (tmp_path / "model.safetensors").write_bytes(weights)
    (tmp_path / "README.md").write_bytes(readme)
    sums = {"model.safetensors": hashlib.sha256(weights).hexdigest(), "README.md": "0" * 40}
    snapshot = HubSnapshot(REPO_ID, "main", tmp_path, None, False, "c" * 40, {}, checksums=sums)
    snapshot.fetched = ["model.safetensors"]
    check_fetched(snapshot, tmp_path)
    assert (tmp_path / "README.md").read_bytes() == readme
    (tmp_path / "model.safetensors").write_bytes(weights[:-1] + b"!")
    with pytest.raises(ToolError, match="model.safetensors of org/tiny arrived with bytes that differ"):
        check_fetched(snapshot, tmp_path)
    assert not (tmp_path / "model.safetensors").exists() and (tmp_path / "README.md").exists()


def test_ctrl_c_during_a_stalled_file_stops_at_once(hub: FakeHub, served_model: Path, tmp_path: Path):
    """Ctrl-C waited for huggingface_hub's pool to finish the files in flight (the read timeout on a stalled server,
    minutes of a large shard on a slow link): it looked hung. The download now runs in a thread Ctrl-C leaves."""
    shard = "model-00003-of-00003.safetensors"
    hub.hang_after[shard] = 100
    # no retry of the stalled file within the test's window (huggingface_hub's 10 s read timeout, then a resumed
    # GET that completes: a test process held up that long by a loaded machine saw a finished download)
    slow = {"HF_HUB_DOWNLOAD_TIMEOUT": "120"}
    process = run_cli(["--model-name", REPO_ID], tmp_path / "hf_home", hub.url, background=True, env_extra=slow)
    try:
        assert hub.hanging.wait(timeout=120), "the download never reached the stalled shard"
        started = time.monotonic()
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
        waited = time.monotonic() - started
    finally:
        process.kill()
        hub.release.set()
    assert process.returncode == 130 and "interrupted; rerun the same command to resume" in out, out + err
    assert waited < 20, f"{waited:.1f} s after Ctrl-C"  # without the thread: until the stall ends (60 s)
    assert "Traceback" not in err


@pytest.mark.slow
def test_force_download_repairs_a_corrupt_cached_file(hub: FakeHub, served_model: Path, tmp_path: Path, capsys):
    """A rerun skips files the cache already has, so a corrupt one needs --force-download (the error says so)."""
    hf_home = tmp_path / "hf_home"
    assert run_cli(["--model-name", REPO_ID], hf_home, hub.url).returncode == 0
    snapshot = snapshot_of(hf_home, hub)
    shard = snapshot / "model-00001-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])  # writes through the symlink into the blob

    assert md.main(["--verify-only", "--local-dir", str(snapshot)]) == 1
    assert "add --force-download" in capsys.readouterr().err
    repaired = run_cli(["--model-name", REPO_ID, "--force-download"], hf_home, hub.url)
    assert repaired.returncode == 0, repaired.stderr
    assert_same_files(snapshot, served_model)


def test_gated_repo_without_access_says_accept_the_licence(hub: FakeHub, served_model: Path, tmp_path: Path):
    """The hub answers 401 with X-Error-Code GatedRepo. (Downloads with a token: the two tests above.)"""
    hub.add_folder("org/gated", served_model, gated_token="hf_secret")
    for token_args in ([], ["--token", "hf_wrong"]):
        denied = run_cli(["--model-name", "org/gated", *token_args], tmp_path / "hf_home", hub.url)
        assert denied.returncode == 1
        assert "org/gated is gated: accept its licence" in denied.stderr and "--token" in denied.stderr
        assert "Traceback" not in denied.stderr
    assert not any(record.method == "GET" and "/resolve/" in record.path for record in hub.requests)


def test_missing_repository_and_revision_are_named(hub: FakeHub, tmp_path: Path):
    missing = run_cli(["--model-name", "org/nope"], tmp_path / "hf_home", hub.url)
    assert missing.returncode == 1
    assert "repository org/nope not found" in missing.stderr and "Traceback" not in missing.stderr

    bad_revision = run_cli(["--model-name", REPO_ID, "--revision", "v9"], tmp_path / "hf_home", hub.url)
    assert bad_revision.returncode == 1
    assert "revision 'v9' not found in org/tiny" in bad_revision.stderr


def test_no_network_says_to_copy_hf_home(tmp_path: Path):
    result = run_cli(["--model-name", REPO_ID], tmp_path / "hf_home", f"http://127.0.0.1:{closed_port()}")
    assert result.returncode == 1
    assert "cannot reach the hub" in result.stderr
    assert "copy HF_HOME from one that has internet" in result.stderr and "Traceback" not in result.stderr


def test_a_hub_that_accepts_and_never_answers_times_out(
    hub: FakeHub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys
):
    """A dead proxy: the connection is accepted and nothing comes back, at the first request or at the tree listing
    huggingface_hub makes inside the download. It waits for ever by default."""
    from huggingface_hub import constants

    import fsdp_lib.hub.download as download

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(download, "HUB_TIMEOUT_S", 0.5)
    monkeypatch.setattr(time, "sleep", lambda seconds: None)  # huggingface_hub's backoff between its 5 retries
    hub.stall_api = "/tree/"
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        for endpoint, message in (
            (f"http://127.0.0.1:{silent.getsockname()[1]}", "cannot reach the hub"),
            (hub.url, "the hub stopped answering while org/tiny was downloaded: "),  # was: "No such file ... index"
        ):
            monkeypatch.setattr(constants, "ENDPOINT", endpoint)
            started = time.monotonic()
            assert md.main(["--model-name", REPO_ID, "--local-dir", str(tmp_path / "m")]) == 1
            assert time.monotonic() - started < 60, endpoint
            assert message in capsys.readouterr().err
    assert any("/tree/" in record.path for record in hub.requests)  # the listing was asked for, and stalled


def test_a_local_dir_knows_its_repository_and_keeps_files_edited_since(
    hub: FakeHub, served_model: Path, tmp_path: Path, capsys
):
    """The folder's repository is noted before the first file is fetched, so a rerun knows it when verification
    never finished, and a --verify-only in between keeps it; a file edited since the download is not fetched over."""
    hub.add_folder("org/other", served_model)
    folder, hf_home = tmp_path / "model", tmp_path / "hf_home"
    download = ["--model-name", REPO_ID, "--local-dir", str(folder)]
    assert run_cli(download, hf_home, hub.url).returncode == 0
    (folder / VERIFICATION_RECORD).unlink()  # as a Ctrl-C during verification leaves it
    assert md.main(["--verify-only", "--local-dir", str(folder), "--checksums"]) == 0  # from huggingface_hub's notes
    assert f"checksums: {len(list(served_model.iterdir()))} file(s) match" in capsys.readouterr().out
    assert read_verification_record(folder)["source"]["model_name"] == REPO_ID  # was {"local_dir": ...}
    rerun = run_cli(download, hf_home, hub.url)
    assert rerun.returncode == 0, rerun.stderr  # was refused: "holds a model made with --init None"

    (folder / VERIFICATION_RECORD).unlink()
    other = run_cli(["--model-name", "org/other", "--local-dir", str(folder)], hf_home, hub.url)
    assert other.returncode == 1  # was accepted: two models' files in one folder
    assert f"holds {REPO_ID} (.cache/huggingface/model_download_source.json)" in other.stderr
    assert md.main(["--verify-only", "--local-dir", str(folder), "--model-name", "org/other"]) == 1
    assert f"holds {REPO_ID}, not --model-name org/other" in capsys.readouterr().err

    config = folder / "tokenizer_config.json"
    original = config.read_text()
    edited = original.replace("{", '{"chat_template": "MINE", ', 1)
    config.write_text(edited)
    os.utime(config, (time.time() + 5, time.time() + 5))  # past huggingface_hub's 1 s tolerance, however fast
    kept = run_cli(download, hf_home, hub.url)
    assert kept.returncode == 1
    assert "tokenizer_config.json changed since downloaded" in kept.stderr and "--force-download" in kept.stderr
    assert config.read_text() == edited
    config.write_text(original)  # as a copied folder has it: newer times, the hub's bytes
    os.utime(config, (time.time() + 5, time.time() + 5))
    assert run_cli(download, hf_home, hub.url).returncode == 0

    # a weight file cut short (an interrupted cp -p or rsync -t kept its time) is damage, not an edit: fetched again
    # (every rerun said the hub had stopped answering, or that the user had changed it)
    shard = folder / "model-00001-of-00003.safetensors"
    stamp = shard.stat()
    shard.write_bytes(shard.read_bytes()[:1000])
    os.utime(shard, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    repaired = run_cli(download, hf_home, hub.url)
    assert repaired.returncode == 0, repaired.stderr
    assert "model-00001-of-00003.safetensors: shorter than the hub's copy (cut short); fetched again" in repaired.stdout
    assert_same_files(folder, served_model)

    # a first download that fetched nothing (refused, interrupted at once) does not claim its folder
    from fsdp_lib.hub.download import check_download_target

    empty = tmp_path / "empty"
    (empty / ".cache" / "huggingface").mkdir(parents=True)
    (empty / ".cache" / "huggingface" / "model_download_source.json").write_text('{"model_name": "org/gated"}')
    check_download_target(empty, "org/other")


def test_download_refused_when_offline_mode_is_set(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert md.main(["--model-name", REPO_ID]) == 1
    assert "HF_HUB_OFFLINE" in capsys.readouterr().err


def test_verify_only_reports_a_model_missing_from_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert md.main(["--model-name", REPO_ID, "--verify-only"]) == 1
    assert "is not in the cache" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# offline verification of a folder
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def model_copy(served_model: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "copy"
    shutil.copytree(served_model, folder)
    return folder


def verify(folder: Path, capsys: pytest.CaptureFixture) -> tuple[int, str]:
    code = md.main(["--verify-only", "--local-dir", str(folder)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_verification_passes_an_intact_folder_and_records_it(model_copy: Path, capsys):
    code, output = verify(model_copy, capsys)
    assert code == 0, output
    record = read_verification_record(model_copy)
    assert record is not None and set(record["weight_files"]) == {p.name for p in model_copy.glob("*.safetensors")}
    assert "float32 (20 tensors)" in output  # lm_head.weight is tied to the embedding, not stored: still passes


def test_verification_catches_a_truncated_shard(model_copy: Path, capsys):
    shard = model_copy / "model-00002-of-00003.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    code, output = verify(model_copy, capsys)
    assert code == 1
    assert "model-00002-of-00003.safetensors" in output and "truncated" in output
    assert not (model_copy / VERIFICATION_RECORD).exists()


def test_verification_catches_a_missing_tensor(model_copy: Path, capsys):
    shard = model_copy / "model-00003-of-00003.safetensors"
    tensors = load_file(shard)
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    save_file(tensors, shard, metadata={"format": "pt"})
    code, output = verify(model_copy, capsys)
    assert code == 1
    assert "1 parameter(s) missing from the weight files" in output and dropped in output


def test_verification_catches_a_missing_shard_and_a_wrong_shape(model_copy: Path, capsys):
    (model_copy / "model-00001-of-00003.safetensors").unlink()
    shard = model_copy / "model-00002-of-00003.safetensors"
    tensors = load_file(shard)
    name = sorted(tensors)[0]
    tensors[name] = torch.zeros(3, 3)
    save_file(tensors, shard, metadata={"format": "pt"})
    code, output = verify(model_copy, capsys)
    assert code == 1
    assert "shard model-00001-of-00003.safetensors listed in model.safetensors.index.json is missing" in output
    assert f"{name} in model-00002-of-00003.safetensors: shape [3, 3]" in output


def test_a_single_weight_file_beside_an_index_is_two_models(model_copy: Path, capsys):
    """transformers loads model.safetensors before an index, this toolkit the index's shards: refused, not guessed."""
    shutil.copy(model_copy / "model-00001-of-00003.safetensors", model_copy / "model.safetensors")
    code, output = verify(model_copy, capsys)
    assert code == 1
    assert "holds both model.safetensors and model.safetensors.index.json (3 other files)" in output


def test_a_stale_record_is_removed_when_verification_fails(model_copy: Path, capsys):
    assert verify(model_copy, capsys)[0] == 0
    (model_copy / "model-00001-of-00003.safetensors").write_bytes(b"\0" * 8)
    assert read_verification_record(model_copy) is None  # sizes no longer match the record
    assert verify(model_copy, capsys)[0] == 1
    assert not (model_copy / VERIFICATION_RECORD).exists()


def test_verification_reads_pytorch_bin_weights(tiny_model: Path, tmp_path: Path, capsys):
    folder = tmp_path / "bin"
    shutil.copytree(tiny_model, folder)
    (folder / "model.safetensors").unlink()
    torch.save(load_file(tiny_model / "model.safetensors"), folder / "pytorch_model.bin")
    code, output = verify(folder, capsys)
    assert code == 0, output
    data = (folder / "pytorch_model.bin").read_bytes()
    (folder / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    code, output = verify(folder, capsys)
    assert code == 1 and "pytorch_model.bin: cannot read PyTorch weight file" in output


def test_untied_lm_head_must_be_stored():
    expected = {
        "model.embed_tokens.weight": ExpectedTensor((8, 4), True),
        "lm_head.weight": ExpectedTensor((8, 4), True),
        "model.rotary.cache": ExpectedTensor((2,), False),
    }
    found = {"model.embed_tokens.weight": TensorInfo((8, 4), "BF16", "model.safetensors")}
    tied = [["model.embed_tokens.weight", "lm_head.weight"]]
    assert compare_weights(expected, tied, found)[0] == []
    problems, notes = compare_weights(expected, [], found)
    assert problems == ["1 parameter(s) missing from the weight files: lm_head.weight"]
    assert "model.rotary.cache" in notes[0]  # a missing buffer is only a note


def test_base_model_weight_keys_gain_the_prefix_and_int_dtypes_fail():
    expected = {"transformer.wte.weight": ExpectedTensor((8, 4), True)}
    found = {"wte.weight": TensorInfo((8, 4), "F16", "model.safetensors")}
    assert compare_weights(expected, [], found, "transformer") == ([], [])
    quantized = {"wte.weight": TensorInfo((8, 4), "I8", "model.safetensors")}
    assert "not a float type" in compare_weights(expected, [], quantized, "transformer")[0][0]


def test_safetensors_header_with_trailing_bytes_or_garbage(tmp_path: Path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(4, 4)}, path)
    assert read_safetensors_header(path) == {"w": TensorInfo((4, 4), "F32", "model.safetensors")}
    path.write_bytes(path.read_bytes() + b"junk")
    with pytest.raises(ValueError, match="trailing bytes"):
        read_safetensors_header(path)
    path.write_bytes((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="truncated"):
        read_safetensors_header(path)


# ---------------------------------------------------------------------------------------------------------
# pure helpers
# ---------------------------------------------------------------------------------------------------------


def test_plan_prefers_safetensors_and_skips_subfolders():
    files = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "README.md",
             "model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
             "pytorch_model.bin.index.json", "pytorch_model-00001-of-00002.bin", "original/tokenizer.model",
             "consolidated.safetensors"]  # fmt: skip
    plan = plan_download(files)
    assert plan.weight_format == "safetensors" and plan.index_file == "model.safetensors.index.json"
    assert plan.metadata_files == [
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json"
    ]  # fmt: skip


def test_plan_falls_back_to_bin_and_refuses_repos_without_weights():
    plan = plan_download(["config.json", "pytorch_model.bin", "tokenizer.model", "model.gguf"])
    assert (plan.weight_format, plan.index_file, plan.weight_files) == ("bin", None, ["pytorch_model.bin"])
    assert plan.metadata_files == ["config.json", "tokenizer.model"]
    with pytest.raises(ToolError, match="no weights in safetensors or PyTorch .bin"):
        plan_download(["config.json", "model.gguf"])
    with pytest.raises(ToolError, match="no config.json"):
        plan_download(["model.safetensors"])


def test_glob_escape_matches_only_the_file_itself():
    pattern = glob_escape("weights[1]*.safetensors")
    assert fnmatch.fnmatch("weights[1]*.safetensors", pattern)
    assert not fnmatch.fnmatch("weights1x.safetensors", pattern)


def test_memory_plan_follows_the_stated_rule():
    rows = training_memory_plan(7_000_000_000, largest_unit_params=200_000_000)
    by_key = {(row["world_size"], row["cpu_offload"]): row for row in rows}
    assert sorted(by_key) == [(w, o) for w in (1, 2, 4, 8) for o in (False, True)]
    unit = 200_000_000 * 4  # bf16 weights + bf16 grads of the largest unit
    assert by_key[(1, False)]["gpu_total_bytes"] == 16 * 7_000_000_000 + unit
    assert by_key[(8, False)]["optimizer_bytes"] == 8 * 7_000_000_000 // 8
    assert by_key[(8, True)]["gpu_total_bytes"] == unit
    assert by_key[(8, True)]["cpu_bytes_per_gpu"] == 16 * 7_000_000_000 // 8
    assert "activations NOT included" in format_memory_plan(rows)


def test_hub_errors_map_to_actionable_messages():
    disk_full = OSError(errno.ENOSPC, "No space left on device")
    wrapped = RuntimeError("download failed")
    wrapped.__cause__ = disk_full
    assert "disk full" in explain_hub_error(wrapped, REPO_ID, "main")
    refused = ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
    assert "cannot reach the hub" in explain_hub_error(refused, REPO_ID, "main")
    assert explain_hub_error(ValueError("a bug"), REPO_ID, "main") is None
    # httpx's (huggingface_hub 2.x ships it as httpx2) other errors, by class name: a traceback before
    too_many = type("TooManyRedirects", (Exception,), {})("Exceeded maximum allowed redirects.")
    assert "with a redirect loop (TooManyRedirects: Exceeded maximum" in explain_hub_error(too_many, REPO_ID, "main")
    # a listed file gone (the repository changed during the download): named, with the fix (was "HTTP 404 ... (404
    # Client Error.)")
    from huggingface_hub.errors import RemoteEntryNotFoundError

    try:
        import httpx2  # huggingface_hub 2.x's HTTP client
    except ImportError:  # 1.x: httpx
        import httpx as httpx2

    request = httpx2.Request("GET", "http://hub/org/tiny/resolve/0123abc/model-00002-of-00003.safetensors")
    gone = RemoteEntryNotFoundError("404 Client Error.", response=httpx2.Response(404, request=request))
    assert explain_hub_error(gone, REPO_ID, "main") == (
        "org/tiny: model-00002-of-00003.safetensors was listed but is not there any more (HTTP 404): the repository "
        "changed during the download; rerun to fetch the new commit"
    )
    protocol = type("LocalProtocolError", (type("RequestError", (Exception,), {}),), {})("bad header")
    assert "talking to the hub failed for org/tiny (LocalProtocolError: bad header)" in explain_hub_error(
        protocol, REPO_ID, "main"
    )


def test_free_space_is_checked_before_downloading(tmp_path: Path):
    check_free_space(10_000_000_000, 20_000_000_000, tmp_path)
    with pytest.raises(ToolError, match="not enough disk space"):
        check_free_space(10_000_000_000, 10_050_000_000, tmp_path)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--init", "tiny", "--tokenizer-from", "d"], "--init needs --local-dir"),
        (["--init", "tiny", "--local-dir", "x"], "exactly one of --tokenizer-from"),
        (["--init", "tiny", "--local-dir", "x", "--tokenizer", "t", "--vocab-size", "500"], "--vocab-size applies"),
        (["--init", "tiny", "--local-dir", "x", "--tokenizer-from", "d", "--vocab-size", "100"], "below 259"),
        (["--model-name", "a/b", "--with-weights"], "--with-weights only applies with --init"),
        (["--model-name", "a/b", "--num-layers", "4"], "--num-layers only applies with --init"),
        (["--init", "tiny", "--local-dir", "x", "--tokenizer", "t", "--num-layers", "0"], "--num-layers 0 must be a"),
        (
            ["--init", "tiny", "--local-dir", "x", "--tokenizer", "t", "--intermediate-size", "-5"],
            "--intermediate-size",
        ),
        (
            ["--init", "tiny", "--local-dir", "x", "--tokenizer", "t", "--num-heads", "3", "--num-kv-heads", "1"],
            "--hidden-size 64 (preset tiny) is not divisible by --num-heads 3",
        ),
        (
            ["--init", "20M", "--local-dir", "x", "--tokenizer", "t", "--hidden-size", "500"],
            "--hidden-size 500 is not divisible by --num-heads 6 (preset 20M)",
        ),
        (
            ["--init", "125M", "--local-dir", "x", "--tokenizer", "t", "--num-heads", "12", "--num-kv-heads", "5"],
            "--num-heads 12 is not divisible by --num-kv-heads 5: grouped-query",
        ),
        (["--init", "tiny", "--local-dir", "x", "--tokenizer", "t", "--num-heads", "64"], "head size 1, which is odd"),
        (["--init", "tiny", "--local-dir", "x", "--tokenizer", "t", "--checksums"], "--init has none to compare"),
        (["--dataset", "org/sums", "--checksums"], "a --dataset download compares every file with the hub's checksums"),
        (["--verify-only", "--local-dir", "x", "--revision", "v1"], "checks that folder as it is; drop --revision"),
        ([], "pass --model-name"),
    ],
)
def test_flag_problems_exit_2_naming_the_flag(argv: list[str], message: str, capsys):
    assert md.main(argv) == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# --init: new models from size presets
# ---------------------------------------------------------------------------------------------------------

# Published counts with a 32000 vocabulary: Llama-2-7B, Llama-2-13B, LLaMA-33B, Llama-2-70B.
KNOWN_COUNTS = {"7B": 6_738_415_616, "13B": 13_015_864_320, "30B": 32_528_943_616, "70B": 68_976_648_192}


@pytest.mark.parametrize("size", list(SIZE_PRESETS))
def test_preset_shapes_and_parameter_counts(size: str):
    preset = SIZE_PRESETS[size]
    vocab = 32000
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**preset_config_kwargs(preset, vocab)))
    assert sum(p.numel() for p in model.parameters()) == preset_parameter_count(preset, vocab)
    layer = model.model.layers[0].self_attn
    head_dim = preset.hidden_size // preset.num_attention_heads
    assert len(model.model.layers) == preset.num_hidden_layers
    assert tuple(layer.q_proj.weight.shape) == (preset.hidden_size, preset.hidden_size)
    assert tuple(layer.k_proj.weight.shape) == (preset.num_key_value_heads * head_dim, preset.hidden_size)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == preset.tie_word_embeddings
    if size in KNOWN_COUNTS:
        assert preset_parameter_count(preset, vocab) == KNOWN_COUNTS[size]


# The counts stated in model_download.py's --init help and the README, with the default 32000 vocabulary.
STATED_COUNTS = {"20M": 21_730_176, "125M": 124_635_456}


def test_small_presets_match_the_stated_counts():
    for size, count in STATED_COUNTS.items():
        assert preset_parameter_count(SIZE_PRESETS[size], 32000) == count
        assert f"{size} {count:,}" in " ".join(md.build_parser().format_help().split())


def test_size_flags_override_the_preset_in_the_written_config(tiny_model: Path, tmp_path: Path, capsys):
    target = tmp_path / "custom"
    sizes = ["--num-layers", "3", "--hidden-size", "96", "--num-heads", "6", "--num-kv-heads", "3"]
    argv = ["--init", "tiny", "--tokenizer", str(tiny_model), "--local-dir", str(target), "--with-weights"]
    assert md.main([*argv, *sizes, "--intermediate-size", "200", "--dtype", "float32"]) == 0
    config = json.loads((target / "config.json").read_text())
    fields = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size")
    assert tuple(config[f] for f in fields) == (3, 96, 6, 3, 200)
    assert config["max_position_embeddings"] == SIZE_PRESETS["tiny"].max_position_embeddings, "the rest: preset's"
    model = AutoModelForCausalLM.from_pretrained(target, local_files_only=True)
    assert tuple(model.model.layers[0].self_attn.k_proj.weight.shape) == (3 * 16, 96)
    assert tuple(model.model.layers[0].mlp.up_proj.weight.shape) == (200, 96)
    assert "--init tiny --num-layers 3 --hidden-size 96" in capsys.readouterr().out


def test_bad_sizes_write_nothing(tiny_model: Path, tmp_path: Path, capsys):
    target = tmp_path / "bad"
    argv = ["--init", "125M", "--tokenizer", str(tiny_model), "--local-dir", str(target), "--num-kv-heads", "2"]
    assert md.main(argv) == 2
    err = capsys.readouterr().err
    assert "--num-heads 9 (preset 125M) is not divisible by --num-kv-heads 2" in err and "dividing 9" in err
    assert not list(tmp_path.iterdir())


def test_tiny_init_loads_offline_and_round_trips_text(tiny_model: Path):
    # every file as readable as config.json (save_pretrained's safetensors wrote the weights 0600)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tiny_model.iterdir() if p.is_file()}
    assert modes["model.safetensors"] == modes["config.json"], modes
    tokenizer = AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True)
    config = model.config
    assert config.vocab_size == len(tokenizer)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    )  # fmt: skip
    assert None not in (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert (config.hidden_size, config.num_hidden_layers, config.tie_word_embeddings) == (64, 2, True)
    for text in ROUNDTRIP_TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    ids = torch.tensor([tokenizer("The quick brown fox")["input_ids"]])
    assert model(ids).logits.shape == (1, ids.shape[1], len(tokenizer))
    assert (
        json.loads((tiny_model / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    )


def test_init_is_seeded_and_overwrite_is_explicit(corpus: Path, tiny_model: Path, tmp_path: Path, capsys):
    target = tmp_path / "again"
    argv = ["--init", "tiny", "--tokenizer-from", str(corpus), "--local-dir", str(target), "--with-weights"]
    assert md.main([*argv, "--dtype", "float32"]) == 0
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (target / name).read_bytes() == (tiny_model / name).read_bytes(), name

    assert md.main([*argv, "--dtype", "float32", "--seed", "1"]) == 1
    assert "is not empty; pass --overwrite" in capsys.readouterr().err
    assert md.main([*argv, "--dtype", "float32", "--seed", "1", "--overwrite"]) == 0
    assert (target / "model.safetensors").read_bytes() != (tiny_model / "model.safetensors").read_bytes()
    assert not list(tmp_path.glob(".again.init-incomplete"))
    # one --init per --local-dir at a time: a second one (its --overwrite too) is refused, the model kept
    before = {f.name: f.read_bytes() for f in target.iterdir()}
    held = FolderLock(tmp_path, ".again.init.lock", "", "", ToolError)
    with held.held():
        assert md.main([*argv, "--dtype", "float32", "--overwrite"]) == 1
        assert f"--local-dir {target} is in use by another run: host" in capsys.readouterr().err
    assert {f.name: f.read_bytes() for f in target.iterdir()} == before and not held.path.exists()


def test_local_dir_inside_an_experiment_or_a_dataset_is_refused(corpus: Path, tiny_model: Path, tmp_path, capsys):
    """An experiment's exported model (EXP/final) is the experiment's: --init --overwrite must not replace it with a
    fresh model; a model put inside a dataset folder would go with the dataset at data_hf.py's next --overwrite."""
    final = tmp_path / "outputs" / "exp" / "final"
    shutil.copytree(tiny_model, final)
    (final.parent / "checkpoint" / "step_00000004").mkdir(parents=True)
    trained = (final / "model.safetensors").read_bytes()
    argv = ["--init", "tiny", "--tokenizer", str(tiny_model), "--local-dir", str(final), "--overwrite"]
    assert md.main(argv) == 1
    err = capsys.readouterr().err
    assert f"--local-dir {final} is inside {final.parent}, a training experiment of fsdp_train.py" in err, err
    assert "give the model a folder of its own" in err and (final / "model.safetensors").read_bytes() == trained
    for argv in (
        ["--init", "tiny", "--tokenizer", str(tiny_model), "--local-dir", str(corpus / "model")],
        ["--model-name", "org/model", "--local-dir", str(corpus / "train" / "model")],
    ):
        assert md.main(argv) == 1
        assert ", a dataset (data_hf.py or save_to_disk)" in capsys.readouterr().err
    assert sorted(p.name for p in corpus.iterdir()) == ["dataset_dict.json", "test", "train"]


def test_overwrite_refuses_a_folder_that_is_not_a_model(corpus: Path, tmp_path: Path, capsys):
    target = tmp_path / "notes"
    target.mkdir()
    (target / "thesis.txt").write_text("precious")
    argv = ["--init", "tiny", "--tokenizer-from", str(corpus), "--local-dir", str(target), "--overwrite"]
    assert md.main(argv) == 1
    assert "does not look like a model folder" in capsys.readouterr().err
    assert (target / "thesis.txt").read_text() == "precious"
    (target / "config.json").write_text('{"port": 8080}')  # a project's config.json is not a model's
    assert md.main(argv) == 1
    assert "does not look like a model folder" in capsys.readouterr().err
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "thesis.txt"]


def test_overwrite_refuses_a_model_folder_that_holds_more_than_a_model(tiny_model: Path, tmp_path: Path, capsys):
    target = tmp_path / "model"
    shutil.copytree(tiny_model, target)
    (target / "ds").mkdir()
    (target / "ds" / "data.arrow").write_bytes(b"rows")  # e.g. the dataset its tokenizer was trained on
    (target / "run.log").write_text("mine")
    (target / "notes.txt").write_text("mine too")
    (target / "eval_results.json").write_text("{}")  # JSON by name: a model save writes no such file
    (target / "training_config.json").write_text("{}")  # ends in config.json, and is the user's
    (target / "eval_results.bin").write_bytes(b"mine")  # a .bin that is no PyTorch weights file
    (target / "original").mkdir()  # Meta's checkpoint folder holds weights and params.json, not a thesis
    (target / "original" / "params.json").write_text("{}")
    (target / "original" / "my_thesis.tex").write_text("mine")
    argv = ["--init", "tiny", "--tokenizer", str(tiny_model), "--local-dir", str(target), "--overwrite"]
    assert md.main(argv) == 1
    err = capsys.readouterr().err
    assert (
        "also holds ds/, eval_results.bin, eval_results.json, notes.txt, original/my_thesis.tex, run.log, "
        "training_config.json, which --overwrite would delete with it" in err
    ), err
    assert (target / "ds" / "data.arrow").read_bytes() == b"rows" and (target / "run.log").is_file()
    shutil.rmtree(target / "ds")
    for name in ("run.log", "notes.txt", "eval_results.json", "training_config.json", "eval_results.bin"):
        (target / name).unlink()
    (target / "original" / "my_thesis.tex").unlink()
    (target / "model.safetensors.index.json").write_text("{}")  # what a sharded save or a hub download holds
    (target / "quantize_config.json").write_text("{}")
    (target / "README.md").write_text("a model card")
    (target / ".model_download_incomplete").write_text("{}")  # an interrupted download's marker is no user file
    assert md.main(argv) == 0, capsys.readouterr().err


def test_init_without_weights_holds_config_and_tokenizer_only(corpus: Path, tmp_path: Path, capsys):
    target = tmp_path / "1b"
    argv = ["--init", "1B", "--tokenizer-from", str(corpus), "--vocab-size", "300", "--local-dir", str(target)]
    assert md.main(argv) == 0
    assert sorted(p.name for p in target.iterdir()) == [
        "config.json", "generation_config.json", VERIFICATION_RECORD, "tokenizer.json", "tokenizer_config.json"
    ]  # fmt: skip
    config = json.loads((target / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (16, 2048, 8)
    assert config["vocab_size"] == len(AutoTokenizer.from_pretrained(target, local_files_only=True)) <= 300
    capsys.readouterr()
    assert md.main(["--verify-only", "--local-dir", str(target)]) == 0  # weightless --init folders stay valid
    assert "no weights (the trainer initialises them)" in capsys.readouterr().out
    assert md.main(["--verify-only", "--local-dir", str(target), "--checksums"]) == 1
    assert "was made by --init, not downloaded; it has no hub checksums" in capsys.readouterr().err
    assert (target / VERIFICATION_RECORD).is_file()  # refused before verification: the record stays


def test_with_weights_refused_when_memory_is_short(corpus: Path, tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setattr(scratch, "available_memory_bytes", lambda: 50_000_000)
    target = tmp_path / "tiny"
    argv = ["--init", "tiny", "--tokenizer-from", str(corpus), "--local-dir", str(target), "--with-weights"]
    assert md.main(argv) == 1
    err = capsys.readouterr().err
    assert "--with-weights needs about 500.63 MB of memory" in err and "50.00 MB is available" in err
    assert not target.exists() and not list(tmp_path.iterdir())


def test_a_cpu_user_sees_no_import_noise_of_optional_packages(corpus: Path, tmp_path: Path, repo_root: Path):
    """transformers imports torchao whenever it is installed; its 'Failed to load ... .so' lines and torch's pytree
    deprecation warnings reached every model_download run, though model_download never uses torchao."""
    argv = ["--init", "tiny", "--tokenizer-from", str(corpus), "--local-dir", str(tmp_path / "m")]
    run = subprocess.run(
        [sys.executable, "model_download.py", *argv], cwd=repo_root, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    output = run.stdout + run.stderr
    assert "verified --init tiny" in output
    assert "Failed to load" not in output and "_pytree" not in output, output


def test_init_reuses_an_existing_tokenizer(tiny_model: Path, tmp_path: Path):
    target = tmp_path / "reused"
    assert md.main(["--init", "tiny", "--tokenizer", str(tiny_model), "--local-dir", str(target)]) == 0
    assert (target / "tokenizer.json").read_bytes() == (tiny_model / "tokenizer.json").read_bytes()
    assert (
        json.loads((target / "config.json").read_text())["vocab_size"]
        == json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    )


@pytest.mark.parametrize("kind", ["messages", "preference", "parts"])
def test_tokenizer_trains_on_the_turns_of_a_chat_or_preference_dataset(kind: str, tmp_path: Path):
    """--tokenizer-from a conversation or preference dataset: the BPE learns the turns' contents (it used to fail on
    the missing text column with a traceback), also given as a list of text parts, as the trainer reads them (a
    TypeError traceback)."""
    import datasets
    from transformers import AutoTokenizer

    def turns(i: int) -> list[dict]:
        said = [f"Quelle est la capitale {i}?", "Vesk"]
        if kind == "parts":  # an Arrow column holds one type: every content a list of parts
            said = [[{"type": "text", "text": text}] for text in said]
        return [{"role": "user", "content": said[0]}, {"role": "assistant", "content": said[1]}]

    columns = (
        {"messages": [turns(i) for i in range(40)]}
        if kind in ("messages", "parts")
        else {
            name: [turns(i)[:1] if name == "prompt" else turns(i)[1:] for i in range(40)] for name in PREFERENCE_COLUMNS
        }
    )
    path = tmp_path / "ds"
    datasets.Dataset.from_dict(columns).save_to_disk(str(path))
    target = tmp_path / "m"
    assert (
        md.main(["--init", "tiny", "--tokenizer-from", str(path), "--vocab-size", "300", "--local-dir", str(target)])
        == 0
    )
    tokenizer = AutoTokenizer.from_pretrained(target)
    assert len(tokenizer.tokenize("Quelle est la capitale")) < len(tokenizer.tokenize("Xqzw vjkp ry fgbnm"))


def test_tokenizer_dataset_problems_are_named(tmp_path: Path, capsys):
    import datasets

    path = tmp_path / "ds"
    datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(str(path))
    argv = ["--init", "tiny", "--tokenizer-from", str(path), "--local-dir", str(tmp_path / "m")]
    assert md.main(argv) == 1
    assert "--tokenizer-from" in (err := capsys.readouterr().err) and "no 'train' split" in err
    assert md.main([*argv[:3], str(tmp_path / "missing"), *argv[4:]]) == 1
    assert "--tokenizer-from" in (err := capsys.readouterr().err) and "does not exist" in err
    datasets.Dataset.from_dict({"text": ["", "", ""]}).save_to_disk(str(tmp_path / "blank"))
    assert md.main([*argv[:3], str(tmp_path / "blank"), *argv[4:]]) == 1  # was a bytes-only tokenizer and a note
    assert "its 3 rows hold no text (every one is empty)" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_verification_checks_moe_experts_after_transformers_conversion(tmp_path: Path, capsys):
    """Mixtral stores one tensor per expert (block_sparse_moe.experts.N.w1); transformers 5 stacks them into
    mlp.experts.gate_up_proj while loading. Verification converts the same way, so one missing expert is caught
    by the fused tensor's shape (an element count would not know which tensors belong together)."""
    from tests.fsdp_helpers import make_model

    folder = make_model(tmp_path / "mixtral", arch="mixtral", with_weights=True, tied=False)
    code, output = verify(folder, capsys)
    assert code == 0, output
    shard = folder / "model.safetensors"
    tensors = load_file(shard)
    del tensors["model.layers.1.block_sparse_moe.experts.3.w1.weight"]
    save_file(tensors, shard, metadata={"format": "pt"})
    code, output = verify(folder, capsys)
    assert code == 1
    assert "model.layers.1.mlp.experts.gate_up_proj: transformers cannot build it" in output, output


def test_tokenizer_from_an_empty_or_columnless_dataset_is_one_message(tmp_path: Path) -> None:
    """datasets saves a split without rows as no Arrow file and then fails on it with an IndexError; a dataset
    without a text column is told how to make one, not to pass a --text-column model_download.py does not have."""
    import datasets

    from fsdp_lib.hub.tokenizer import load_tokenizer_corpus

    datasets.Dataset.from_dict({"text": []}).save_to_disk(str(tmp_path / "empty"))
    with pytest.raises(ToolError, match="empty holds a split without rows, which datasets cannot load; create it"):
        load_tokenizer_corpus(tmp_path / "empty")
    datasets.Dataset.from_dict({"foo": ["a b c"]}).save_to_disk(str(tmp_path / "foo"))
    with pytest.raises(ToolError, match=r"columns \['foo'\] but no 'text'") as refused:
        load_tokenizer_corpus(tmp_path / "foo")
    assert "--text-column" not in str(refused.value) and "python data_hf.py" in str(refused.value)


def test_init_preset_names_are_read_in_any_case() -> None:
    assert md.build_parser().parse_args(["--init", "7b"]).init == "7B"
    assert md.build_parser().parse_args(["--init", "TINY"]).init == "tiny"
