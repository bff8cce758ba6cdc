"""Hub datasets offline: `model_download.py --dataset ORG/NAME` against the fake hub, then `fsdp_train.py -d ORG/NAME`
from the HF_HOME cache with the network off (conftest.py sets HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1)."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hub_server import FakeHub
from test_model_download import run_cli

import model_download as md
from fsdp_lib.records.dataset import load_text_dataset
from tests.fsdp_helpers import arithmetic_documents, losses_by_step, make_model, output_of, run_trainer

DOCS = arithmetic_documents(160)


def parquet_bytes(columns: dict[str, list]) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(pa.table(columns), buffer)
    return buffer.getvalue()


def jsonl_bytes(rows: list[dict]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


CONVERSATION = [{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": "3"}]
DATASETS = {
    # text + an extra column, train and validation as the hub's parquet conversion names them
    "org/sums": {
        "README.md": b"# sums\n",
        "data/train-00000-of-00001.parquet": parquet_bytes({"text": DOCS[:-16], "id": list(range(len(DOCS) - 16))}),
        "data/validation-00000-of-00001.parquet": parquet_bytes({"text": DOCS[-16:], "id": list(range(16))}),
    },
    # the text under another name, and a test split instead of validation
    "org/bodies": {
        "train.jsonl": jsonl_bytes([{"body": doc, "title": f"t{i}"} for i, doc in enumerate(DOCS[:-16])]),
        "test.jsonl": jsonl_bytes([{"body": doc, "title": "v"} for doc in DOCS[-16:]]),
    },
    # conversations
    "org/chats": {"train.jsonl": jsonl_bytes([{"messages": CONVERSATION}] * 8)},
}


@pytest.fixture(scope="module")
def hub() -> Iterator[FakeHub]:
    fake = FakeHub()
    for repo_id, files in DATASETS.items():
        fake.add_dataset(repo_id, files)
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def hf_home(hub: FakeHub, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF_HOME holding every served dataset, each fetched with model_download.py --dataset."""
    home = tmp_path_factory.mktemp("hf_home")
    for repo_id in DATASETS:
        result = run_cli(["--dataset", repo_id], home, hub.url)
        assert result.returncode == 0, result.stdout + result.stderr
    return home


