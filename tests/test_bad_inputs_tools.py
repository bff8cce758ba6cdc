"""Bad input to organize_data.py and model_download.py, as a careless user gives it: each case ends in a message naming
the flag (or the folder) and the fix with a non-zero exit, or in the handling the docs describe (exit 0), and every
byte that existed before is still there afterwards. Every case runs the tool's main() in-process and stops before any
download (the tests run with HF_HUB_OFFLINE=1) or any tokenizer training. tests/test_bad_inputs.py holds the cases
that cross tools and the trainer's."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import organize_data
from tests.bad_inputs import Case, check_refused, make_model_folder, make_user_folders, model_download_case
from tests.bad_inputs import organize_case as organize


def odd_source(root: Path) -> Path:
    """Raw files beside a broken link, a symlinked folder that loops and a named pipe: outside `root`, whose snapshot
    reads every file (a pipe would block it)."""
    return root.with_name(root.name + "_odd")


def links_of(root: Path) -> Path:
    """A link that loops and one to nowhere: beside the odd source, which cases read whole."""
    return root.with_name(root.name + "_links")


def make_tool_folders(root: Path) -> Path:
    """The folders these two tools meet besides the shared ones: a finished split and damaged copies of it, an empty
    source, models model_download.py left (a download, an --init, a partial download) and a config that is not JSON."""
    (root / "empty_src").mkdir()
    assert (
        organize_data.main(["--src-dir", str(root / "raw"), "--dst-root", str(root / "real_splits"), "--num-dirs", "2"])
        == 0
    )
    manifest = json.loads((root / "real_splits" / ".organize_manifest.json").read_text())
    for name, changed in (
        ("future_manifest", {**manifest, "format": 7}),
        (
            "ghost_manifest",
            {**manifest, "files": {**manifest["files"], "split_01/gone.txt": {"source": "gone.txt", "bytes": 5}}},
        ),
    ):
        shutil.copytree(root / "real_splits", root / name)
        (root / name / ".organize_manifest.json").write_text(json.dumps(changed))
    shutil.copytree(root / "real_splits", root / "bad_manifest")
    (root / "bad_manifest" / ".organize_manifest.json").write_text('{"format": 1, "files": ')
    for name, source in (("other_download", {"model_name": "org/other"}), ("init_model", {"init": "tiny", "seed": 0})):
        make_model_folder(root / name)
        (root / name / ".cache" / "huggingface").mkdir(parents=True)
        (root / name / "model_download_verified.json").write_text(json.dumps({"source": source, "weight_files": {}}))
    shutil.copytree(root / "cut_weights", root / "partial", ignore=shutil.ignore_patterns("*.safetensors"))
    (root / "partial" / ".cache" / "huggingface" / "download").mkdir(parents=True)
    (root / "partial" / ".cache" / "huggingface" / "download" / "model.safetensors.1f2e.incomplete").write_bytes(
        b"\0" * 64
    )
    shutil.copytree(root / "cut_weights", root / "bad_config")
    (root / "bad_config" / "config.json").write_text('{"model_type": "llama",')
    odd = odd_source(root)
    (odd / "sub").mkdir(parents=True)
    (odd / "a.txt").write_text("some text\n")
    (odd / "sub" / "loop").symlink_to("..")
    (odd / "broken.txt").symlink_to("nowhere.txt")
    os.mkfifo(odd / "pipe.txt")
    links = links_of(root)
    links.mkdir()
    (links / "loop").symlink_to("loop")
    (links / "dangling").symlink_to("nowhere")
    return root


R = "--src-dir"  # the flags every organize case passes
D = "--dst-root"

ORGANIZE_CASES = [
    organize(
        "--src-dir that does not exist",
        lambda r: [R, r / "rawtext", D, r / "new"],
        "--src-dir",
        "does not exist",
        "point --src-dir at the folder with your raw files",
    ),
    organize(
        "--src-dir a link that loops",
        lambda r: [R, links_of(r) / "loop", D, r / "new"],
        "--src-dir",
        "is a symbolic link that leads back to itself",
        "fix the link, or pass another path",
    ),
    organize(
        "--dst-root a link that loops",
        lambda r: [R, r / "raw", D, links_of(r) / "loop"],
        "--dst-root",
        "is a symbolic link that leads back to itself",
    ),
    organize(
        "--dst-root under a link that loops",
        lambda r: [R, r / "raw", D, links_of(r) / "loop" / "new"],
        "--dst-root",
        "is under",
        "a symbolic link that leads back to itself",
    ),
    organize(
        "--dst-root a link to nowhere",
        lambda r: [R, r / "raw", D, links_of(r) / "dangling"],
        "--dst-root",
        "nowhere, which does not exist",
    ),
    organize(
        "--src-dir a file",
        lambda r: [R, r / "latin1_prompts.txt", D, r / "new"],
        "is not a folder",
        "point --src-dir at",
    ),
    organize(
        "--src-dir an empty folder",
        lambda r: [R, r / "empty_src", D, r / "new"],
        "holds no files ending in",
        "choose other endings with --extensions",
    ),
    organize(
        "--src-dir empty (an unset shell variable)",
        lambda r: [R, "", D, r / "new"],
        "--src-dir: is empty; pass a folder path",
    ),
    organize("--dst-root empty", lambda r: [R, r / "raw", D, " "], "--dst-root: is empty; pass a folder path"),
    organize(
        "--src-dir a dataset",
        lambda r: [R, r / "dataset", D, r / "new"],
        "--src-dir",
        "is a dataset",
        "not raw files; point --src-dir at the folder with them",
    ),
    organize(
        "--src-dir an experiment",
        lambda r: [R, r / "outputs" / "exp", D, r / "new"],
        "a training experiment of fsdp_train.py",
        "not raw files",
    ),
    organize(
        "--dst-root equal to --src-dir",
        lambda r: [R, r / "raw", D, r / "raw"],
        "is the same folder as --src-dir; choose a separate --dst-root",
    ),
    organize(
        "--dst-root inside --src-dir",
        lambda r: [R, r / "raw", D, r / "raw" / "splits"],
        "is inside --src-dir",
        "choose a --dst-root outside --src-dir",
    ),
    organize(
        "--dst-root that contains --src-dir",
        lambda r: [R, r / "raw", D, r],
        "choose a --dst-root that does not contain it",
    ),
    organize(
        "--dst-root an existing file",
        lambda r: [R, r / "raw", D, r / "latin1_prompts.txt"],
        "--dst-root",
        "is a file; choose a folder path for --dst-root",
    ),
    organize(
        "--dst-root under a file",
        lambda r: [R, r / "raw", D, r / "latin1_prompts.txt" / "splits"],
        "--dst-root",
        "which is a file (Not a directory); choose a folder path for --dst-root",
        exit_code=1,
    ),
    organize(
        "--dst-root under a file, dry run",
        lambda r: [R, r / "raw", D, r / "latin1_prompts.txt" / "s", "--dry-run"],
        "which is a file",
        exit_code=1,
    ),
    organize(
        "--dst-root holding the user's own files",
        lambda r: [R, r / "raw", D, r / "bad_chat"],
        "is not empty and has no .organize_manifest.json",
        "choose an empty or new --dst-root",
    ),
    organize(
        "--dst-root an experiment, --overwrite",
        lambda r: [R, r / "raw", D, r / "outputs" / "exp", "--overwrite"],
        "--dst-root",
        "a training experiment",
        "even with --overwrite: choose another --dst-root",
    ),
    organize(
        "--dst-root a dataset", lambda r: [R, r / "raw", D, r / "dataset"], "is a dataset", "choose another --dst-root"
    ),
    organize(
        "--dst-root a model folder, --overwrite",
        lambda r: [R, r / "raw", D, r / "model", "--overwrite"],
        "is a model folder (config.json)",
        "choose another --dst-root",
    ),
    organize(
        "rerun with another --num-dirs",
        lambda r: [R, r / "raw", D, r / "real_splits", "--num-dirs", "3"],
        "it used --num-dirs 2 (this run: 3)",
        "pass --overwrite to replace it",
    ),
    organize(
        "rerun with --mode move onto a copy",
        lambda r: [R, r / "raw", D, r / "real_splits", "--num-dirs", "2", "--mode", "move"],
        "it used --mode copy (this run: move)",
    ),
    organize(
        "rerun with --balance bytes",
        lambda r: [R, r / "raw", D, r / "real_splits", "--num-dirs", "2", "--balance", "bytes"],
        "it used --balance count (this run: bytes)",
    ),
    organize(
        "--num-dirs abc",
        lambda r: [R, r / "raw", D, r / "new", "--num-dirs", "abc"],
        "argument --num_dirs/--num-dirs: invalid int value: 'abc'",
    ),
    organize(
        "--num-dirs 1e3",
        lambda r: [R, r / "raw", D, r / "new", "--num-dirs", "1e3"],
        "--num-dirs: invalid int value: '1e3'",
    ),
    organize(
        "--num-dirs -3",
        lambda r: [R, r / "raw", D, r / "new", "--num-dirs", "-3"],
        "--num-dirs must be between 1 and 10,000 (got -3)",
    ),
    organize(
        "--num-dirs 10001",
        lambda r: [R, r / "raw", D, r / "new", "--num-dirs", "10001"],
        "--num-dirs must be between 1 and 10,000 (got 10,001)",
    ),
    organize(
        "--balance size",
        lambda r: [R, r / "raw", D, r / "new", "--balance", "size"],
        "argument --balance: invalid choice: 'size' (choose from",
    ),
    organize(
        "--mode hardlink",
        lambda r: [R, r / "raw", D, r / "new", "--mode", "hardlink"],
        "argument --mode: invalid choice: 'hardlink'",
    ),
    organize(
        "an unknown flag (--strategy)",
        lambda r: [R, r / "raw", D, r / "new", "--strategy", "random"],
        "unrecognized arguments: --strategy random",
    ),
    organize(
        "--extensions of commas only",
        lambda r: [R, r / "raw", D, r / "new", "--extensions", ","],
        "--extensions ',' names no extension; use e.g. --extensions txt,md,json",
    ),
    organize(
        "--extensions as a shell pattern",
        lambda r: [R, r / "raw", D, r / "new", "--extensions", "*.txt"],
        "--extensions '*.txt' is not a file ending (no wildcards or paths); use e.g. --extensions txt,md",
    ),
    organize(
        "--extensions no file has",
        lambda r: [R, r / "raw", D, r / "new", "--extensions", "pdf"],
        "holds no files ending in .pdf",
        "--extensions",
    ),
    organize(
        "--dst-root left out", lambda r: [R, r / "raw"], "the following arguments are required: --dst_root/--dst-root"
    ),
    organize(
        "a manifest that is not JSON",
        lambda r: [R, r / "raw", D, r / "bad_manifest", "--num-dirs", "2"],
        "--dst-root",
        ".organize_manifest.json is not a manifest",
        "choose another --dst-root",
    ),
    organize(
        "a manifest that is not JSON, --overwrite",
        lambda r: [R, r / "raw", D, r / "bad_manifest", "--overwrite"],
        "is not a manifest this version of organize_data.py can read",
    ),
    organize(
        "a manifest of another format",
        lambda r: [R, r / "raw", D, r / "future_manifest", "--num-dirs", "2"],
        "its manifest format is 7, this version writes 1",
    ),
    organize(
        "a manifest listing a file gone from --src-dir",
        lambda r: [R, r / "raw", D, r / "ghost_manifest", "--num-dirs", "2"],
        "1 file(s) gone from --src-dir since: gone.txt",
        "pass --overwrite",
    ),
    # documented handling: exit 0
    organize(
        "the same command again",
        lambda r: [R, r / "raw", D, r / "real_splits", "--num-dirs", "2"],
        "0 placed, 1 already in place",
        exit_code=0,
    ),
    organize(
        "--overwrite with another --num-dirs, dry run",
        lambda r: [R, r / "raw", D, r / "real_splits", "--num-dirs", "3", "--overwrite", "--dry-run"],
        "would delete",
        "nothing written",
        exit_code=0,
    ),
    organize(
        "links, a loop and a pipe in --src-dir, dry run",
        lambda r: [R, odd_source(r), D, r / "new", "--num-dirs", "2", "--dry-run"],
        "broken.txt (broken symlink)",
        "pipe.txt (not a regular file)",
        "sub/loop/ (symlinked folder, not followed)",
        exit_code=0,
    ),
    organize(
        "fewer files than --num-dirs",
        lambda r: [R, r / "raw", D, r / "new", "--num-dirs", "3"],
        "only 1 files for 3 splits; 2 split folders stay empty",
        exit_code=0,
        creates=("new",),
    ),
]

INIT, T, L = "--init", "--tokenizer-from", "--local-dir"  # the flags of a new model
M = "--model-name"


def init(r: Path, *more: object) -> list:
    return [INIT, "tiny", T, r / "dataset", L, r / "new_model", *more]


MODEL_DOWNLOAD_CASES = [
    model_download_case(
        "--model-name empty", lambda r: [M, ""], "--model-name is empty; pass a hub id such as", exit_code=2
    ),
    model_download_case(
        "--model-name with spaces",
        lambda r: [M, "Qwen 2.5 0.5B"],
        "--model-name 'Qwen 2.5 0.5B': expected a hub id ORG/NAME",
        exit_code=2,
    ),
    model_download_case(
        "--model-name a/b/c", lambda r: [M, "Qwen/Qwen2.5/0.5B"], "expected a hub id ORG/NAME or NAME", exit_code=2
    ),
    model_download_case(
        "--model-name a URL",
        lambda r: [M, "https://huggingface.co/Qwen/Qwen2.5-0.5B"],
        "is a URL; pass the hub id",
        "(--model-name Qwen/Qwen2.5-0.5B)",
        exit_code=2,
    ),
    model_download_case(
        "--model-name a local path that does not exist",
        lambda r: [M, "./models/qwen"],
        "looks like a local path and does not exist",
        exit_code=2,
    ),
    model_download_case(
        "--model-name a local model folder",
        lambda r: [M, r / "model"],
        "is a local path",
        "train with fsdp_train.py -m",
        "--verify-only --local-dir",
        exit_code=2,
    ),
    model_download_case(
        "--dataset a local dataset folder",
        lambda r: ["--dataset", r / "dataset"],
        "is a local path; --dataset takes a hub id. A dataset folder needs no download",
        "train on it with fsdp_train.py -d",
        exit_code=2,
    ),
    model_download_case(
        "no --model-name and no --init",
        lambda r: [L, r / "new_model"],
        "pass --model-name NAME (download)",
        "or --init SIZE",
        exit_code=2,
    ),
    model_download_case(
        "--model-name with --init",
        lambda r: init(r, M, "org/name"),
        "--init creates a new model: drop --model-name",
        exit_code=2,
    ),
    model_download_case(
        "--overwrite without --init",
        lambda r: [M, "org/name", "--overwrite"],
        "--overwrite only applies with --init SIZE",
        exit_code=2,
    ),
    model_download_case(
        "--init with an unknown preset",
        lambda r: [INIT, "huge", T, r / "dataset", L, r / "m"],
        "argument --init: invalid choice: 'huge'",
        exit_code=2,
    ),
    model_download_case(
        "--init with both tokenizer flags",
        lambda r: init(r, "--tokenizer", r / "model"),
        "exactly one of --tokenizer-from DATASET",
        exit_code=2,
    ),
    model_download_case(
        "--dtype int8", lambda r: init(r, "--dtype", "int8"), "argument --dtype: invalid choice: 'int8'", exit_code=2
    ),
    model_download_case(
        "--dtype and --seed without --with-weights (they did nothing)",
        lambda r: init(r, "--dtype", "float32", "--seed", "0"),
        "--dtype and --seed apply to --with-weights only",
        "drop them, or add --with-weights",
        exit_code=2,
    ),
    model_download_case(
        "download flags with --init",
        lambda r: init(r, "--revision", "dev", "--force-download"),
        "--revision, --force-download apply to downloads only; --init fetches nothing",
        exit_code=2,
    ),
    model_download_case(
        "--seed with a download",
        lambda r: [M, "org/name", "--seed", "1"],
        "--seed only applies with --init SIZE --with-weights",
        exit_code=2,
    ),
    model_download_case(
        "--force-download with --verify-only",
        lambda r: [M, "org/name", "--verify-only", "--force-download"],
        "--force-download fetches every file again, --verify-only fetches nothing",
        exit_code=2,
    ),
    model_download_case(
        "--vocab-size 0", lambda r: init(r, "--vocab-size", "0"), "--vocab-size 0 is below 259", exit_code=2
    ),
    model_download_case(
        "--vocab-size abc",
        lambda r: init(r, "--vocab-size", "abc"),
        "argument --vocab-size: invalid int value: 'abc'",
        exit_code=2,
    ),
    model_download_case(
        "--vocab-size a hundred million",
        lambda r: init(r, "--vocab-size", "100000000"),
        "--vocab-size 100,000,000 is above 1,048,576",
        exit_code=2,
    ),
    model_download_case(
        "--num-layers a hundred million",
        lambda r: init(r, "--num-layers", "100000000"),
        "--num-layers 100,000,000 is above 1,024",
        exit_code=2,
    ),
    model_download_case(
        "--seed beyond 64 bits",
        lambda r: init(r, "--seed", str(10**23), "--with-weights"),
        "--seed 100000000000000000000000 must be between 0 and 4,294,967,295",
        exit_code=2,
    ),
    model_download_case(
        "--revision empty",
        lambda r: [M, "org/name", "--revision", ""],
        "--revision '' is not a branch, tag or commit hash",
        exit_code=2,
    ),
    model_download_case(
        "--revision with spaces",
        lambda r: [M, "org/name", "--revision", "main branch"],
        "--revision 'main branch'",
        "leave it out for main",
        exit_code=2,
    ),
    model_download_case(
        "--dataset without an org",
        lambda r: ["--dataset", "wikitext"],
        "--dataset 'wikitext': expected a hub id ORG/NAME",
        exit_code=2,
    ),
    model_download_case(
        "--dataset a URL",
        lambda r: ["--dataset", "https://huggingface.co/datasets/org/corpus"],
        "(--dataset org/corpus)",
        exit_code=2,
    ),
    model_download_case(
        "--dataset with --local-dir",
        lambda r: ["--dataset", "org/corpus", L, r / "d"],
        "drop --model-name/--init/--verify-only/--local-dir",
        exit_code=2,
    ),
    model_download_case(
        "--tokenizer-from an empty folder",
        lambda r: [INIT, "tiny", T, r / "empty_src", L, r / "m"],
        "--tokenizer-from",
        "is not a saved dataset",
        "python data_hf.py",
    ),
    model_download_case(
        "--tokenizer-from the user's raw files",
        lambda r: [INIT, "tiny", T, r / "raw", L, r / "m"],
        "is not a saved dataset",
        "convert them first (python data_hf.py --data_folder",
        "--save_dir <a new folder>) and pass that folder",
    ),
    model_download_case(
        "--tokenizer-from a model folder",
        lambda r: [INIT, "tiny", T, r / "model", L, r / "m"],
        "is a model folder",
        "to reuse its tokenizer pass --tokenizer",
    ),
    model_download_case(
        "--tokenizer-from a missing path",
        lambda r: [INIT, "tiny", T, r / "corpus", L, r / "m"],
        "--tokenizer-from",
        "does not exist",
    ),
    model_download_case(
        "--tokenizer-from an experiment",
        lambda r: [INIT, "tiny", T, r / "outputs" / "exp", L, r / "m"],
        "a training experiment",
        "not a dataset: pass a folder data_hf.py wrote",
    ),
    model_download_case(
        "--tokenizer a dataset",
        lambda r: [INIT, "tiny", "--tokenizer", r / "dataset", L, r / "m"],
        "--tokenizer",
        "is a dataset",
        "pass --tokenizer-from",
    ),
    model_download_case(
        "--tokenizer a hub id not in the cache",
        lambda r: [INIT, "tiny", "--tokenizer", "org/never-fetched", L, r / "m"],
        "--tokenizer org/never-fetched does not load offline",
        "a hub id already in the cache",
    ),
    model_download_case(
        "--tokenizer whose tokenizer.json is not JSON",
        lambda r: [INIT, "tiny", "--tokenizer", r / "bad_tokenizer", L, r / "m"],
        "--tokenizer",
        "does not load offline",
    ),
    model_download_case(
        "--init into an existing file",
        lambda r: [INIT, "tiny", T, r / "dataset", L, r / "latin1_prompts.txt"],
        "is a file; choose a folder path for --local-dir",
    ),
    model_download_case(
        "--init under a file",
        lambda r: [INIT, "tiny", T, r / "dataset", L, r / "latin1_prompts.txt" / "m"],
        "which is a file; choose a folder path",
    ),
    model_download_case(
        "--init onto a model without --overwrite",
        lambda r: [INIT, "tiny", T, r / "dataset", L, r / "model"],
        "is not empty; pass --overwrite to replace the model in it",
    ),
    model_download_case(
        "--init --overwrite onto split folders",
        lambda r: [INIT, "tiny", T, r / "dataset", L, r / "real_splits", "--overwrite"],
        "split folders of organize_data.py",
        "--overwrite replaces only a model folder",
    ),
    model_download_case(
        "--init --overwrite onto the user's raw files",
        lambda r: [INIT, "tiny", T, r / "dataset", L, r / "raw", "--overwrite"],
        "does not look like a model folder (no config.json with a model type",
    ),
    model_download_case(
        "download into an experiment",
        lambda r: [M, "org/name", L, r / "outputs" / "exp"],
        "--local-dir",
        "a training experiment",
        "choose a new --local-dir",
    ),
    model_download_case(
        "download into a dataset",
        lambda r: [M, "org/name", L, r / "dataset"],
        "is a dataset",
        "choose a new --local-dir",
    ),
    model_download_case(
        "download into another model's download",
        lambda r: [M, "org/name", L, r / "other_download"],
        "holds org/other",
        "would mix two models' files",
    ),
    model_download_case(
        "download into an --init model",
        lambda r: [M, "org/name", L, r / "init_model"],
        "holds a model made with --init tiny",
    ),
    model_download_case(
        "download into a folder of the user's files",
        lambda r: [M, "org/name", L, r / "raw"],
        "holds no earlier download by model_download.py",
        "choose a new or empty --local-dir",
    ),
    model_download_case(
        "download under a file",
        lambda r: [M, "org/name", L, r / "latin1_prompts.txt" / "m"],
        "which is a file; choose a folder path",
    ),
    model_download_case(
        "download while offline",
        lambda r: [M, "org/name"],
        "HF_HUB_OFFLINE",
        "this machine is offline",
        "copy HF_HOME from one that has internet",
    ),
    model_download_case(
        "resume a partial download while offline",
        lambda r: [M, "org/name", L, r / "partial"],
        "this machine is offline",
    ),
    model_download_case(
        "--dataset while offline",
        lambda r: ["--dataset", "org/corpus"],
        "org/corpus cannot be downloaded: this machine is offline",
    ),
    model_download_case(
        "--verify-only of a model never downloaded",
        lambda r: [M, "org/never-fetched", "--verify-only"],
        "is not in the cache",
        "where there is internet",
    ),
    model_download_case(
        "--verify-only of a folder that does not exist",
        lambda r: ["--verify-only", L, r / "models"],
        "--local-dir",
        "does not exist",
    ),
    model_download_case(
        "--verify-only of a dataset",
        lambda r: ["--verify-only", L, r / "dataset"],
        "is a dataset",
        "not a model; pass the folder of a model",
    ),
    model_download_case(
        "--verify-only with config.json not JSON",
        lambda r: ["--verify-only", L, r / "bad_config"],
        "config.json' is not a valid JSON file",
        "fix: rerun the download",
    ),
    model_download_case(
        "--verify-only of a partial download",
        lambda r: ["--verify-only", L, r / "partial"],
        "no weight files",
        "fix: rerun the download",
    ),
    model_download_case(
        "--verify-only of a truncated safetensors",
        lambda r: ["--verify-only", L, r / "cut_weights"],
        "model.safetensors",
        "truncated",
        "--force-download",
    ),
    model_download_case(
        "--verify-only of a config with a smaller vocabulary",
        lambda r: ["--verify-only", L, r / "small_vocab"],
        "the architecture needs [249, 32]",
    ),
]

CASES = ORGANIZE_CASES + MODEL_DOWNLOAD_CASES


@pytest.fixture(scope="module")
def user_folders(tmp_path_factory, inputs) -> Path:
    return make_tool_folders(make_user_folders(tmp_path_factory.mktemp("user"), inputs[1]))


def test_the_table_is_large_and_its_names_unique() -> None:
    assert len(ORGANIZE_CASES) >= 20 and len(MODEL_DOWNLOAD_CASES) >= 25
    assert len({case.name for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_refused_by_name_or_handled_as_documented(case: Case, user_folders: Path, capsys) -> None:
    check_refused(case, user_folders, capsys)
