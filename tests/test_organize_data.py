"""organize_data.py: balanced planning, nothing lost or duplicated, idempotent reruns, refusals, modes."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from datasets import load_from_disk

import data_hf
import organize_data
from fsdp_lib.organize.place import split_lock, temp_path_for
from fsdp_lib.organize.plan import (
    DEFAULT_EXTENSIONS,
    MANIFEST_NAME,
    TMP_SUFFIX,
    SourceFile,
    find_source_files,
    parse_extensions,
    plan_split,
    split_names,
)

# --------------------------------------------------------------------------------------------------------
# Fixtures and helpers
# --------------------------------------------------------------------------------------------------------


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        content = content.encode()
    path.write_bytes(content)
    return path


@pytest.fixture
def src(tmp_path: Path) -> Path:
    """A small raw tree: nested folders, same-named files, mixed sizes, hidden and non-matching files."""
    root = tmp_path / "raw"
    rng = random.Random(0)
    for index in range(23):
        folder = ["", "a", "a/deep", "b", "c"][index % 5]
        suffix = [".txt", ".md", ".json", ".jsonl", ".yaml", ".yml"][index % 6]
        write(root / folder / f"doc{index:02d}{suffix}", f"doc {index} " + "x" * rng.randint(0, 3000))
    write(root / "a" / "notes.txt", "notes from a")
    write(root / "b" / "notes.txt", "notes from b, longer")
    write(root / "c" / "notes.txt", "notes from c")
    write(root / ".hidden.txt", "hidden file")
    write(root / ".cache" / "inside_hidden_folder.txt", "hidden folder")
    write(root / "b" / "image.png", b"\x89PNG not text")
    return root


TEXT_EXTENSIONS = (".txt", ".md", ".json", ".jsonl", ".yaml", ".yml")


def expected_sources(root: Path) -> list[str]:
    """What organize_data.py must pick up by default: non-hidden text-like files, as relative paths."""
    names = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]
    return sorted(
        n for n in names if n.endswith(TEXT_EXTENSIONS) and not any(part.startswith(".") for part in n.split("/"))
    )


def run(capsys: pytest.CaptureFixture, *argv: str | Path) -> tuple[int, str, str]:
    code = organize_data.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def split_files(dst: Path) -> list[Path]:
    """Every file an organize run left under dst_root except the manifest."""
    return sorted(p for p in dst.rglob("*") if (p.is_file() or p.is_symlink()) and p.name != MANIFEST_NAME)


def content_hashes(paths: list[Path]) -> Counter:
    return Counter(hashlib.sha256(p.read_bytes()).hexdigest() for p in paths)


def snapshot(root: Path) -> dict[str, tuple]:
    """Everything a rerun could change: every path, its kind, content and mtime."""
    state = {}
    for path in sorted(root.rglob("*")):
        stat = path.lstat()
        content = (
            path.read_bytes()
            if path.is_file() and not path.is_symlink()
            else os.readlink(path)
            if path.is_symlink()
            else None
        )
        state[path.relative_to(root).as_posix()] = (stat.st_mode, stat.st_mtime_ns, content)
    return state


def manifest_of(dst: Path) -> dict:
    return json.loads((dst / MANIFEST_NAME).read_text())


# --------------------------------------------------------------------------------------------------------
# Pure logic
# --------------------------------------------------------------------------------------------------------


def random_files(count: int, seed: int) -> list[SourceFile]:
    rng = random.Random(seed)
    # Heavy-tailed sizes, as in real corpora: a few huge files among many small ones.
    return [SourceFile(f"f{i:04d}.txt", int(rng.paretovariate(1.2) * 100)) for i in range(count)]


@pytest.mark.parametrize("num_files, num_dirs", [(0, 3), (1, 5), (7, 7), (100, 20), (101, 20), (333, 7), (5, 1)])
def test_plan_split_by_count_is_balanced_and_complete(num_files: int, num_dirs: int) -> None:
    files = random_files(num_files, seed=num_files)
    plan = plan_split(files, num_dirs, "count")
    counts = [len(split) for split in plan]
    assert len(plan) == num_dirs
    assert max(counts) - min(counts) <= 1
    assigned = [f for split in plan for f in split]
    assert sorted(assigned, key=lambda f: f.rel_path) == sorted(files, key=lambda f: f.rel_path)
    for split in plan:
        assert split == sorted(split, key=lambda f: f.rel_path)


@pytest.mark.parametrize("seed", range(5))
def test_plan_split_by_bytes_stays_within_greedy_bound(seed: int) -> None:
    files = random_files(200, seed)
    num_dirs = 8
    plan = plan_split(files, num_dirs, "bytes")
    loads = [sum(f.num_bytes for f in split) for split in plan]
    total, largest = sum(f.num_bytes for f in files), max(f.num_bytes for f in files)
    assert sum(loads) == total
    assert max(loads) <= total / num_dirs + largest
    # Balancing bytes must not be worse on bytes than balancing counts.
    count_loads = [sum(f.num_bytes for f in split) for split in plan_split(files, num_dirs, "count")]
    assert max(loads) <= max(count_loads)


def test_plan_split_by_bytes_places_largest_first() -> None:
    # In path order a greedy rule would stack the big file on top of small ones (6 vs 2); largest-first gives 4/4.
    files = [SourceFile(name, size) for name, size in [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 4)]]
    loads = sorted(sum(f.num_bytes for f in split) for split in plan_split(files, 2, "bytes"))
    assert loads == [4, 4]
    # By count the files must split 3/2; the best then is the big file with one small one: 4+1 vs 1+1+1.
    by_count = plan_split(files, 2, "count")
    assert sorted((len(s), sum(f.num_bytes for f in s)) for s in by_count) == [(2, 5), (3, 3)]


def test_plan_split_is_deterministic_regardless_of_input_order() -> None:
    files = random_files(50, seed=3)
    shuffled = files[:]
    random.Random(1).shuffle(shuffled)
    assert plan_split(files, 6, "bytes") == plan_split(shuffled, 6, "bytes")
    assert plan_split(files, 6, "count") == plan_split(shuffled, 6, "count")


def test_split_names_pad_wider_past_100() -> None:
    assert split_names(20)[0] == "split_00" and split_names(20)[-1] == "split_19"
    assert split_names(100)[-1] == "split_99"
    names = split_names(101)
    assert names[0] == "split_000" and names[-1] == "split_100"
    assert names == sorted(names)


@pytest.mark.parametrize(
    "values, expected",
    [
        (["txt,md"], [".md", ".txt"]),
        ([".txt .md"], [".md", ".txt"]),
        ([".TXT", "md", "txt"], [".md", ".txt"]),
        (["jsonl, yaml"], [".jsonl", ".yaml"]),
    ],
)
def test_parse_extensions_accepts_commas_spaces_and_dots(values: list[str], expected: list[str]) -> None:
    assert parse_extensions(values) == expected


# --------------------------------------------------------------------------------------------------------
# Finding source files
# --------------------------------------------------------------------------------------------------------


def test_find_source_files_skips_hidden_and_other_extensions(src: Path) -> None:
    found = [f.rel_path for f in find_source_files(src, DEFAULT_EXTENSIONS).files]
    assert found == sorted(found)
    assert "a/notes.txt" in found and "b/notes.txt" in found and "a/deep/doc07.md" in found
    assert not any(part.startswith(".") for name in found for part in name.split("/"))
    assert "b/image.png" not in found
    assert len(found) == 26
    assert [f.rel_path for f in find_source_files(src, [".md"]).files] == [n for n in found if n.endswith(".md")]


def test_find_source_files_does_not_follow_a_symlink_loop(src: Path) -> None:
    (src / "a" / "loop").symlink_to(src, target_is_directory=True)  # a/loop -> raw: endless if followed
    (src / "linked_file.txt").symlink_to(src / "a" / "notes.txt")
    (src / "dangling.txt").symlink_to(src / "missing.txt")
    (src / "zero.txt").symlink_to("/dev/zero")  # leads somewhere, to no regular file: never read
    scan = find_source_files(src, [".txt"])
    names = [f.rel_path for f in scan.files]
    assert not any(name.startswith("a/loop/") for name in names)
    assert "linked_file.txt" in names  # a symlinked file is data
    assert any("a/loop" in s for s in scan.skipped)
    assert "dangling.txt (broken symlink)" in scan.skipped and "zero.txt (not a regular file)" in scan.skipped


def test_a_tool_s_folder_inside_src_dir_is_skipped_whole(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A model or dataset folder under --src-dir was spread over the splits (config.json here, tokenizer.json there):
    no split then looked like a model folder, and data_hf.py converted their metadata into text rows."""
    src = tmp_path / "proj"
    for i in range(6):
        write(src / "texts" / f"d{i}.txt", f"real document {i}\n")
    model = src / "models" / "tiny"
    write(model / "config.json", json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    write(model / "tokenizer.json", json.dumps({"model": {"vocab": {"hello": 0}}}))
    write(src / "data" / "ds" / "data_hf_summary.json", "{}")
    write(src / "data" / "ds" / "dataset_info.json", "{}")
    scan = find_source_files(src, [".txt", ".json"])
    assert [f.rel_path for f in scan.files] == [f"texts/d{i}.txt" for i in range(6)]
    assert any(s.startswith("models/tiny/ (a model folder") for s in scan.skipped), scan.skipped
    assert any(s.startswith("data/ds/ (a dataset") for s in scan.skipped), scan.skipped
    code, _, err = run(capsys, "--src-dir", src, "--dst-root", tmp_path / "splits", "--num-dirs", "3")
    assert code == 0 and "models/tiny/" in err
    assert data_hf.main(["--data_folder", str(tmp_path / "splits"), "--save_dir", str(tmp_path / "out")]) == 0
    rows = load_from_disk(str(tmp_path / "out"))["text"]
    assert sorted(rows) == sorted(f"real document {i}\n" for i in range(6)), rows


def test_split_copies_beside_their_source_are_read_once(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """organize_data.py --src-dir proj/raw --dst-root proj/splits, then data_hf.py (or organize_data.py) on proj:
    every file was read twice, from raw and from its copy, with no note."""
    proj = tmp_path / "proj"
    for i in range(4):
        write(proj / "raw" / f"d{i}.txt", f"doc {i}\n")
    code, _, _ = run(capsys, "--src-dir", proj / "raw", "--dst-root", proj / "splits", "--num-dirs", "2")
    assert code == 0
    assert data_hf.main(["--data_folder", str(proj), "--save_dir", str(tmp_path / "ds")]) == 0
    assert sorted(load_from_disk(str(tmp_path / "ds"))["text"]) == [f"doc {i}\n" for i in range(4)]
    assert "split folders of organize_data.py copying" in capsys.readouterr().out
    scan = find_source_files(proj, [".txt"])
    assert [f.rel_path for f in scan.files] == [f"raw/d{i}.txt" for i in range(4)]
    assert scan.skipped and scan.skipped[0].startswith("splits/ (split folders copying")
    # moved files are only in the splits: read there
    code, _, _ = run(capsys, "--src-dir", proj / "raw", "--dst-root", tmp_path / "moved", "--num-dirs", "2",
                     "--mode", "move")  # fmt: skip
    assert code == 0 and len(find_source_files(tmp_path, [".txt"]).files) == 8  # the copies and the moved files


# --------------------------------------------------------------------------------------------------------
# End to end
# --------------------------------------------------------------------------------------------------------


def test_split_loses_and_duplicates_nothing(src: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    dst = tmp_path / "splits"
    code, out, _ = run(capsys, "--src_dir", src, "--dst_root", dst, "--num_dirs", "4")
    assert code == 0
    sources = [src / name for name in expected_sources(src)]
    placed = split_files(dst)
    assert len(placed) == len(sources)
    assert content_hashes(placed) == content_hashes(sources)
    assert sorted(p.name for p in dst.iterdir()) == [MANIFEST_NAME, "split_00", "split_01", "split_02", "split_03"]
    # Same-named files from different folders both survive, under their relative paths.
    notes = sorted(p.relative_to(dst).as_posix().split("/", 1)[1] for p in placed if p.name == "notes.txt")
    assert notes == ["a/notes.txt", "b/notes.txt", "c/notes.txt"]
    manifest = manifest_of(dst)
    assert manifest["complete"] is True
    for dest, entry in manifest["files"].items():
        assert (dst / dest).read_bytes() == (src / entry["source"]).read_bytes()
        assert dest.split("/", 1)[1] == entry["source"]
    counts = [s["files"] for s in manifest["splits"].values()]
    assert max(counts) - min(counts) <= 1
    assert f"{len(sources)} files" in out and "4 splits" in out and "mode copy" in out


def test_balance_bytes_end_to_end(src: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    dst = tmp_path / "splits"
    assert run(capsys, "--src-dir", src, "--dst-root", dst, "--num-dirs", "3", "--balance", "bytes")[0] == 0
    loads = []
    for name in ["split_00", "split_01", "split_02"]:
        loads.append(sum(p.stat().st_size for p in (dst / name).rglob("*") if p.is_file()))
    sizes = [(src / n).stat().st_size for n in expected_sources(src)]
    assert max(loads) <= sum(sizes) / 3 + max(sizes)
    assert [s["bytes"] for s in manifest_of(dst)["splits"].values()] == loads


def test_rerun_changes_nothing(src: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    dst = tmp_path / "splits"
    argv = ("--src-dir", src, "--dst-root", dst, "--num-dirs", "5")
    assert run(capsys, *argv)[0] == 0
    before = snapshot(dst)
    code, out, _ = run(capsys, *argv)
    assert code == 0
    assert snapshot(dst) == before
    assert "0 placed" in out


def stop_placing_at(monkeypatch: pytest.MonkeyPatch, file_number: int, stop: Callable[[Path], None]) -> list[Path]:
    """Patch organize_data.place_file so that `stop(dest)` runs before the `file_number`-th file is placed (it
    raises, or signals this process); returns the destinations asked for. monkeypatch.undo() restores the real one."""
    real_place_file, calls = organize_data.place_file, []

    def place_file(source: Path, dest: Path, mode: str) -> None:
        calls.append(dest)
        if len(calls) == file_number:
            stop(dest)
        real_place_file(source, dest, mode)

    monkeypatch.setattr(organize_data, "place_file", place_file)
    return calls


def test_rerun_finishes_an_interrupted_run(
    src: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = tmp_path / "splits"
    argv = ("--src-dir", src, "--dst-root", dst, "--num-dirs", "3")

    def disk_full(dest: Path) -> None:
        # What a kill mid-copy leaves behind: a partial temp file, no file under the real name.
        write(temp_path_for(dest), b"partial")
        raise OSError(28, "No space left on device")

    calls = stop_placing_at(monkeypatch, 5, disk_full)
    code, _, err = run(capsys, *argv)
    assert code == 1 and "rerun the same command" in err
    assert manifest_of(dst)["complete"] is False
    assert len(split_files(dst)) == 5  # four finished files and the partial temp file
    assert not calls[4].exists()
    # data_hf.py does not convert the unfinished split as if it were whole, nor one of its folders at any depth
    deeper = next(dst.glob("split_*")) / "corpus" / "en"
    write(deeper / "doc.txt", "a file of a folder two levels inside the split\n")
    for folder in (dst, next(dst.glob("split_*")), deeper):
        assert data_hf.main(["--data_folder", str(folder), "--save_dir", str(tmp_path / "ds")]) == 1
        assert "organize_data.py has not finished these split folders" in capsys.readouterr().err
    shutil.rmtree(deeper.parent)
    assert not (tmp_path / "ds").exists()
    (tmp_path / "above").mkdir()
    (tmp_path / "above" / "notes.txt").write_text("text beside the split\n")
    os.symlink(dst, tmp_path / "above" / "splits")
    assert data_hf.main(["--data_folder", str(tmp_path / "above"), "--save_dir", str(tmp_path / "ds")]) == 0
    assert "has not finished; not read: rerun organize_data.py" in capsys.readouterr().out
    assert load_from_disk(str(tmp_path / "ds"))["text"] == ["text beside the split\n"]

    monkeypatch.undo()
    code, out, _ = run(capsys, *argv)
    assert code == 0
    assert "4 already in place" in out
    placed = split_files(dst)
    assert content_hashes(placed) == content_hashes([src / n for n in expected_sources(src)])
    assert not any(p.name.endswith(TMP_SUFFIX) for p in placed)
    assert manifest_of(dst)["complete"] is True
    assert data_hf.main(["--data_folder", str(dst), "--save_dir", str(tmp_path / "ds2")]) == 0


@pytest.mark.parametrize("signum, expected", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_or_sigterm_is_one_line_and_a_rerun_finishes(
    src: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    signum: int,
    expected: int,
    ctrl_c_raises: None,
) -> None:
    dst = tmp_path / "splits"
    argv = ("--src-dir", src, "--dst-root", dst, "--num-dirs", "3")
    # Ctrl-C is SIGINT to the process group; a scheduler sends SIGTERM
    stop_placing_at(monkeypatch, 3, lambda dest: os.kill(os.getpid(), signum))
    code, _, err = run(capsys, *argv)
    assert code == expected
    assert err.strip().splitlines() == [
        "organize_data.py: interrupted; the files placed so far are complete: rerun the same command to finish"
    ]
    monkeypatch.undo()
    code, out, _ = run(capsys, *argv)
    assert code == 0 and "2 already in place" in out
    assert manifest_of(dst)["complete"] is True


def test_file_names_in_any_encoding_are_split_and_rerun(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = tmp_path / "raw"
    src.mkdir()
    (Path(os.fsdecode(os.fsencode(src) + b"/caf\xe9.txt"))).write_bytes(b"Latin-1 name\n")  # not UTF-8
    write(src / "plain.txt", "plain\n")
    dst = tmp_path / "splits"
    code, out, err = run(capsys, "--src-dir", src, "--dst-root", dst, "--num-dirs", "2")
    assert code == 0, err
    assert sorted(os.fsencode(p.name) for p in split_files(dst)) == [b"caf\xe9.txt", b"plain.txt"]
    code, out, _ = run(capsys, "--src-dir", src, "--dst-root", dst, "--num-dirs", "2")
    assert code == 0 and "2 already in place" in out


def test_a_failed_copy_leaves_no_file_under_the_real_name(
    src: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def copy_half_then_fail(source: Path, target: Path) -> None:
        data = Path(source).read_bytes()
        Path(target).write_bytes(data[: len(data) // 2])
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(shutil, "copy2", copy_half_then_fail)
    code, _, err = run(capsys, "--src-dir", src, "--dst-root", tmp_path / "splits", "--num-dirs", "2")
    assert code == 1 and "Input/output error" in err
    assert split_files(tmp_path / "splits") == []  # nor the partial copy under its temporary name


def test_same_input_gives_identical_manifests(src: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for dst in ("one", "two"):
        assert run(capsys, "--src-dir", src, "--dst-root", tmp_path / dst, "--num-dirs", "4")[0] == 0
    assert (tmp_path / "one" / MANIFEST_NAME).read_bytes() == (tmp_path / "two" / MANIFEST_NAME).read_bytes()


def test_more_splits_than_files_creates_empty_folders(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write(tmp_path / "raw" / "only.txt", "one file")
    code, _, err = run(capsys, "--src-dir", tmp_path / "raw", "--dst-root", tmp_path / "out", "--num-dirs", "3")
    assert code == 0 and "2 split folders stay empty" in err
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.is_dir()) == ["split_00", "split_01", "split_02"]


def test_extensions_flag_limits_the_files(src: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    dst = tmp_path / "splits"
    assert run(capsys, "--src-dir", src, "--dst-root", dst, "--num-dirs", "2", "--extensions", "md,yml")[0] == 0
    assert {p.suffix for p in split_files(dst)} == {".md", ".yml"}


# --------------------------------------------------------------------------------------------------------
# Modes
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["copy", "link", "symlink", "move"])
def test_each_mode_places_every_file_and_reruns_as_a_no_op(
    mode: str, src: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    sources = {name: (src / name).read_bytes() for name in expected_sources(src)}
    dst = tmp_path / "splits"
    argv = ("--src-dir", src, "--dst-root", dst, "--num-dirs", "3", "--mode", mode)
    assert run(capsys, *argv)[0] == 0
    manifest = manifest_of(dst)
    assert sorted(entry["source"] for entry in manifest["files"].values()) == sorted(sources)
    for dest, entry in manifest["files"].items():
        placed, source = dst / dest, src / entry["source"]
        assert placed.read_bytes() == sources[entry["source"]]
        if mode == "copy":
            assert not placed.is_symlink() and not placed.samefile(source)
        elif mode == "link":
            assert not placed.is_symlink() and placed.samefile(source)
        elif mode == "symlink":
            assert placed.is_symlink() and placed.resolve() == source.resolve()
        else:
            assert not placed.is_symlink() and not source.exists()
    assert (src / ".hidden.txt").exists()  # never touched, even by --mode move
    before = snapshot(dst)
    code, out, _ = run(capsys, *argv)  # for move the sources are gone: the manifest makes this a no-op
    assert code == 0 and "0 placed" in out
    assert snapshot(dst) == before


def test_move_with_a_symlinked_file_keeps_both_contents(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = tmp_path / "raw"
    write(src / "a_target.txt", "the real file")
    (src / "z_link.txt").symlink_to(src / "a_target.txt")  # in path order the target moves first
    code, _, _ = run(capsys, "--src-dir", src, "--dst-root", tmp_path / "out", "--num-dirs", "1", "--mode", "move")
    assert code == 0
    placed = {p.name: p for p in split_files(tmp_path / "out")}
    assert placed["z_link.txt"].read_text() == placed["a_target.txt"].read_text() == "the real file"
    assert not placed["z_link.txt"].is_symlink()
    assert list(src.iterdir()) == []


def test_move_rerun_finishes_an_interrupted_move(
    src: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    sources = {name: (src / name).read_bytes() for name in expected_sources(src)}
    dst = tmp_path / "splits"
    argv = ("--src-dir", src, "--dst-root", dst, "--num-dirs", "3", "--mode", "move")

    def ctrl_c(dest: Path) -> None:
        raise KeyboardInterrupt

    stop_placing_at(monkeypatch, 7, ctrl_c)
    assert run(capsys, *argv)[0] == 130  # Ctrl-C: one line, no traceback
    assert len(expected_sources(src)) == len(sources) - 6
    monkeypatch.undo()
    assert run(capsys, *argv)[0] == 0
    manifest = manifest_of(dst)
    assert {entry["source"]: (dst / dest).read_bytes() for dest, entry in manifest["files"].items()} == sources
    assert expected_sources(src) == []


def test_after_a_move_a_rerun_with_other_flags_is_told_the_split_s_flags(
    src: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    dst = tmp_path / "the splits"  # a space: the quoted command still runs as it is
    assert run(capsys, "--src-dir", src, "--dst-root", dst, "--num-dirs", "3", "--mode", "move")[0] == 0
    code, _, err = run(capsys, "--src-dir", src, "--dst-root", dst, "--num-dirs", "2", "--mode", "move")
    assert code == 2 and "which moved its files out" in err, err
    quoted = err.split("that split's flags: ")[1].strip()
    assert "--num-dirs 3" in quoted and "--extensions .json .jsonl .md .txt .yaml .yml" in quoted, quoted
    assert run(capsys, *shlex.split(quoted))[0] == 0  # the quoted flags are the split's: nothing left to do


# --------------------------------------------------------------------------------------------------------
# Refusals and --overwrite
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make_args, flag",
    [
        (lambda src, tmp: ["--src-dir", src, "--dst-root", src / "splits"], "--dst-root"),
        (lambda src, tmp: ["--src-dir", src, "--dst-root", src], "--dst-root"),
        (lambda src, tmp: ["--src-dir", src / "a", "--dst-root", src], "--src-dir"),
        (lambda src, tmp: ["--src-dir", tmp / "nope", "--dst-root", tmp / "out"], "--src-dir"),
        (lambda src, tmp: ["--src-dir", src / "a" / "notes.txt", "--dst-root", tmp / "out"], "--src-dir"),
        (lambda src, tmp: ["--src-dir", src, "--dst-root", tmp / "out", "--num-dirs", "0"], "--num-dirs"),
        (lambda src, tmp: ["--src-dir", src, "--dst-root", tmp / "out", "--extensions", "csv"], "--extensions"),
        (lambda src, tmp: ["--src-dir", src, "--dst-root", tmp / "out", "--extensions", ","], "--extensions"),
        (lambda src, tmp: ["--src-dir", src / ".cache", "--dst-root", tmp / "out", "--extensions", "md"], "--src-dir"),
    ],
    ids=[
        "dst-in-src",
        "dst-is-src",
        "src-in-dst",
        "src-missing",
        "src-is-file",
        "zero-dirs",
        "no-match",
        "no-ext",
        "empty",
    ],
)
def test_refusals_name_the_flag_and_write_nothing(
    make_args, flag: str, src: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    before = snapshot(tmp_path)
    for overwrite in ([], ["--overwrite"]):  # --overwrite never turns these into a go
        code, _, err = run(capsys, *make_args(src, tmp_path), *overwrite)
        assert code == 2
        assert flag in err and "error" in err
    assert snapshot(tmp_path) == before


def test_refuses_a_different_earlier_split_unless_overwrite(
    src: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    dst = tmp_path / "splits"
    assert run(capsys, "--src-dir", src, "--dst-root", dst, "--num-dirs", "4")[0] == 0
    before = snapshot(dst)
    code, _, err = run(capsys, "--src-dir", src, "--dst-root", dst, "--num-dirs", "2")
    assert code == 2 and "--overwrite" in err and "--num-dirs 4" in err
    assert snapshot(dst) == before
    # A source file added since the split is a different plan too (the same flags would not keep it)
    write(src / "c" / "new.txt", "arrived later")
    code, _, err = run(capsys, "--src-dir", src, "--dst-root", dst, "--num-dirs", "4")
    assert code == 2 and "c/new.txt" in err and "--overwrite" in err
    assert "Restore --src-dir's files to keep it" in err and "earlier flags" not in err
    assert snapshot(dst) == before

    code, _, _ = run(capsys, "--src-dir", src, "--dst-root", dst, "--num-dirs", "2", "--overwrite")
    assert code == 0
    assert sorted(p.name for p in dst.iterdir()) == [MANIFEST_NAME, "split_00", "split_01"]
    assert content_hashes(split_files(dst)) == content_hashes([src / n for n in expected_sources(src)])
    assert manifest_of(dst)["settings"]["num_dirs"] == 2


def test_refuses_unrelated_files_unless_overwrite_and_keeps_them(
    src: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    dst = tmp_path / "splits"
    write(dst / "my_notes.txt", "not ours")
    code, _, err = run(capsys, "--src-dir", src, "--dst-root", dst)
    assert code == 2 and "--overwrite" in err and "my_notes.txt" in err
    assert sorted(p.name for p in dst.iterdir()) == ["my_notes.txt"]
    assert run(capsys, "--src-dir", src, "--dst-root", dst, "--num-dirs", "2", "--overwrite")[0] == 0
    assert (dst / "my_notes.txt").read_text() == "not ours"
    assert len(split_files(dst)) == len(expected_sources(src)) + 1
    assert run(capsys, "--src-dir", src, "--dst-root", dst, "--num-dirs", "2")[0] == 0  # now a plain rerun


def test_overwrite_never_deletes_split_folders_it_has_no_record_of(
    src: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    dst = tmp_path / "splits"
    write(dst / "split_00" / "precious.txt", "only copy")
    code, _, err = run(capsys, "--src-dir", src, "--dst-root", dst, "--overwrite")
    assert code == 2 and "split_00" in err
    assert (dst / "split_00" / "precious.txt").read_text() == "only copy"
    # beside a split whose manifest does not list it: kept too, on a rerun and on --overwrite of another plan
    (dst / "split_00").rename(dst / "split_05")
    argv = ("--src-dir", src, "--dst-root", dst)
    (dst / "split_05").rename(tmp_path / "aside")
    assert run(capsys, *argv, "--num-dirs", "2")[0] == 0
    (tmp_path / "aside").rename(dst / "split_05")
    (dst / "split_07").mkdir()  # an empty one is no problem
    for extra in (("--num-dirs", "2"), ("--num-dirs", "2", "--overwrite"), ("--num-dirs", "3", "--overwrite")):
        code, _, err = run(capsys, *argv, *extra)
        assert code == 2 and "split_05, which its .organize_manifest.json does not account for" in err, err
        assert "split_07" not in err and (dst / "split_05" / "precious.txt").read_text() == "only copy"
    assert manifest_of(dst)["settings"]["num_dirs"] == 2


def test_one_run_per_dst_root_at_a_time(src: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A second run while one writes --dst-root is refused (its --overwrite would delete the first one's files);
    a lock left by a killed run is taken over; a refused run leaves no empty --dst-root behind."""
    dst = tmp_path / "deep" / "splits"
    held = split_lock(dst)
    held.acquire()  # a live run (this process) writes there
    for extra in ((), ("--overwrite",), ("--dry-run",)):
        code, _, err = run(capsys, "--src-dir", src, "--dst-root", dst, *extra)
        assert code == 2 and f"--dst-root {dst} is in use by another run: host" in err, err
        assert "choose another --dst-root" in err and sorted(os.listdir(dst)) == [".organize.lock"]
    record = json.loads(held.path.read_text())
    held.release()
    held.path.write_text(json.dumps({**record, "pid": 2**22 + 12345, "process_start": "1"}))  # killed (-9)
    code, _, err = run(capsys, "--src-dir", src, "--dst-root", dst, "--num-dirs", "2")
    assert code == 0 and "taking over the lock of a run that is gone" in err
    assert sorted(os.listdir(dst)) == [MANIFEST_NAME, "split_00", "split_01"]  # the lock is gone with the run
    code, _, _ = run(capsys, "--src-dir", tmp_path / "empty", "--dst-root", tmp_path / "new" / "splits")
    assert code == 2 and not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()  # refused once the lock is held (no files): the folders it made are removed
    code, _, _ = run(capsys, "--src-dir", tmp_path / "empty", "--dst-root", tmp_path / "new" / "splits")
    assert code == 2 and not (tmp_path / "new").exists()


def test_a_finished_split_on_a_read_only_mount_reruns_without_its_lock(
    src: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fsdp_lib.lock import FolderLock

    dst = tmp_path / "splits"
    assert run(capsys, "--src-dir", src, "--dst-root", dst, "--num-dirs", "2")[0] == 0

    def read_only(self: FolderLock) -> None:
        raise PermissionError(30, "Read-only file system", str(self.path))

    monkeypatch.setattr(FolderLock, "acquire", read_only)
    code, out, _ = run(capsys, "--src-dir", src, "--dst-root", dst, "--num-dirs", "2")
    assert code == 0 and "0 placed" in out


def test_overwrite_never_deletes_a_moved_split(src: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    dst = tmp_path / "splits"
    assert run(capsys, "--src-dir", src, "--dst-root", dst, "--num-dirs", "3", "--mode", "move")[0] == 0
    before = snapshot(dst)
    other_plan = ("--src-dir", src, "--dst-root", dst, "--num-dirs", "2", "--mode", "move", "--overwrite")
    code, _, err = run(capsys, *other_plan)  # --src-dir is empty now: refused, and told why
    assert code == 2 and "--mode move" in err
    write(src / "late.txt", "arrived after the move")
    code, _, err = run(capsys, *other_plan[:-1])  # without --overwrite: not told to pass it, as it would not help
    assert code == 2 and "Rerun with the earlier flags" in err and "--overwrite" not in err, err
    code, _, err = run(capsys, *other_plan)
    assert code == 2 and "--mode move" in err and "only copies" in err
    assert snapshot(dst) == before


def test_stray_file_in_a_split_is_refused_never_deleted(
    src: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A file the user put into a split folder is theirs: a rerun refuses it (it would be read as data), and so does
    --overwrite, of the same plan or of another one, which deletes only the files a split placed."""
    dst = tmp_path / "splits"
    argv = ("--src-dir", src, "--dst-root", dst)
    assert run(capsys, *argv, "--num-dirs", "2")[0] == 0
    write(dst / "split_01" / "dropped_in.txt", "my only copy")
    before = snapshot(dst)
    for extra in (("--num-dirs", "2"), ("--num-dirs", "2", "--overwrite"), ("--num-dirs", "3", "--overwrite")):
        code, _, err = run(capsys, *argv, *extra)
        assert code == 2 and "split_01/dropped_in.txt" in err and "Move them out" in err, (extra, err)
        assert snapshot(dst) == before
    (dst / "split_01" / "dropped_in.txt").rename(tmp_path / "kept.txt")
    assert run(capsys, *argv, "--num-dirs", "3", "--overwrite")[0] == 0
    assert content_hashes(split_files(dst)) == content_hashes([src / n for n in expected_sources(src)])


def test_dry_run_prints_the_plan_and_writes_nothing(src: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    dst = tmp_path / "splits"
    code, out, _ = run(capsys, "--src-dir", src, "--dst-root", dst, "--num-dirs", "3", "--dry-run")
    assert code == 0 and not dst.exists()
    total = len(expected_sources(src))
    lines = [line.split() for line in out.splitlines() if line.strip().startswith("split_")]
    assert [line[0] for line in lines] == ["split_00", "split_01", "split_02"]
    assert sum(int(line[1]) for line in lines) == total
    assert "nothing written" in out
    # Over an existing, different split: shows what --overwrite would delete, still writes nothing.
    assert run(capsys, "--src-dir", src, "--dst-root", dst, "--num-dirs", "3")[0] == 0
    before = snapshot(dst)
    code, out, _ = run(capsys, "--src-dir", src, "--dst-root", dst, "--num-dirs", "2", "--overwrite", "--dry-run")
    assert code == 0 and "would delete" in out and "split_02" in out
    assert snapshot(dst) == before


def test_imports_no_torch(repo_root: Path) -> None:
    code = f"import sys; sys.path.insert(0, {str(repo_root)!r}); import organize_data; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_unusable_dst_root_is_an_error_not_a_traceback(
    src: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    write(tmp_path / "a_file", "in the way")
    code, _, err = run(capsys, "--src-dir", src, "--dst-root", tmp_path / "a_file" / "splits")
    assert code == 1 and "Not a directory" in err and "rerun" in err


def test_no_permission_while_placing_is_one_message(
    src: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def denied(source: Path, dest: Path, mode: str) -> None:
        raise PermissionError(13, "Permission denied", str(dest))

    monkeypatch.setattr(organize_data, "place_file", denied)
    code, _, err = run(capsys, "--src-dir", src, "--dst-root", tmp_path / "splits", "--num-dirs", "3")
    assert code != 0
    assert err.count("error:") == 1 and "Permission denied" in err and "Traceback" not in err
    # an --overwrite that cannot delete the earlier split: the folder is named whole (rmtree names the file alone)
    monkeypatch.undo()
    assert run(capsys, "--src-dir", src, "--dst-root", tmp_path / "other", "--num-dirs", "3")[0] == 0

    def undeletable(path: Path) -> None:
        raise PermissionError(13, "Permission denied", "x")

    monkeypatch.setattr(organize_data, "remove_path", undeletable)
    code, _, err = run(capsys, "--src-dir", src, "--dst-root", tmp_path / "other", "--num-dirs", "2", "--overwrite")
    assert code == 1 and f"could not delete {tmp_path / 'other' / 'split_00'} (Permission denied: x)" in err, err
    assert manifest_of(tmp_path / "other")["complete"] is False  # the earlier split no longer says it is whole