@pytest.fixture
def offline_cache(hf_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process reads hf_home's hub cache (huggingface_hub read HF_HOME at import)."""
    import datasets.config
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    return hf_home


# ---------------------------------------------------------------------------------------------------------
# model_download.py --dataset
# ---------------------------------------------------------------------------------------------------------


def test_download_reports_splits_rows_and_columns(hub: FakeHub, tmp_path: Path):
    result = run_cli(["--dataset", "org/sums"], tmp_path, hub.url)
    assert result.returncode == 0, result.stderr
    assert "loads with HF_DATASETS_OFFLINE=1" in result.stdout
    assert "train: 144 rows, columns text, id" in result.stdout
    assert "validation: 16 rows, columns text, id" in result.stdout
    snapshot = tmp_path / "hub" / "datasets--org--sums" / "snapshots" / hub.repos["datasets/org/sums"].commit
    assert (snapshot / "data" / "train-00000-of-00001.parquet").is_file()
    assert "checksums: " in result.stdout and not (snapshot / ".model_download_incomplete").exists()
    # a rerun fetches nothing again: every file is complete in the cache
    gets = len(hub.file_gets("train-00000-of-00001.parquet"))
    assert run_cli(["--dataset", "org/sums"], tmp_path, hub.url).returncode == 0
    assert len(hub.file_gets("train-00000-of-00001.parquet")) == gets


def test_download_notes_a_dataset_without_a_text_column(hf_home: Path, hub: FakeHub):
    result = run_cli(["--dataset", "org/bodies"], hf_home, hub.url)
    assert result.returncode == 0, result.stderr
    assert "test: 16 rows, columns body, title" in result.stdout
    assert "--text-column NAME" in result.stdout


def test_download_of_a_missing_dataset_names_the_flag(hub: FakeHub, tmp_path: Path):
    result = run_cli(["--dataset", "org/missing"], tmp_path, hub.url)
    assert result.returncode == 1
    assert "repository org/missing not found" in result.stderr and "--dataset" in result.stderr


def test_download_that_does_not_load_offline_is_an_error(hub: FakeHub, tmp_path: Path):
    hub.add_dataset("org/broken", {"train.parquet": b"not a parquet file"})
    result = run_cli(["--dataset", "org/broken"], tmp_path, hub.url)
    assert result.returncode == 1
    assert "--dataset org/broken: downloaded, but it does not load offline" in result.stderr


def test_dataset_flag_conflicts(capsys: pytest.CaptureFixture):
    assert md.main(["--dataset", "org/sums", "--model-name", "org/tiny"]) == 2
    assert md.main(["--dataset", "not-a-hub-id"]) == 2
    err = capsys.readouterr().err
    assert "--dataset downloads a dataset" in err and "expected a hub id ORG/NAME" in err


# ---------------------------------------------------------------------------------------------------------
# data_hf.load_text_dataset on a hub id, offline
# ---------------------------------------------------------------------------------------------------------


def test_load_text_dataset_reads_a_cached_hub_dataset(offline_cache: Path):
    train, validation = load_text_dataset("org/sums")
    assert train["text"] == DOCS[:-16] and validation is not None and validation["text"] == DOCS[-16:]
    # --text-column: the named column becomes the text; the test split stands in for a missing validation
    train, validation = load_text_dataset("org/bodies", "body")
    assert train["text"] == DOCS[:-16] and validation is not None and validation["text"] == DOCS[-16:]
    train, validation = load_text_dataset("org/chats")
    assert train["messages"][0] == CONVERSATION and validation is None


def test_an_unfinished_dataset_download_is_refused(offline_cache: Path, hub: FakeHub):
    """A --dataset download killed between shards left a snapshot whose fetched shards loaded: the run trained on
    part of the data without a word. The marker the download keeps until it is checked says so, with the fix."""
    snapshot = offline_cache / "hub" / "datasets--org--sums" / "snapshots" / hub.repos["datasets/org/sums"].commit
    marker = snapshot / ".model_download_incomplete"
    marker.write_text('{"command": "python model_download.py --dataset org/sums"}')
    try:
        with pytest.raises(ValueError, match=r"hub dataset org/sums: its download did not finish .*finish it with: "
                           "python model_download.py --dataset org/sums"):  # fmt: skip
            load_text_dataset("org/sums")
    finally:
        marker.unlink()
    assert load_text_dataset("org/sums")[0] is not None


def test_load_text_dataset_errors(offline_cache: Path):
    with pytest.raises(ValueError, match="--text-column title2: hub dataset org/bodies has no column 'title2'"):
        load_text_dataset("org/bodies", "title2")
    with pytest.raises(ValueError, match="no 'text' or 'messages' column, nor 'prompt', 'chosen' and 'rejected'"):
        load_text_dataset("org/bodies")
    with pytest.raises(ValueError, match=r"not in the local cache .*`python model_download.py --dataset org/nope`"):
        load_text_dataset("org/nope")


def test_known_shapes_without_the_trainer_s_columns_are_named_with_the_conversion(tmp_path: Path):
    """Pairs without a prompt column (Anthropic HH) and question/answer prompts were told to pass --text-column,
    which would train one of their columns as plain text."""
    import datasets

    shapes = {
        "hh": ({"chosen": ["\n\nHuman: Hi\n\nAssistant: Hello."], "rejected": ["\n\nHuman: Hi\n\nAssistant: Go."]},
               "preference pairs without a 'prompt' column (an implicit prompt, as in Anthropic HH)"),
        "gsm8k": ({"question": ["What is 2+2?"], "answer": ["4"]}, "prompts (or exchanges) under another name"),
        "orca": ({"system": [""], "question": ["2+2?"], "chosen": ["4"], "rejected": ["5"]}, "prompt is in 'question'"),
    }  # fmt: skip
    for name, (columns, what) in shapes.items():
        datasets.Dataset.from_dict(columns).save_to_disk(str(tmp_path / name))
        with pytest.raises(ValueError, match="convert them with: python data_hf.py") as refused:
            load_text_dataset(str(tmp_path / name), column_flag=True)
        assert what in str(refused.value) and "--text-column" not in str(refused.value)


# ---------------------------------------------------------------------------------------------------------
# fsdp_train.py -d ORG/NAME, offline
# ---------------------------------------------------------------------------------------------------------


def train_flags(save: Path, model: Path, dataset: str, *extra: str) -> list[str]:
    return [
        *["-e", "run", "-d", dataset, "-m", str(model), "--save-dir", str(save)],
        *["--seq-length", "32", "--lr", "3e-3", "--precision", "fp32", "--log-freq", "1", "--max-steps", "3"],
        *["-b", "2", *extra],
    ]


@pytest.mark.slow
def test_trainer_runs_offline_on_a_cached_hub_dataset(hf_home: Path, tmp_path: Path, capsys):
    model = make_model(tmp_path / "model")
    env = {
        "HF_HOME": str(hf_home),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_ENDPOINT": "http://0.0.0.0:9",
    }
    flags = train_flags(tmp_path / "out", model, "org/bodies", "--text-column", "body", "--ckpt-freq", "3")
    proc = run_trainer(flags, nproc=1, env=env)  # the offline cache and its fingerprint: one process
    assert proc.returncode == 0, output_of(proc)
    assert sorted(losses_by_step(tmp_path / "out" / "run")) == [1, 2, 3]
    # the same hub dataset has the same fingerprint in a new run: the checkpoint resumes
    resumed = run_trainer([*flags, "--max-steps", "5"], nproc=1, env=env)
    assert resumed.returncode == 0, output_of(resumed)
    assert "at step 3" in output_of(resumed)
    assert sorted(losses_by_step(tmp_path / "out" / "run")) == [1, 2, 3, 4, 5]

    # a hub dataset not in the cache: refused before any process group (in this process: no launch needed)
    import fsdp_train

    assert fsdp_train.main(train_flags(tmp_path / "out2", model, "org/nope")) == 2
    out = capsys.readouterr().out
    assert "-d hub dataset org/nope is not in the local cache" in out
    assert "python model_download.py --dataset org/nope" in out
    assert not (tmp_path / "out2").exists()

    bad_column = run_trainer(train_flags(tmp_path / "out3", model, "org/sums", "--text-column", "body"), 1, env)
    assert bad_column.returncode != 0
    assert "--text-column body: hub dataset org/sums has no column 'body'" in output_of(bad_column)
