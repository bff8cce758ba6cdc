"""Tests for data_hf.py: extraction of every file kind, bad input, long texts, the CLI end to end, determinism,
the validation split, --strict, overwriting and atomicity under kill -9."""

from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from itertools import islice
from pathlib import Path

import pytest
import yaml
from datasets import Dataset, DatasetDict, Features, Value, load_from_disk

import data_hf
from data_hf import main
from fsdp_lib.convert import reading, workers
from fsdp_lib.convert.planning import find_input_files, plan_tasks
from fsdp_lib.convert.publish import OLD_TAG, SUMMARY_NAME, TMP_TAG, clean_stale_temporaries
from fsdp_lib.convert.reading import piece_bytes_for, read_file
from fsdp_lib.convert.results import REASONS, FileResult
from fsdp_lib.convert.streaming import iter_json_values
from fsdp_lib.convert.workers import assign_split
from fsdp_lib.convert.writer import SplitWriter, arrow_type
from fsdp_lib.records.conversation import ToolTurn, conversation_json, parse_conversation
from fsdp_lib.records.dataset import load_text_dataset
from fsdp_lib.records.reasons import BadRecord
from fsdp_lib.records.text import extract_strings, split_long_text
from fsdp_lib.records.tool_calls import TURN_FIELDS


def write_files(root: Path, files: dict[str, str | bytes]) -> Path:
    for relative, content in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
    return root


def convert(data: Path, out: Path, *extra: str) -> int:
    workers = [] if "--num-proc" in extra else ["--num-proc", "1"]  # a flag given twice is refused
    return main(["--data_folder", str(data), "--save_dir", str(out), *workers, *extra])


def rows_of(out: Path) -> list[str]:
    return list(load_from_disk(str(out))["text"])


def summary_of(out: Path) -> dict:
    return json.loads((out / SUMMARY_NAME).read_text())


def reasons(result: FileResult) -> list[str]:
    return [problem.reason for problem in result.problems]


# --- Extraction ---------------------------------------------------------------------------------------------


def test_extract_strings_walks_values_in_document_order_and_skips_keys_numbers_bools() -> None:
    value = {"title": "a", "n": 3, "ok": True, "none": None, "nested": {"list": ["b", 1.5, {"deep": "c"}], "k": "d"}}
    assert list(extract_strings(value)) == ["a", "b", "c", "d"]


def test_extract_strings_handles_nesting_deeper_than_the_recursion_limit() -> None:
    value: object = "bottom"
    for depth in range(sys.getrecursionlimit() * 20):
        value = [value] if depth % 2 else {"k": value}
    assert list(extract_strings(value)) == ["bottom"]


def test_extract_strings_track_shared_ends_self_reference_and_alias_bombs() -> None:
    loop: list[object] = ["x"]
    loop.append(loop)
    # islice: a walker that loops or expands every alias fails here instead of hanging
    assert list(islice(extract_strings(loop, track_shared=True), 5)) == ["x"]
    bomb: list[object] = ["lol"]
    for _ in range(40):  # 2**40 strings if every alias were expanded
        bomb = [bomb, bomb]
    assert list(islice(extract_strings(bomb, track_shared=True), 5)) == ["lol"]


def test_json_file_gives_every_string_value(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    path.write_text(json.dumps([{"q": "question", "a": ["ans1", {"more": "ans2"}], "score": 1}, "top"], indent=2))
    result = read_file(path)
    assert result.rows == ["question", "ans1", "ans2", "top"]
    assert result.problems == [] and result.skipped_reason is None


def test_json_stream_parser_matches_json_loads_across_any_chunk_boundary() -> None:
    document = {
        "a": [1, -2.5e3, "x y", {"b": ["\u00e9\ud83d\ude00", True, None, '\\"quoted\\"']}],
        "long": "z" * 50,
        "n": 1234567890,
    }
    text = json.dumps([document, "s", 42, [], {}, document], indent=1)
    expected = json.loads(text)
    for size in (1, 2, 7, 64):
        chunks = iter([text[i : i + size] for i in range(0, len(text), size)])
        assert list(iter_json_values(lambda _n, chunks=chunks: next(chunks, ""))) == expected


def test_jsonl_bad_line_is_skipped_and_counted_not_the_file(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text('{"t": "one"}\n{"t": broken\n\n{"t": "three", "n": 3}\n')
    result = read_file(path)
    assert result.rows == ["one", "three"]
    assert [(p.reason, p.line) for p in result.problems] == [("invalid_jsonl_line", 2)]
    assert result.skipped_reason is None


def test_yaml_multi_document_with_anchors_aliases_and_merge_keys(tmp_path: Path) -> None:
    path = tmp_path / "a.yaml"
    path.write_text(
        "base: &base\n  greeting: hello\n  items: [one, two]\nprod:\n  <<: *base\n  name: production\n"
        "again: *base\nquote: &q repeated\nquote2: *q\n---\n- second doc\n- 7\n---\nthird doc\n"
    )
    result = read_file(path)
    # The alias `again: *base` points at the mapping already read: its strings come once. The merge key copies
    # the values into a new mapping, and an alias to a plain string repeats it.
    assert result.rows == [
        "hello", "one", "two", "hello", "production", "repeated", "repeated", "second doc", "third doc",
    ]  # fmt: skip
    assert result.problems == []


def test_unsafe_yaml_tag_never_executes(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    data = write_files(
        tmp_path / "data",
        {
            "evil.yaml": f'!!python/object/apply:os.system ["touch {marker}"]\n',
            "evil2.yml": f"---\nok: fine\n---\n!!python/object/new:subprocess.Popen [[touch, {marker}]]\n",
            "good.txt": "good text",
        },
    )
    assert read_file(data / "evil.yaml").skipped_reason == "yaml_unsupported_tag"
    second = read_file(data / "evil2.yml")
    assert second.rows == ["fine"] and reasons(second) == ["yaml_unsupported_tag"]
    assert convert(data, tmp_path / "out") == 0
    assert not marker.exists()
    assert rows_of(tmp_path / "out") == ["fine", "good text"]
    assert summary_of(tmp_path / "out")["counts_by_reason"] == {"yaml_unsupported_tag": 2}


@pytest.mark.parametrize("streamed", [False, True])
def test_yaml_dates_are_text_and_values_their_tag_cannot_hold_skip_the_file(
    tmp_path: Path, monkeypatch, streamed: bool
) -> None:
    if streamed:
        monkeypatch.setattr(reading, "MIN_PIECE_BYTES", 16)
    data = write_files(
        tmp_path / "data",
        {
            # 2023 is no leap year; the comments make the files longer than a streamed piece
            "post.yaml": "title: post\ndate: 2023-02-29\nwhen: 2001-12-14t21:59:43.10-05:00\n# " + "x" * 200,
            "int.yaml": "ok: first\n---\nn: !!int abc\n# " + "x" * 200,
            "float.yaml": "x: !!float xyz\n",
            "bool.yaml": "flag: !!bool maybe\n",  # a KeyError inside PyYAML
        },
    )
    limit = {"max_chars": 30} if streamed else {}
    assert read_file(data / "post.yaml", **limit).rows == ["post", "2023-02-29", "2001-12-14t21:59:43.10-05:00"]
    second = read_file(data / "int.yaml", **limit)
    assert second.rows == ["first"] and reasons(second) == ["invalid_yaml"]
    assert "int()" in second.problems[0].detail
    assert convert(data, tmp_path / "out") == 0
    assert summary_of(tmp_path / "out")["counts_by_reason"] == {"invalid_yaml": 3}


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        ("binary.txt", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "binary"),
        ("fake_bom.txt", b"\xff\xfe\x00\xd8\x00\x00", "binary"),  # a UTF-16 BOM, then a lone surrogate: not UTF-16
        ("empty.txt", b"", "empty_file"),
        ("blank.md", b"  \n\t\n", "empty_file"),
        ("empty.json", b"", "empty_file"),
        ("bad.json", b"{not json at all", "invalid_json"),
        ("numbers.json", b'{"a": 1, "b": [true, null, 2.5]}', "no_text"),
        ("bad.yaml", b"key: [unclosed\n  other: {", "invalid_yaml"),
        ("deep.json", b"[" * 200_000 + b"]" * 200_000, "too_deep"),
        ("deep.jsonl", b"[" * 200_000 + b"]" * 200_000 + b"\n", "too_deep"),
        # libyaml's C composer would crash the whole process (segfault) on these, not raise
        ("deep_flow.yaml", b"a: " + b"[" * 200_000 + b"]" * 200_000, "too_deep"),
        ("deep_block.yml", b"- " * 200_000 + b"x", "too_deep"),
    ],
)
def test_bad_files_are_skipped_with_their_reason(tmp_path: Path, name: str, content: bytes, reason: str) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    result = read_file(path)
    assert result.rows == []
    assert result.skipped_reason == reason, result.problems


def test_malformed_json_keeps_the_values_before_the_error(tmp_path: Path) -> None:
    path = tmp_path / "cut.json"
    path.write_text('[{"t": "first"}, {"t": "second"}, {"t": "thi')  # a truncated download
    result = read_file(path)
    assert result.rows == ["first", "second"]
    assert reasons(result) == ["invalid_json"] and "read 2 value(s)" in result.problems[0].detail
    assert "Unterminated string starting at line 1 (char 40)" in result.problems[0].detail  # "at" said once
    deep = tmp_path / "deep_after_good.json"
    deep.write_text('["kept", ' + "[" * 100_000 + "]" * 100_000 + ', "lost"]')
    result = read_file(deep)
    assert result.rows == ["kept"] and reasons(result) == ["too_deep"]


def test_json_lines_saved_as_json_are_all_read(tmp_path: Path) -> None:
    path = tmp_path / "records.json"
    path.write_text('{"t": "a"}\n{"t": "b"}\n"c"\n')
    result = read_file(path)
    assert result.rows == ["a", "b", "c"] and result.problems == []


def test_legacy_encodings_are_decoded_not_dropped(tmp_path: Path) -> None:
    (tmp_path / "cp1252.txt").write_bytes("caf\u00e9 \u2014 na\u00efve".encode("cp1252"))
    (tmp_path / "latin1.txt").write_bytes(b"\x81 undefined in cp1252 \xe9")
    (tmp_path / "latin1.jsonl").write_bytes('{"t": "gar\u00e7on"}\n'.encode("latin-1"))
    cp1252 = read_file(tmp_path / "cp1252.txt")
    assert cp1252.rows == ["caf\u00e9 \u2014 na\u00efve"] and cp1252.fallback_encoding == "cp1252"
    latin1 = read_file(tmp_path / "latin1.txt")
    assert latin1.rows == ["\x81 undefined in cp1252 \u00e9"] and latin1.fallback_encoding == "latin-1"
    assert read_file(tmp_path / "latin1.jsonl").rows == ["gar\u00e7on"]


def test_utf16_and_utf32_text_with_a_bom_is_read_not_called_binary(tmp_path: Path) -> None:
    """Windows editors and PowerShell write UTF-16 with a BOM; it used to be skipped as 'binary' (NUL bytes)."""
    (tmp_path / "notes.txt").write_bytes("caf\u00e9 du matin".encode("utf-16"))
    (tmp_path / "rows.jsonl").write_bytes(('{"t": "gar\u00e7on"}\n{"t": "deux"}\n').encode("utf-16-be"))
    (tmp_path / "rows.jsonl").write_bytes(b"\xfe\xff" + (tmp_path / "rows.jsonl").read_bytes())  # BOM, big-endian
    (tmp_path / "values.json").write_bytes(json.dumps(["trente-deux", "bits"]).encode("utf-32"))
    notes = read_file(tmp_path / "notes.txt")
    assert notes.rows == ["caf\u00e9 du matin"] and notes.fallback_encoding == "utf-16" and notes.problems == []
    assert read_file(tmp_path / "rows.jsonl").rows == ["gar\u00e7on", "deux"]
    assert read_file(tmp_path / "values.json").rows == ["trente-deux", "bits"]


def test_large_utf16_and_utf32_files_are_decoded_as_a_stream(tmp_path: Path, monkeypatch) -> None:
    """Above the piece size a UTF-16/32 file is not cut into byte pieces (a cut may split a character; it used to be
    skipped with 'convert it to UTF-8'): it is decoded as a stream in pieces ending at a blank line or a newline, so
    it gives the same text as its UTF-8 copy, JSON Lines lines keep their numbers, and JSON and YAML stream as UTF-8
    does."""
    monkeypatch.setattr(reading, "MIN_PIECE_BYTES", 1024)  # with --max-chars 200: pieces of 1 KiB
    text = "\n\n".join(f"Paragraphe {i} : caf\u00e9 cr\u00e8me \u2713 " * 3 for i in range(300)) + "\n"
    lines = "".join(json.dumps({"t": f"ligne {i} \u00e9t\u00e9"}) + "\n" for i in range(400)) + "{cut\n"
    values = json.dumps([f"valeur {i} \u00e0" for i in range(300)])
    for encoding in ("utf-8", "utf-16", "utf-32"):
        write_files(
            tmp_path / encoding,
            {
                "big.txt": text.encode(encoding),
                "big.jsonl": lines.encode(encoding),
                "big.json": values.encode(encoding),
                "big.yaml": yaml.safe_dump({"notes": [f"note {i} \u00e9" for i in range(300)]}).encode(encoding),
            },
        )
        assert (tmp_path / encoding / "big.txt").stat().st_size > 4 * 1024
        assert main(["--data_folder", str(tmp_path / encoding), "--save_dir", str(tmp_path / f"ds_{encoding}"),
                     "--max-chars", "200"]) == 0  # fmt: skip
    utf8 = load_from_disk(str(tmp_path / "ds_utf-8"))["text"]
    for encoding in ("utf-16", "utf-32"):
        rows = load_from_disk(str(tmp_path / f"ds_{encoding}"))["text"]
        assert "".join(rows) == "".join(utf8) and max(map(len, rows)) <= 200, encoding  # pieces may end elsewhere
        summary = summary_of(tmp_path / f"ds_{encoding}")
        assert [(p["reason"], p["line"]) for p in summary["problems"]] == [("invalid_jsonl_line", 401)], encoding
        assert summary["counts_by_reason"] == {"invalid_jsonl_line": 1} and not summary["skipped_files"], encoding


def test_utf8_bom_is_dropped(tmp_path: Path) -> None:
    bom = "\ufeff".encode()
    write_files(
        tmp_path, {"a.txt": bom + b"text", "a.json": bom + b'["j"]', "a.jsonl": bom + b'"l"\n', "a.yaml": bom + b"y"}
    )
    for name, row in (("a.txt", "text"), ("a.json", "j"), ("a.jsonl", "l"), ("a.yaml", "y")):
        result = read_file(tmp_path / name)
        assert result.rows == [row] and result.fallback_encoding is None, name


def test_lone_surrogates_from_json_escapes_are_replaced_not_fatal(tmp_path: Path) -> None:
    data = write_files(tmp_path / "data", {"s.json": '["ok", "bad \\udc80 half"]'})
    assert convert(data, tmp_path / "out") == 0
    assert rows_of(tmp_path / "out") == ["ok", "bad \ufffd half"]
    assert summary_of(tmp_path / "out")["rows_with_lone_surrogates_replaced"] == 1


def test_min_chars_drops_short_rows(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    path.write_text(json.dumps(["tiny", "   padded   ", "long enough text", " ", ""]))
    result = read_file(path, min_chars=8)
    assert result.rows == ["long enough text"]
    assert (result.dropped_short, result.dropped_empty) == (2, 2)


# --- Long texts and large files -----------------------------------------------------------------------------


def test_split_long_text_keeps_content_and_limit_and_prefers_blank_lines() -> None:
    paragraphs = [f"paragraph {i} " + "word " * (i % 13) for i in range(200)]
    text = "\n\n".join(paragraphs)
    rows = split_long_text(text, 100)
    assert "".join(rows) == text
    assert all(len(row) <= 100 for row in rows)
    assert all(row.endswith("\n\n") for row in rows[:-1])  # cut after a blank line, never mid-paragraph
    no_blank = "\n".join(["line " * 5] * 50)
    rows = split_long_text(no_blank, 64)
    assert "".join(rows) == no_blank and all(row.endswith("\n") and len(row) <= 64 for row in rows[:-1])
    one_line = "x" * 1000
    assert split_long_text(one_line, 300) == ["x" * 300] * 3 + ["x" * 100]
    assert split_long_text("short", 10) == ["short"]


def test_extra_rows_from_splitting_counts_only_rows_kept(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("x" * 30 + "\n" + " " * 15)  # 3 rows of text, then a whitespace tail
    result = read_file(tmp_path / "a.txt", max_chars=10)
    assert result.rows == ["x" * 10] * 3
    assert result.extra_rows_from_splitting == 2 and result.dropped_empty >= 1  # the tail: dropped, not extra


def test_large_text_file_is_read_in_pieces_that_tile_it_exactly(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(reading, "MIN_PIECE_BYTES", 4096)
    monkeypatch.setattr(reading, "ALIGN_WINDOW", 256)
    paragraphs = [f"para {i} " + "\u00e9t\u00e9 " * (i % 40) for i in range(2000)]
    text = "\n\n".join(paragraphs) + "\nlast line without blank line " * 30
    path = tmp_path / "big.txt"
    path.write_text(text)
    piece_bytes = piece_bytes_for(1000)
    tasks = plan_tasks([(path, path.stat().st_size)], piece_bytes)
    assert len(tasks) > 5
    rows = []
    for task in tasks:
        (piece,) = task.pieces
        rows += read_file(path, 1000, 0, piece.start, piece.end).rows
    assert "".join(rows) == text
    assert all(len(row) <= 1000 for row in rows)


def test_large_jsonl_pieces_give_every_line_once_with_global_line_numbers(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(reading, "MIN_PIECE_BYTES", 4096)
    monkeypatch.setattr(workers, "PARALLEL_MIN_BYTES", 0)
    lines = [json.dumps({"t": f"record {i} " + "x" * (i % 50)}) for i in range(3000)]
    lines[2500] = "{broken"
    data = write_files(tmp_path / "data", {"big.jsonl": "\n".join(lines) + "\n"})
    assert piece_bytes_for(1000) == 4096 and len(plan_tasks([(data / "big.jsonl", 130_000)], 4096)) > 20
    cli = ["--data_folder", str(data), "--save_dir", str(tmp_path / "out"), "--num-proc", "2", "--max-chars", "1000"]
    assert main(cli) == 0
    expected = [json.loads(line)["t"] for i, line in enumerate(lines) if i != 2500]
    assert rows_of(tmp_path / "out") == expected
    summary = summary_of(tmp_path / "out")
    assert [(p["reason"], p["line"]) for p in summary["problems"]] == [("invalid_jsonl_line", 2501)]


def test_large_json_and_yaml_are_streamed_with_the_same_rows(tmp_path: Path, monkeypatch) -> None:
    records = [{"id": i, "text": f"record {i}", "tags": ["t", {"x": f"deep {i}"}]} for i in range(500)]
    (tmp_path / "big.json").write_text(json.dumps(records, indent=2))
    (tmp_path / "big.yaml").write_text("\n---\n".join(json.dumps(r) for r in records))
    in_memory = {name: read_file(tmp_path / name).rows for name in ("big.json", "big.yaml")}
    monkeypatch.setattr(reading, "MIN_PIECE_BYTES", 1024)
    streamed_files = []
    real_streamed = reading._items_streamed

    def spy(kind: str, path: str, *args: object):
        streamed_files.append(Path(path).name)
        return real_streamed(kind, path, *args)

    monkeypatch.setattr(reading, "_items_streamed", spy)
    for name, rows in in_memory.items():
        streamed = read_file(tmp_path / name, max_chars=100)
        assert streamed.rows == rows and len(rows) == 1500 and streamed.problems == []
    assert streamed_files == ["big.json", "big.yaml"]
    legacy = tmp_path / "legacy.json"
    legacy.write_bytes(json.dumps(["caf\u00e9 " * 300] * 5, ensure_ascii=False).encode("cp1252"))
    streamed = read_file(legacy, max_chars=100)
    assert "".join(streamed.rows) == "caf\u00e9 " * 1500 and streamed.fallback_encoding == "cp1252"
    (tmp_path / "binary.json").write_bytes(b'["x"' + b"\x00" * 5000 + b"]")
    assert read_file(tmp_path / "binary.json", max_chars=100).skipped_reason == "binary"
    assert streamed_files[2:] == ["legacy.json", "binary.json"]


@pytest.mark.parametrize("flags", [("text", "strings"), ("text", "records"), ("auto", "strings"), ("chat", "strings")])
def test_a_json_files_records_do_not_depend_on_its_size(tmp_path: Path, monkeypatch, flags: tuple[str, str]) -> None:
    """A top-level object is one record whether the file is read whole or streamed (a large file): streamed, it was
    read member by member, so one conversation with a large extra field became text rows, and an object of
    conversations keyed by id, refused when small, gave one conversation per member when large."""
    turns = [{"role": "user", "content": "a question"}, {"role": "assistant", "content": "an answer"}]
    shapes = {
        "one.json": {"messages": turns, "logprobs": [0.5] * 50},
        "keyed.json": {f"id{i}": {"messages": turns} for i in range(3)},
        "wrapped.json": {"data": [{"messages": turns}] * 3},
        "listed.json": [{"messages": turns}] * 3,
    }
    for name, value in shapes.items():
        (tmp_path / name).write_text(json.dumps(value))
    data_format, json_mode = flags

    def read_all() -> dict[str, tuple]:
        found = {}
        for name in shapes:
            result = read_file(tmp_path / name, data_format=data_format, json_mode=json_mode)
            found[name] = (result.rows, reasons(result))
        return found

    small = read_all()
    monkeypatch.setattr(reading, "piece_bytes_for", lambda max_chars: 16)  # every file is "large": streamed
    assert read_all() == small
    if data_format == "chat":
        assert [len(small[name][0]) for name in shapes] == [1, 0, 0, 3]
    # a file over WHOLE_OBJECT_MAX_BYTES is a dump of records, not one: read member by member, memory flat
    monkeypatch.setattr(reading, "WHOLE_OBJECT_MAX_BYTES", 16)
    if flags == ("text", "records"):
        assert len(read_file(tmp_path / "keyed.json", json_mode="records").rows) == 3  # one record per member


# --- Finding files ------------------------------------------------------------------------------------------


def test_find_input_files_sorted_skips_hidden_follows_links_without_looping(tmp_path: Path) -> None:
    root = write_files(
        tmp_path / "raw",
        {"b/2.txt": "x", "b/1.TXT": "x", "a.md": "x", ".hidden.txt": "x", ".git/c.txt": "x", "skip.csv": "x"},
    )
    (root / "b" / "loop").symlink_to(root, target_is_directory=True)  # would recurse forever if followed blindly
    (root / "broken.txt").symlink_to(root / "missing.txt")
    found, problems, other_endings = find_input_files(root, data_hf.DEFAULT_EXTENSIONS)
    assert [p.relative_to(root).as_posix() for p, _ in found] == ["a.md", "b/1.TXT", "b/2.txt"]
    assert [(Path(p.path).name, p.reason) for p in problems] == [("broken.txt", "read_error")]
    assert other_endings == {".csv": 1}


def test_plan_groups_small_files_and_keeps_order(tmp_path: Path) -> None:
    files = [(tmp_path / f"{i:03d}.txt", 1000) for i in range(600)]
    tasks = plan_tasks(files, 1 << 20)
    assert [piece.path for task in tasks for piece in task.pieces] == [str(p) for p, _ in files]
    assert len(tasks) == 3  # TASK_FILES per task


# --- The CLI end to end -------------------------------------------------------------------------------------


CORPUS = {
    "split_00/a.txt": "plain text file\n\nwith two paragraphs\n",
    "split_00/b.json": json.dumps({"instruction": "do it", "output": ["step 1", "step 2"], "id": 7}),
    "split_01/c.jsonl": '{"text": "line one"}\n{"text": "line two"}\n',
    "split_01/d.yml": "q: question\na: answer\n",
    "split_01/e.md": "# heading\n",
    "split_02/nested/f.txt": "deep file",
}
CORPUS_ROWS = [
    "plain text file\n\nwith two paragraphs\n", "do it", "step 1", "step 2",
    "line one", "line two", "question", "answer", "# heading\n", "deep file",
]  # fmt: skip


def test_cli_writes_a_dataset_that_load_from_disk_reads_in_order(tmp_path: Path, capsys) -> None:
    data = write_files(tmp_path / "splits", CORPUS)
    out = tmp_path / "hf_datasets" / "my_corpus"
    assert main(["--data-folder", str(data), "--save-dir", str(out), "--num-proc", "2"]) == 0
    loaded = load_from_disk(str(out))
    assert isinstance(loaded, Dataset)
    assert loaded.features == Features({"text": Value("string")})
    assert list(loaded["text"]) == CORPUS_ROWS
    summary = summary_of(out)
    assert (summary["files_found"], summary["files_read"], summary["rows_total"]) == (6, 6, 10)
    assert summary["counts_by_reason"] == {} and summary["bytes_read"] == sum(len(c.encode()) for c in CORPUS.values())
    assert "6 files" in capsys.readouterr().out
    (data / "picture.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")  # found, and skipped once read
    assert main(["--data-folder", str(data), "--save-dir", str(out), "--num-proc", "1", "--overwrite"]) == 0
    summary = summary_of(out)
    assert (summary["files_found"], summary["files_read"], summary["files_skipped"]) == (7, 6, 1)
    (data / "picture.txt").unlink()
    assert main(["--data-folder", str(data), "--save-dir", str(out), "--num-proc", "1", "--overwrite"]) == 0
    assert sorted(os.listdir(out.parent)) == ["my_corpus"]  # no temporary folder left behind
    train, validation = load_text_dataset(out)
    assert list(train["text"]) == CORPUS_ROWS and validation is None


def test_same_input_gives_identical_output_whatever_num_proc(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(workers, "PARALLEL_MIN_BYTES", 0)  # use workers even for this small corpus
    files = {f"d{i % 7}/f{i:04d}.{['txt', 'json', 'jsonl', 'yaml'][i % 4]}": "" for i in range(300)}
    for i, name in enumerate(files):
        text = f"row {i} " + "words " * (i % 17)
        files[name] = {
            "txt": text, "json": json.dumps([text, {"k": text + "!"}]), "jsonl": json.dumps({"t": text}) + "\n",
            "yaml": f"- {text}\n",
        }[name.rsplit(".", 1)[1]]  # fmt: skip
    data = write_files(tmp_path / "data", files)
    outputs = []
    for run, num_proc in enumerate(("1", "2", "2")):
        out = tmp_path / f"out{run}"
        assert main(["--data_folder", str(data), "--save_dir", str(out), "--num-proc", num_proc]) == 0
        outputs.append((rows_of(out), summary_of(out)["content_digest"]))
    assert len(outputs[0][0]) == 375  # 75 files of each kind; a JSON file gives two rows
    assert outputs[0] == outputs[1] == outputs[2]


def test_val_fraction_writes_a_stable_train_validation_split(tmp_path: Path) -> None:
    data = write_files(
        tmp_path / "data", {"rows.jsonl": "".join(json.dumps({"t": f"row {i}"}) + "\n" for i in range(400))}
    )
    assert convert(data, tmp_path / "a", "--val-fraction", "0.25") == 0
    assert convert(data, tmp_path / "b", "--val_fraction", "0.25") == 0
    first, second = load_from_disk(str(tmp_path / "a")), load_from_disk(str(tmp_path / "b"))
    assert isinstance(first, DatasetDict) and sorted(first) == ["train", "validation"]
    assert first["train"]["text"][:] == second["train"]["text"][:]
    assert first["validation"]["text"][:] == second["validation"]["text"][:]
    validation = list(first["validation"]["text"])
    assert 60 < len(validation) < 140  # 25% of 400, give or take the hash
    assert sorted(validation + list(first["train"]["text"])) == sorted(f"row {i}" for i in range(400))
    assert all(assign_split(text, 0.25) == "validation" for text in validation)
    train, held_out = load_text_dataset(tmp_path / "a")
    assert len(train) + len(held_out) == 400


def test_val_fraction_warns_when_validation_is_empty(tmp_path: Path, capsys) -> None:
    data = write_files(tmp_path / "data", {"a.txt": "only one row"})
    assert convert(data, tmp_path / "out", "--val-fraction", "0.001") == 0
    assert "empty validation split" in capsys.readouterr().err
    train, validation = load_text_dataset(tmp_path / "out")
    assert list(train["text"]) == ["only one row"] and len(validation) == 0


def test_a_val_fraction_that_leaves_no_train_row_is_refused(tmp_path: Path, capsys) -> None:
    held_out = [t for t in (f"row {i}" for i in range(50)) if assign_split(t, 0.99) == "validation"][:3]
    data = write_files(tmp_path / "data", {"rows.jsonl": "".join(json.dumps({"t": t}) + "\n" for t in held_out)})
    assert len(held_out) == 3 and convert(data, tmp_path / "out", "--val-fraction", "0.99") == 1
    assert "--val-fraction 0.99 put all 3 rows in the validation split and none in train" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_strict_fails_on_any_skip_and_writes_nothing(tmp_path: Path, capsys) -> None:
    data = write_files(tmp_path / "data", {"good.txt": "fine", "bad.jsonl": '{"t": "ok"}\nnot json\n'})
    assert convert(data, tmp_path / "out", "--strict") == 1
    assert "--strict" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and os.listdir(tmp_path) == ["data"]
    assert convert(data, tmp_path / "out") == 0
    assert rows_of(tmp_path / "out") == ["ok", "fine"]


def test_refuses_to_overwrite_unless_asked_and_replaces_only_datasets(tmp_path: Path, capsys) -> None:
    data = write_files(tmp_path / "data", {"a.txt": "first version"})
    out = tmp_path / "out"
    assert convert(data, out) == 0
    (data / "a.txt").write_text("second version")
    assert convert(data, out) == 1
    assert "--overwrite" in capsys.readouterr().err
    assert rows_of(out) == ["first version"]
    assert convert(data, out, "--overwrite") == 0
    assert rows_of(out) == ["second version"]
    assert sorted(os.listdir(tmp_path)) == ["data", "out"]  # no temporary or set-aside folder left
    (tmp_path / "empty").mkdir()  # an empty folder holds nothing to lose: no --overwrite needed
    assert convert(data, tmp_path / "empty") == 0
    assert rows_of(tmp_path / "empty") == ["second version"]
    precious = write_files(tmp_path / "precious", {"notes.txt": "not a dataset"})
    assert convert(data, precious, "--overwrite") == 1
    assert "refusing to delete" in capsys.readouterr().err
    assert (precious / "notes.txt").read_text() == "not a dataset"


def test_a_mount_point_as_save_dir_is_refused_before_converting(tmp_path: Path, capsys, monkeypatch) -> None:
    """docker run -v host:/out ... --save_dir /out: the dataset was converted in full beside the mount, then the
    rename onto the mount point failed (EBUSY) and the work was thrown away."""
    data = write_files(tmp_path / "data", {"a.txt": "text"})
    volume = tmp_path / "volume"
    volume.mkdir()
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda path: Path(path) == volume or real_ismount(path))
    assert convert(data, volume) == 1
    assert f"--save_dir {volume} is a mount point (a container volume?)" in capsys.readouterr().err
    assert convert(data, volume / "corpus") == 0 and rows_of(volume / "corpus") == ["text"]


def test_output_inside_the_input_folder_is_not_read_back(tmp_path: Path) -> None:
    data = write_files(tmp_path / "data", {"a.json": '["x"]'})
    out = data / "hf_datasets" / "corpus"
    assert convert(data, out) == 0
    assert convert(data, out, "--overwrite") == 0  # the first dataset's state.json etc. must not become rows
    assert rows_of(out) == ["x"]


def test_a_single_file_can_be_converted(tmp_path: Path) -> None:
    data = write_files(tmp_path / "data", {"dump.jsonl": '{"t": "a"}\n{"t": "b"}\n'})
    assert convert(data / "dump.jsonl", tmp_path / "out") == 0
    assert rows_of(tmp_path / "out") == ["a", "b"]


def test_extensions_flag_and_other_extensions_read_as_text(tmp_path: Path) -> None:
    data = write_files(tmp_path / "data", {"a.rst": "restructured", "b.txt": "plain", "c.json": '["j"]'})
    assert convert(data, tmp_path / "out", "--extensions", "rst,.JSON") == 0
    assert rows_of(tmp_path / "out") == ["restructured", "j"]


def test_files_of_other_endings_are_counted_and_compressed_ones_named(tmp_path: Path, capsys) -> None:
    """A corpus of .jsonl.gz files was silently left out (not found, not skipped, no note): an empty or partial
    dataset with exit 0. Now they are counted by ending, and a compressed ending is refused with the fix."""
    data = write_files(tmp_path / "data", {"a.jsonl": '{"text": "read"}\n', "notes.csv": "a,b", "part-00000": "x"})
    for name in ("b.jsonl.gz", "c.jsonl.gz"):
        (data / name).write_bytes(gzip.compress(b'{"text": "compressed"}\n'))
    assert convert(data, tmp_path / "out") == 0
    summary = summary_of(tmp_path / "out")
    assert summary["files_not_read_by_ending"] == {".jsonl.gz": 2, ".csv": 1, "": 1}
    note = "not read, their ending is not in --extensions: 2 .jsonl.gz files, 1 .csv file, 1 file without an ending"
    assert summary["notes"][0].startswith(note) and "for .jsonl.gz, decompress them first" in summary["notes"][0]
    assert "for .csv, pass --extensions to read them as text; for no ending, give them an ending" in summary["notes"][0]
    assert note in capsys.readouterr().out
    (data / "a.jsonl").unlink()
    (data / "notes.csv").unlink()
    assert convert(data, tmp_path / "out2") == 1  # nothing to read: the message says what the folder holds
    err = capsys.readouterr().err
    assert "it holds 2 .jsonl.gz files, 1 file without an ending; data_hf.py reads text files, not compressed" in err
    for given in (["--extensions", "jsonl.gz"], ["--extensions", ".zst"]):
        assert convert(data, tmp_path / "out3", *given) == 1
        assert (
            f"--extensions {given[1].lstrip('.')}: data_hf.py reads text files, not compressed"
            in capsys.readouterr().err
        )
    assert convert(data / "b.jsonl.gz", tmp_path / "out4") == 1
    assert "is a file ending in .jsonl.gz, which --extensions does not list; data_hf.py reads text files, not" in (
        capsys.readouterr().err
    )
    # files that are no text (parquet): the fix is to convert them, not --extensions (which read them as binary)
    parquet = write_files(tmp_path / "parquet", {"a.parquet": "PAR1"})
    assert convert(parquet, tmp_path / "out6") == 1
    assert (
        "it holds 1 .parquet file; data_hf.py reads text files only: convert them to .jsonl" in capsys.readouterr().err
    )
    # two-part endings that are not compressed match as organize_data.py matches them
    write_files(data, {"d.notes.txt": "two-part ending"})
    assert convert(data, tmp_path / "out5", "--extensions", "notes.txt") == 0
    assert rows_of(tmp_path / "out5") == ["two-part ending"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--data_folder", "missing"], "--data_folder missing does not exist"),
        (["--max-chars", "0"], "--max-chars 0"),
        (["--val-fraction", "1.0"], "--val-fraction 1.0"),
        (["--min-chars", "10", "--max-chars", "5"], "--min-chars 10 exceeds --max-chars 5"),
        (["--num-proc", "0"], "--num-proc 0"),
    ],
)
def test_bad_flags_name_the_flag(tmp_path: Path, capsys, args: list[str], message: str) -> None:
    data = write_files(tmp_path / "data", {"a.txt": "x"})
    base = {"--data_folder": str(data), "--save_dir": str(tmp_path / "out")}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    assert main([item for pair in base.items() for item in pair]) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("flag", "value"), [("--format", "xml"), ("--json-mode", "lines")])
def test_unknown_format_or_json_mode_is_refused_naming_the_choices(
    tmp_path: Path, capsys, flag: str, value: str
) -> None:
    data = write_files(tmp_path / "data", {"a.txt": "x"})
    assert convert(data, tmp_path / "out", flag, value) == 2  # argparse's exit code, returned by main()
    error = capsys.readouterr().err
    assert flag in error and value in error and ("chat" in error or "records" in error)
    assert not (tmp_path / "out").exists()


def test_no_input_files_and_no_rows_are_errors(tmp_path: Path, capsys) -> None:
    data = write_files(tmp_path / "data", {"a.csv": "x"})
    assert convert(data, tmp_path / "out") == 1
    assert "no files with the extensions" in capsys.readouterr().err
    write_files(data, {"empty.txt": "", "nums.json": "[1, 2]"})
    assert convert(data, tmp_path / "out") == 1
    assert "no rows were extracted" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["data"]


def test_no_cache_is_left_in_the_user_hf_cache(tmp_path: Path, repo_root: Path) -> None:
    data = write_files(tmp_path / "data", CORPUS)
    home = tmp_path / "home"
    env = dict(os.environ, HOME=str(home), HF_HOME=str(home / "hf"), XDG_CACHE_HOME=str(home / "cache"))
    env.pop("HF_DATASETS_CACHE", None)
    command = [
        sys.executable,
        str(repo_root / "data_hf.py"),
        "--data_folder",
        str(data),
        "--save_dir",
        str(tmp_path / "out"),
    ]
    subprocess.run(command + ["--val-fraction", "0.5"], env=env, check=True, capture_output=True, timeout=300)
    left = [p for p in home.rglob("*") if p.is_file()] if home.exists() else []
    assert left == []
    assert sorted(os.listdir(tmp_path)) == ["data", "out"]


# --- Conversations (--format chat / auto) and --json-mode ---------------------------------------------------


def turns(*pairs: str) -> tuple[tuple[str, str], ...]:
    """turns("user", "hi", "assistant", "hello") -> (("user", "hi"), ("assistant", "hello"))"""
    return tuple(zip(pairs[::2], pairs[1::2], strict=True))


NO_TOOLS = dict.fromkeys(TURN_FIELDS)  # the tool fields of a turn without tool use: null


def messages_of(conversation: tuple[tuple[str, str], ...]) -> list[dict[str, str]]:
    return [{"role": role, "content": content, **NO_TOOLS} for role, content in conversation]


def without_nulls(rows: list[list[dict]]) -> list[list[dict]]:
    return [[{key: value for key, value in turn.items() if value is not None} for turn in row] for row in rows]


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        (
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                          {"role": "assistant", "content": "4."}]},
            turns("system", "Be brief.", "user", "2+2?", "assistant", "4."),
        ),
        (  # role aliases, several exchanges, extra keys ignored
            {"id": 3, "messages": [{"role": "Human", "content": "a"}, {"role": "model", "content": "b"},
                                   {"role": "user", "content": "c"}, {"role": "bot", "content": "d", "x": 1}]},
            turns("user", "a", "assistant", "b", "user", "c", "assistant", "d"),
        ),
        (
            {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Hi"},
                               {"from": "gpt", "value": "Hello!"}]},
            turns("system", "S", "user", "Hi", "assistant", "Hello!"),
        ),
        (
            {"instruction": "Add the numbers.", "input": "1 and 2", "output": "3"},
            turns("user", "Add the numbers.\n\n1 and 2", "assistant", "3"),
        ),
        ({"instruction": "Say hi.", "input": "", "output": "hi"}, turns("user", "Say hi.", "assistant", "hi")),
        ({"instruction": "Say hi.", "output": "hi", "system": "Be kind."},
         turns("system", "Be kind.", "user", "Say hi.", "assistant", "hi")),
        ({"instruction": "And 2 plus 2?", "input": "", "output": "4", "history": [["1 plus 1?", "2"]],  # LLaMA-Factory
          "system": "You add."},  # multi-turn Alpaca: its earlier exchanges were dropped
         turns("system", "You add.", "user", "1 plus 1?", "assistant", "2", "user", "And 2 plus 2?", "assistant", "4")),
        ({"prompt": "The sky is", "completion": " blue."}, turns("user", "The sky is", "assistant", " blue.")),
        ({"prompt": "p", "response": "r"}, turns("user", "p", "assistant", "r")),
        ({"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}],  # TRL's conversational
          "completion": [{"role": "assistant", "content": "a"}]}, turns("system", "S", "user", "q", "assistant", "a")),
        ({"question": "Why?", "answer": "Because.", "system": ""}, turns("user", "Why?", "assistant", "Because.")),
        (
            {"system": "Top.", "messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]},
            turns("system", "Top.", "user", "u", "assistant", "a"),
        ),
    ],
)  # fmt: skip
def test_parse_conversation_reads_every_record_shape(record: dict, expected: tuple) -> None:
    assert parse_conversation(record) == expected


BAD_RECORDS = [
    ({"text": "plain"}, "not_a_conversation"),
    ("a bare string", "not_a_conversation"),
    ({"instruction": "no output"}, "not_a_conversation"),
    ({"messages": "hi"}, "bad_message"),
    ({"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]}, "bad_message"),
    ({"messages": ["user: hi", {"role": "assistant", "content": "a"}]}, "bad_message"),
    ({"messages": [{"role": "critic", "content": "x"}, {"role": "assistant", "content": "a"}]}, "unknown_role"),
    ({"messages": [{"role": 3, "content": "x"}, {"role": "assistant", "content": "a"}]}, "unknown_role"),
    ({"conversations": [{"from": "narrator", "value": "x"}, {"from": "gpt", "value": "a"}]}, "unknown_role"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}, {"role": "assistant", "content": "a"}]},
     "non_string_content"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]}, "non_string_content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "cat.png"}},
                                               {"type": "text", "text": "what is it?"}]},
                   {"role": "assistant", "content": "a cat"}]}, "non_text_content"),
    ({"instruction": 7, "output": "a"}, "non_string_content"),
    ({"instruction": "i", "input": ["x"], "output": "a"}, "non_string_content"),
    ({"instruction": "i", "output": "a", "history": [["only the question"]]}, "bad_message"),
    ({"instruction": "i", "output": "a", "history": "q1 a1"}, "bad_message"),
    ({"question": "q", "answer": "a", "system": {"text": "s"}}, "non_string_content"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"},
                   {"role": "assistant", "content": "a"}]}, "misplaced_system_turn"),
    ({"system": "s", "messages": [{"role": "system", "content": "s2"}, {"role": "user", "content": "q"},
                                  {"role": "assistant", "content": "a"}]}, "misplaced_system_turn"),
    ({"messages": [{"role": "user", "content": "only a question"}]}, "no_assistant_turn"),
    ({"messages": []}, "no_assistant_turn"),
    ({"prompt": "p", "completion": "   "}, "no_assistant_turn"),
]  # fmt: skip


def test_content_given_as_a_list_of_text_parts_is_joined() -> None:
    """OpenAI/HF multimodal-style content: text parts (with "text", or "value" as some dumps write it, or plain
    strings) are joined with a newline; the same in ShareGPT turns."""
    record = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "value": "2 plus 3?"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "5."}, "Five."]},
        ]
    }
    assert parse_conversation(record) == (("user", "What is\n2 plus 3?"), ("assistant", "5.\nFive."))
    sharegpt = {"conversations": [{"from": "human", "value": [{"text": "hi"}]}, {"from": "gpt", "value": "hello"}]}
    assert parse_conversation(sharegpt) == (("user", "hi"), ("assistant", "hello"))


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
# One tool-calling exchange in each shape people have; every one reads as the same turns (ids where given).
TOOL_RECORDS = {
    "openai": {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 20}'},
        {"role": "assistant", "content": "20 degrees."}], "tools": [WEATHER]},
    "hf": {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [CALL]},
        {"role": "tool", "name": "get_weather", "content": {"temp": 20}},
        {"role": "assistant", "content": "20 degrees."}], "tools": [WEATHER]},
    "openai_legacy": {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
        {"role": "function", "name": "get_weather", "content": '{"temp": 20}'},
        {"role": "assistant", "content": "20 degrees."}], "tools": [WEATHER["function"]]},
    "glaive": {"conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
        {"from": "observation", "value": '{"temp": 20}'},
        {"from": "gpt", "value": "20 degrees."}], "tools": json.dumps([WEATHER["function"]])},
}  # fmt: skip


@pytest.mark.parametrize("shape", TOOL_RECORDS)
def test_tool_calls_in_every_shape_read_as_one_schema(shape: str) -> None:
    conversation = parse_conversation(TOOL_RECORDS[shape])
    call = dict(CALL, id="call_1") if shape == "openai" else CALL
    result_id = "call_1" if shape == "openai" else None
    assert list(conversation) == [
        ("user", "Weather in Paris?"),
        ToolTurn("assistant", "", json.dumps([call], separators=(",", ":"))),
        ToolTurn("tool", '{"temp":20}' if shape == "hf" else '{"temp": 20}', None, "get_weather", result_id),
        ("assistant", "20 degrees."),
    ]
    assert json.loads(conversation.tools) == [WEATHER]


def test_parallel_calls_answer_in_order_and_plain_conversations_have_no_tools() -> None:
    """A function_call turn holding two calls; each observation takes the name of the next call unanswered."""
    calls = [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": "{}"}]
    record = {"conversations": [
        {"from": "human", "value": "Weather and time?"}, {"from": "function_call", "value": json.dumps(calls)},
        {"from": "observation", "value": "sunny"}, {"from": "observation", "value": "noon"},
        {"from": "gpt", "value": "Sunny at noon."}]}  # fmt: skip
    turns = parse_conversation(record)
    assert [json.loads(turns[1].tool_calls)[i]["function"]["arguments"] for i in (0, 1)] == [{"city": "Paris"}, {}]
    assert [(turn.name, turn.content) for turn in turns[2:4]] == [("get_weather", "sunny"), ("get_time", "noon")]
    assert turns.tools is None and parse_conversation(GOOD[0]).tools is None
    # results with ids answer their own calls, in any order; one naming no call keeps its own fields only (it took
    # the name of the next call while its id said another)
    ids = [{"id": "c1", "function": calls[0]}, {"id": "c2", "function": calls[1]}]
    record = {"messages": [
        {"role": "user", "content": "Weather and time?"}, {"role": "assistant", "tool_calls": ids},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"}, {"role": "tool", "tool_call_id": "zzz", "content": "?"},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "assistant", "content": "Sunny at noon."}]}  # fmt: skip
    turns = parse_conversation(record)
    assert [(t.name, t.tool_call_id, t.content) for t in turns[2:5]] == [
        ("get_time", "c2", "noon"), (None, "zzz", "?"), ("get_weather", "c1", "sunny")]  # fmt: skip


BAD_TOOL_RECORDS = [
    ({"messages": [{"role": "user", "content": "q"},
                   {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]},
     "bad_tool_call"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"arguments": {}}]}]},
     "bad_tool_call"),
    ({"messages": [{"role": "user", "content": "q"},
                   {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": [1]}}]}]},
     "bad_tool_call"),
    ({"messages": [{"role": "user", "content": "q", "tool_calls": [CALL]}, {"role": "assistant", "content": "a"}]},
     "bad_tool_call"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "call f"}]},
     "bad_tool_call"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "tools": "[oops"},
     "bad_tools"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
      "tools": [{"description": "no name"}]}, "bad_tools"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "tool", "name": "f"},
                   {"role": "assistant", "content": "a"}]}, "bad_message"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": None},
                   {"role": "assistant", "content": "a"}]}, "non_string_content"),
]  # fmt: skip


@pytest.mark.parametrize(("record", "reason"), BAD_TOOL_RECORDS)
def test_bad_tool_use_is_a_counted_skip_with_its_reason(record: object, reason: str) -> None:
    with pytest.raises(BadRecord) as caught:
        parse_conversation(record)
    assert caught.value.reason == reason and reason in REASONS


def test_format_chat_writes_tool_calls_and_tools_that_the_trainer_reads_back(tmp_path: Path) -> None:
    from fsdp_lib.records.tool_calls import template_messages, template_tools

    lines = [json.dumps(record) for record in (*TOOL_RECORDS.values(), GOOD[0], BAD_TOOL_RECORDS[0][0])]
    data = write_files(tmp_path / "data", {"tools.jsonl": "\n".join(lines) + "\n"})
    assert convert(data, tmp_path / "out", "--format", "chat") == 0
    loaded = load_from_disk(str(tmp_path / "out"))
    assert loaded.features == CHAT_FEATURES and len(loaded) == 5
    assert summary_of(tmp_path / "out")["counts_by_reason"] == {"bad_tool_call": 1}
    for row in loaded.select(range(4)):
        messages = template_messages(row["messages"])
        assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [messages[1]["tool_calls"][0]]}
        assert {key: value for key, value in messages[1]["tool_calls"][0].items() if key != "id"} == CALL
        assert messages[2]["role"] == "tool" and messages[2]["name"] == "get_weather"
        assert template_tools(row["tools"]) == [WEATHER]
    assert (
        loaded[4]["tools"] is None
        and template_messages(loaded[4]["messages"]) == without_nulls([messages_of(parse_conversation(GOOD[0]))])[0]
    )
    # the split hash covers the tool fields and tools: a conversation and its copy without tools may part ways
    with_tools = parse_conversation(TOOL_RECORDS["hf"])
    assert '"tools"' in conversation_json(with_tools)
    assert conversation_json(parse_conversation(GOOD[0])).startswith('[{"role":"user"')


def test_chat_conversion_keeps_conversations_with_text_parts_and_counts_non_text_ones(tmp_path: Path) -> None:
    parts = {"role": "user", "content": [{"type": "text", "text": "q"}]}
    image = {"role": "user", "content": [{"type": "image", "image": "x.png"}, {"type": "text", "text": "q"}]}
    answer = {"role": "assistant", "content": [{"type": "text", "text": "a"}]}
    lines = [json.dumps({"messages": [turn, answer]}) for turn in (parts, parts, image)]
    data = write_files(tmp_path / "data", {"parts.jsonl": "\n".join(lines) + "\n"})
    assert convert(data, tmp_path / "out", "--format", "chat") == 0
    messages = load_from_disk(str(tmp_path / "out"))["messages"][:]
    assert without_nulls(messages) == [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]] * 2
    assert summary_of(tmp_path / "out")["counts_by_reason"] == {"non_text_content": 1}


@pytest.mark.parametrize(("record", "reason"), BAD_RECORDS)
def test_parse_conversation_rejects_bad_records_with_their_reason(record: object, reason: str) -> None:
    with pytest.raises(BadRecord) as caught:
        parse_conversation(record)
    assert caught.value.reason == reason and reason in REASONS


def test_a_conversational_prompt_s_assistant_turns_are_context_not_trained() -> None:
    """TRL's conversational prompt/completion: only the completion is trained (a prompt's assistant turn has weight 0)."""
    record = {"prompt": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"},
                         {"role": "user", "content": "2+2?"}], "completion": [{"role": "assistant", "content": "4"}]}  # fmt: skip
    turns = list(parse_conversation(record))
    assert [turn[:2] for turn in turns] == [("user", "1+1?"), ("assistant", "2"), ("user", "2+2?"), ("assistant", "4")]
    assert turns[1].weight == "0" and len(turns[3]) == 2  # the completion: trained as usual


def test_a_yaml_boolean_or_number_in_a_text_field_says_to_quote_it() -> None:
    """`content: no` in a YAML conversation is the boolean False: the skip said only 'has bool content'."""
    for record in ({"messages": [{"role": "user", "content": "Is it?"}, {"role": "assistant", "content": False}]},
                   {"instruction": "Pick one.", "output": 1.0}):  # fmt: skip
        with pytest.raises(BadRecord, match="from a YAML file. it reads an unquoted yes, no, on, off or number so"):
            parse_conversation(record)


CHAT_FEATURES = Features(
    {
        "messages": [{name: Value("string") for name in ("role", "content", *TURN_FIELDS)}],
        "tools": Value("string"),
    }
)


def test_messages_column_has_the_arrow_type_datasets_gives_conversations() -> None:
    assert arrow_type("messages") == CHAT_FEATURES.arrow_schema.field("messages").type
    assert str(arrow_type("messages")) == (
        "list<item: struct<role: string, content: string, tool_calls: string, name: string, tool_call_id: string, "
        "weight: string, reasoning_content: string>>"
    )
    assert arrow_type("tools") == CHAT_FEATURES.arrow_schema.field("tools").type


GOOD = [
    {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."}]},
    {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]},
    {"instruction": "Add.", "input": "1 and 2", "output": "3", "system": "You add."},
    {"prompt": "The sky is", "completion": " blue."},
    {"question": "Capital of Norland?", "answer": "Vesk."},
]


def chat_corpus(root: Path) -> Path:
    """Every record shape in every conversation file layout, each bad reason once, and a text file."""
    bad_lines = [json.dumps(record) for record, _ in BAD_RECORDS]
    return write_files(
        root,
        {
            "a_array.json": json.dumps(GOOD[:2]),
            "b_single.json": json.dumps(GOOD[2]),
            "c_lines.jsonl": "\n".join([json.dumps(GOOD[3]), *bad_lines, "{broken", json.dumps(GOOD[4])]) + "\n",
            "d_docs.yaml": yaml.safe_dump_all([GOOD[0], GOOD[1:3]]),
            "e_notes.txt": "a text file is not a conversation",
        },
    )


CHAT_ROWS = [GOOD[0], GOOD[1], GOOD[2], GOOD[3], GOOD[4], GOOD[0], GOOD[1], GOOD[2]]


def test_format_chat_writes_one_messages_row_per_conversation(tmp_path: Path, capsys) -> None:
    data = chat_corpus(tmp_path / "data")
    out = tmp_path / "chat"
    assert convert(data, out, "--format", "chat") == 0
    loaded = load_from_disk(str(out))
    assert loaded.features == CHAT_FEATURES
    assert loaded.column_names == ["messages", "tools"] and loaded["tools"] == [None] * len(loaded)
    expected = [messages_of(parse_conversation(record)) for record in CHAT_ROWS]
    assert loaded["messages"][:] == expected
    assert loaded[2]["messages"][0] == {"role": "system", "content": "You add.", **NO_TOOLS}
    summary = summary_of(out)
    reasons_expected = Counter(reason for _, reason in BAD_RECORDS)
    reasons_expected.update(["text_file_in_chat_run", "invalid_jsonl_line"])
    assert summary["counts_by_reason"] == dict(reasons_expected)
    assert summary["column"] == "messages" and summary["rows_total"] == 8 == summary["conversations_found"]
    assert [(p["path"], p["reason"]) for p in summary["skipped_files"]] == [
        (str(data / "e_notes.txt"), "text_file_in_chat_run")
    ]
    first_bad = [p for p in summary["problems"] if p["path"].endswith("c_lines.jsonl")][0]
    assert (first_bad["line"], first_bad["reason"]) == (2, BAD_RECORDS[0][1])  # JSON Lines problems carry the line
    assert "8 conversations" in capsys.readouterr().out
    train, validation = load_text_dataset(out)
    assert train.column_names == ["messages", "tools"] and validation is None


def test_bad_records_of_a_json_array_are_numbered(tmp_path: Path) -> None:
    path = write_files(tmp_path, {"a.json": json.dumps([GOOD[0], {"text": "x"}, GOOD[3]])}) / "a.json"
    result = read_file(path, data_format="chat")
    assert [len(row) for row in result.rows] == [2, 2]
    assert [(p.reason, p.detail.split(":")[0]) for p in result.problems] == [("not_a_conversation", "record 2")]


def test_chat_conversion_is_the_same_with_workers_and_in_pieces(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(workers, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(reading, "MIN_PIECE_BYTES", 4096)  # the big file is read in pieces by several workers
    lines = [json.dumps({"question": f"q{i} \u00e9", "answer": f"a{i}" * (i % 30 + 1)}) for i in range(2000)]
    lines[1500] = json.dumps({"question": "no answer", "answer": " "})
    files = {"big.jsonl": "\n".join(lines) + "\n", **{f"small/{i:03d}.json": json.dumps(GOOD) for i in range(40)}}
    data = write_files(tmp_path / "data", files)
    outputs = []
    for data_format, num_proc in (("chat", "1"), ("chat", "2"), ("auto", "2")):
        out = tmp_path / f"out_{data_format}{num_proc}"
        cli = ["--data_folder", str(data), "--save_dir", str(out), "--format", data_format, "--num-proc", num_proc]
        assert main([*cli, "--max-chars", "1000"]) == 0
        outputs.append((load_from_disk(str(out))["messages"][:], summary_of(out)))
    assert outputs[0][0] == outputs[1][0] == outputs[2][0] and len(outputs[0][0]) == 1999 + 40 * 5
    assert outputs[0][1]["content_digest"] == outputs[1][1]["content_digest"] == outputs[2][1]["content_digest"]
    for _, summary in outputs[1:]:  # line numbers count every piece before, in auto runs too
        assert [(p["reason"], p["line"]) for p in summary["problems"]] == [("no_assistant_turn", 1501)]


def test_chat_val_fraction_is_a_stable_split_by_conversation(tmp_path: Path) -> None:
    records = [{"question": f"question {i}", "answer": f"answer {i}"} for i in range(400)]
    data = write_files(tmp_path / "data", {"qa.jsonl": "".join(json.dumps(r) + "\n" for r in records)})
    assert convert(data, tmp_path / "a", "--format", "chat", "--val-fraction", "0.25") == 0
    assert convert(data, tmp_path / "b", "--format", "chat", "--val-fraction", "0.25") == 0
    first, second = load_from_disk(str(tmp_path / "a")), load_from_disk(str(tmp_path / "b"))
    assert isinstance(first, DatasetDict) and first["validation"].column_names == ["messages", "tools"]
    assert first["train"]["messages"][:] == second["train"]["messages"][:]
    validation = first["validation"]["messages"][:]
    assert 60 < len(validation) < 140
    for messages in validation:
        conversation = tuple((turn["role"], turn["content"]) for turn in messages)
        assert assign_split(conversation_json(conversation), 0.25) == "validation"
    questions = sorted(m[0]["content"] for m in validation + first["train"]["messages"][:])
    assert questions == sorted(f"question {i}" for i in range(400))
    train, held_out = load_text_dataset(tmp_path / "a")
    assert len(train) + len(held_out) == 400


def test_auto_writes_conversations_when_every_record_is_one(tmp_path: Path, capsys) -> None:
    data = write_files(
        tmp_path / "data",
        {"a.jsonl": "".join(json.dumps(r) + "\n" for r in GOOD), "b.yaml": "question: q\nanswer: '   '\n"},
    )
    assert convert(data, tmp_path / "auto") == 0
    assert convert(data, tmp_path / "chat", "--format", "chat") == 0
    assert (
        load_from_disk(str(tmp_path / "auto"))["messages"][:] == load_from_disk(str(tmp_path / "chat"))["messages"][:]
    )
    summary = summary_of(tmp_path / "auto")
    assert summary["column"] == "messages" and summary["counts_by_reason"] == {"no_assistant_turn": 1}
    assert "--format auto: every record read is a conversation" in capsys.readouterr().out
    assert convert(data, tmp_path / "split", "--val-fraction", "0.5") == 0  # the choice counts every split's rows
    split = load_from_disk(str(tmp_path / "split"))
    assert split["train"].column_names == split["validation"].column_names == ["messages", "tools"]
    assert len(split["train"]) + len(split["validation"]) == len(GOOD)


def test_conversations_written_as_bare_lists_of_turns_are_conversations(tmp_path: Path) -> None:
    """A conversation not wrapped in {"messages": [...]}: a JSONL line or a record that is a list of turns, or a
    whole file that is one. --format auto wrote their role names as text rows ('user', 'hi', ...), 0 problems."""
    one = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    shared = [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}]
    data = write_files(
        tmp_path / "data",
        {
            "lists.json": json.dumps([one, shared]),
            "whole.json": json.dumps(one),
            "lines.jsonl": json.dumps(one) + "\n" + json.dumps(shared) + "\n",
            "no_reply.jsonl": json.dumps([{"role": "user", "content": "q"}]) + "\n",
        },
    )
    assert convert(data, tmp_path / "auto") == 0
    rows = load_from_disk(str(tmp_path / "auto"))["messages"][:]
    pairs = sorted([(turn["role"], turn["content"]) for turn in row] for row in rows)
    assert pairs == sorted(
        3 * [[("user", "hi"), ("assistant", "hello")]] + 2 * [[("user", "x"), ("assistant", "y")]]
    ), pairs
    assert summary_of(tmp_path / "auto")["counts_by_reason"] == {"no_assistant_turn": 1}
    assert convert(data, tmp_path / "text", "--format", "text", "--json-mode", "records") == 0  # text: as before
    assert "user\nhi" in load_from_disk(str(tmp_path / "text"))["text"][:]


def test_openai_turn_weights_keep_weight_0_replies_as_context(tmp_path: Path) -> None:
    """OpenAI's fine-tuning format marks assistant turns not to train with "weight": 0; it was dropped and the turn
    trained. Stored as "0" on the turn, trained by no one; a weight that is not 0 or 1 is a counted skip, and a
    conversation whose every reply has weight 0 has nothing to train."""
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "skip me", "weight": 0},
             {"role": "user", "content": "q2"}, {"role": "assistant", "content": "train me", "weight": 1}]  # fmt: skip
    data = write_files(
        tmp_path / "data",
        {"r.jsonl": "".join(json.dumps(r) + "\n" for r in (
            {"messages": turns},
            {"messages": [turns[0], {**turns[1], "weight": 0.5}]},
            {"messages": turns[:2]},
        ))},
    )  # fmt: skip
    assert convert(data, tmp_path / "out", "--format", "chat") == 0
    (row,) = load_from_disk(str(tmp_path / "out"))["messages"][:]
    assert [(t["content"], t["weight"]) for t in row] == [
        ("q", None),
        ("skip me", "0"),
        ("q2", None),
        ("train me", None),
    ]
    assert summary_of(tmp_path / "out")["counts_by_reason"] == {"bad_turn_weight": 1, "no_assistant_turn": 1}
    # the stored shape read again (to_json and back): "0" is 0; a prompt's or a pair's turns are not weighed
    again = parse_conversation({"messages": [turns[0], {**turns[1], "weight": "0"}, turns[2], turns[3]]})
    assert [getattr(t, "weight", None) for t in again] == [None, "0", None, None]
    from fsdp_lib.records.prompts import parse_prompt_record

    assert parse_prompt_record({"prompt": [turns[0], {**turns[1], "weight": 0.5}, turns[2]]})


def test_reasoning_given_apart_from_the_content_is_stored_as_reasoning_content(tmp_path: Path) -> None:
    """A thinking model's trace given beside the reply (DeepSeek's and Qwen3's reasoning_content, OpenRouter's
    reasoning, gpt-oss's thinking) was dropped without a word: the dataset trained answers without their reasoning.
    Stored as the turn's reasoning_content (with tool calls too); not a string: a counted skip; blank: none."""
    q = {"role": "user", "content": "2+2?"}
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2}}}
    rows = [
        {"messages": [q, {"role": "assistant", "content": "4.", "reasoning_content": "Two and two make four."}]},
        {"messages": [q, {"role": "assistant", "content": "4.", "reasoning": "Add them."}]},
        {"messages": [q, {"role": "assistant", "content": "", "thinking": "Use the tool.", "tool_calls": [call]}]},
        {"messages": [q, {"role": "assistant", "content": "4.", "reasoning_content": " "}]},
        {"messages": [q, {"role": "assistant", "content": "4.", "reasoning_content": ["x"]}]},
    ]
    data = write_files(tmp_path / "data", {"r.jsonl": "".join(json.dumps(r) + "\n" for r in rows)})
    assert convert(data, tmp_path / "out", "--format", "chat") == 0
    stored = load_from_disk(str(tmp_path / "out"))["messages"][:]
    assert [row[1]["reasoning_content"] for row in stored] == [
        "Two and two make four.",
        "Add them.",
        "Use the tool.",
        None,
    ]
    assert stored[2][1]["tool_calls"] and stored[0][0]["reasoning_content"] is None
    assert summary_of(tmp_path / "out")["counts_by_reason"] == {"non_string_content": 1}


def test_auto_with_other_text_keeps_todays_text_and_suggests_format_chat(tmp_path: Path, capsys) -> None:
    data = write_files(
        tmp_path / "data",
        {
            "chat.jsonl": "".join(json.dumps(r) + "\n" for r in GOOD[:2]) + json.dumps({"messages": []}) + "\n",
            "notes.txt": "plain text",
        },
    )
    assert convert(data, tmp_path / "auto") == 0
    assert convert(data, tmp_path / "text", "--format", "text") == 0
    rows = rows_of(tmp_path / "auto")
    assert rows == rows_of(tmp_path / "text") == ["user", "2+2?", "assistant", "4.", "human", "Hi", "gpt", "Hello!",
                                                   "plain text"]  # fmt: skip
    summary = summary_of(tmp_path / "auto")
    assert summary["column"] == "text" and summary["counts_by_reason"] == {}  # the empty conversation is text too
    assert summary["conversation_records_as_text"] == 3
    assert summary["conversation_text_files"] == {str(data / "chat.jsonl"): 3}
    printed = capsys.readouterr().out
    assert "3 record(s) look like conversations" in printed and "--format chat" in printed
    assert "because the folder also holds other text" in printed


def test_auto_reads_json_like_text_does_when_nothing_is_a_conversation(tmp_path: Path) -> None:
    data = write_files(
        tmp_path / "data",
        {
            "cut.json": '{"title": "Half-written", "facts": ["kept", "Mount',  # a truncated top-level object
            "lines.json": '{"t": "a"}\n{"t": "b", "n": {"deep": "c"}}\n',  # JSON Lines saved as .json
            "conversations_as_json_lines.json": json.dumps(GOOD[3]) + "\n" + json.dumps(GOOD[4]) + "\n",
            "notes.txt": "text",
        },
    )
    for data_format in ("auto", "text"):
        assert convert(data, tmp_path / data_format, "--format", data_format) == 0
    assert rows_of(tmp_path / "auto") == rows_of(tmp_path / "text")
    assert "Half-written" in rows_of(tmp_path / "auto")  # the member before the malformed one, as in text runs
    assert summary_of(tmp_path / "auto")["conversation_records_as_text"] == 2  # each line of the .json is a record
    assert summary_of(tmp_path / "auto")["counts_by_reason"] == {"invalid_json": 1}


def test_format_chat_refuses_a_folder_without_conversations(tmp_path: Path, capsys) -> None:
    data = write_files(tmp_path / "data", {"a.txt": "text", "b.md": "# more"})
    assert convert(data, tmp_path / "out", "--format", "chat") == 1
    assert "no conversation files" in capsys.readouterr().err
    write_files(data, {"c.jsonl": json.dumps({"text": "not a conversation"}) + "\n"})
    assert convert(data, tmp_path / "out", "--format", "chat") == 1
    assert "no conversations were found" in capsys.readouterr().err
    assert convert(data, tmp_path / "out", "--format", "chat", "--strict") == 1
    assert sorted(os.listdir(tmp_path)) == ["data"]


def test_conversation_limits_aliases_and_surrogates(tmp_path: Path) -> None:
    long = {"prompt": "p" * 50, "completion": "c" * 60}
    data = write_files(
        tmp_path / "data",
        {
            "a.jsonl": json.dumps(long) + "\n" + '{"question": "bad \\udc80 half", "answer": "a"}\n',
            # the same record twice through an alias: read once (an equal record written out is read again)
            "b.yaml": "- &r {question: q, answer: a}\n- *r\n- {question: q, answer: a}\n",
        },
    )
    assert convert(data, tmp_path / "out", "--format", "chat", "--max-chars", "100") == 0
    rows = load_from_disk(str(tmp_path / "out"))["messages"][:]
    assert [row[0]["content"] for row in rows] == ["bad \ufffd half", "q", "q"]
    summary = summary_of(tmp_path / "out")
    assert summary["counts_by_reason"] == {"conversation_too_long": 1, "repeated_yaml_alias": 1}
    assert summary["rows_with_lone_surrogates_replaced"] == 1


def test_json_mode_records_keeps_one_row_per_record(tmp_path: Path, monkeypatch) -> None:
    data = write_files(
        tmp_path / "data",
        {
            "a.json": json.dumps([{"title": "T1", "body": {"p": ["x", "y"]}, "n": 1}, "bare", {"title": "T2"}]),
            "b.json": json.dumps({"title": "one object", "tags": ["a", " "]}),
            "c.jsonl": '{"t": "l1", "u": "l2"}\n{"n": 3}\n{"t": "l3"}\n',
            "d.yaml": "title: doc\nfacts: [f1, f2]\n---\n- {k: r1}\n- {k: r2, j: r3}\n",
        },
    )
    assert convert(data, tmp_path / "records", "--json-mode", "records") == 0
    assert rows_of(tmp_path / "records") == [
        "T1\nx\ny", "bare", "T2", "one object\na", "l1\nl2", "l3", "doc\nf1\nf2", "r1", "r2\nr3",
    ]  # fmt: skip
    assert convert(data, tmp_path / "strings", "--json-mode", "strings") == 0
    assert rows_of(tmp_path / "strings") == [
        "T1", "x", "y", "bare", "T2", "one object", "a", "l1", "l2", "l3", "doc", "f1", "f2", "r1", "r2", "r3",
    ]  # fmt: skip
    big = write_files(tmp_path / "big", {"big.json": json.dumps([{"a": f"r{i}", "b": "s"} for i in range(3000)])})
    monkeypatch.setattr(reading, "MIN_PIECE_BYTES", 1024)  # so the file is parsed as a stream, element by element
    spy = []
    monkeypatch.setattr(reading, "_scan_large_file", lambda path: spy.append(path) or (False, "utf-8-sig", None))
    streamed = read_file(big / "big.json", max_chars=100, json_mode="records")
    assert streamed.rows == [f"r{i}\ns" for i in range(3000)] and spy == [str(big / "big.json")]


# --- load_text_dataset --------------------------------------------------------------------------------------


def test_load_text_dataset_explains_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_text_dataset(tmp_path / "nothing")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="plain is not a saved dataset"):
        load_text_dataset(tmp_path / "plain")
    Dataset.from_dict({"content": ["x"]}).save_to_disk(str(tmp_path / "no_text"))
    with pytest.raises(ValueError, match="no_text: the train split has the columns \\['content'\\]"):
        load_text_dataset(tmp_path / "no_text")
    DatasetDict({"test": Dataset.from_dict({"text": ["x"]})}).save_to_disk(str(tmp_path / "no_train"))
    with pytest.raises(ValueError, match="no 'train' split"):
        load_text_dataset(tmp_path / "no_train")


# --- Stale temporaries and kill -9 --------------------------------------------------------------------------


def finished_pid() -> int:
    process = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(process.stdout)


def test_stale_temporaries_are_removed_and_an_aside_dataset_restored(tmp_path: Path) -> None:
    host, dead, alive = socket.gethostname(), finished_pid(), os.getpid()
    save_dir = tmp_path / "corpus"
    names = {
        "dead_tmp": f".corpus{TMP_TAG}{host}-{dead}-aaaa",
        "live_tmp": f".corpus{TMP_TAG}{host}-{alive}-bbbb",
        "other_host": f".corpus{TMP_TAG}elsewhere-{dead}-cccc",
        "dead_old": f".corpus{OLD_TAG}{host}-{dead}-dddd",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
    (tmp_path / names["dead_old"] / "state.json").write_text("{}")
    notes = clean_stale_temporaries(save_dir)
    assert (save_dir / "state.json").exists()  # the dataset an interrupted --overwrite had moved aside
    assert sorted(os.listdir(tmp_path)) == sorted(["corpus", names["live_tmp"], names["other_host"]])
    assert len(notes) == 2


def big_yaml_corpus(folder: Path, files: int = 24) -> Path:
    """About 0.5 MB of YAML per file: slow enough to parse (a few MB/s) that a run can be killed mid-way."""
    documents = [{"id": i, "body": f"record {i} " + "lorem ipsum dolor " * 20, "tags": ["a", "b"]} for i in range(1200)]
    text = yaml.safe_dump_all(documents)
    for index in range(files):
        write_files(folder, {f"part_{index:03d}.yaml": text})
    return folder


def run_and_kill_midway(command: list[str], tmp_root: Path, workers_expected: int = 0) -> None:
    """Start `command`, wait until it has written part of a shard, then kill -9 the main process only."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not any(tmp_root.glob(f".*{TMP_TAG}*/**/*.arrow.part")):
            assert process.poll() is None, "the run ended before it could be killed; make the corpus bigger"
            assert time.monotonic() < deadline
            time.sleep(0.01)
        children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
        workers = [int(pid) for pid in children if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]
        assert len(workers) == workers_expected
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        deadline = time.monotonic() + 30  # workers notice the parent is gone and exit on their own
        while any(
            Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
            for pid in workers
        ):
            assert time.monotonic() < deadline, f"worker processes {workers} outlived the killed parent"
            time.sleep(0.1)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # whatever is left of this run's own process group
        except ProcessLookupError:
            pass


@pytest.mark.slow
def test_kill_9_mid_run_leaves_no_dataset_and_a_rerun_succeeds(tmp_path: Path, repo_root: Path) -> None:
    data = big_yaml_corpus(tmp_path / "data", files=80)  # over PARALLEL_MIN_BYTES, so workers run
    out = tmp_path / "hf" / "corpus"
    cli = [sys.executable, str(repo_root / "data_hf.py"), "--save_dir", str(out), "--num-proc", "2"]
    run_and_kill_midway(cli + ["--data_folder", str(data)], out.parent, workers_expected=2)
    assert not out.exists()
    assert any(name.startswith(f".corpus{TMP_TAG}") for name in os.listdir(out.parent))  # the killed run's
    small = write_files(tmp_path / "small", {"a.txt": "after the crash"})
    assert subprocess.run(cli + ["--data_folder", str(small)], capture_output=True, timeout=300).returncode == 0
    assert rows_of(out) == ["after the crash"]
    assert os.listdir(out.parent) == ["corpus"]  # the stale temporary folder was cleaned


@pytest.mark.slow
def test_kill_9_during_overwrite_keeps_the_previous_dataset(tmp_path: Path, repo_root: Path) -> None:
    out = tmp_path / "hf" / "corpus"
    assert convert(write_files(tmp_path / "old", {"a.txt": "previous dataset"}), out) == 0
    data = big_yaml_corpus(tmp_path / "data")
    cli = [sys.executable, str(repo_root / "data_hf.py"), "--save_dir", str(out), "--overwrite", "--num-proc", "1"]
    run_and_kill_midway(cli + ["--data_folder", str(data)], out.parent)
    assert rows_of(out) == ["previous dataset"]
    assert load_text_dataset(out)[0]["text"] == ["previous dataset"]
    small = write_files(tmp_path / "small", {"a.txt": "new dataset"})
    assert subprocess.run(cli + ["--data_folder", str(small)], capture_output=True, timeout=300).returncode == 0
    assert rows_of(out) == ["new dataset"]
    assert os.listdir(out.parent) == ["corpus"]


@pytest.mark.parametrize(
    "error", [OSError(28, "No space left on device"), PermissionError(13, "Permission denied")], ids=str
)
def test_disk_full_or_no_permission_while_writing_is_one_message(tmp_path, monkeypatch, capsys, error):
    data = write_files(tmp_path / "data", {"a.txt": "hello world", "b.md": "# title\n\nbody"})

    def write_fails(self, chunk) -> None:
        raise error

    monkeypatch.setattr(SplitWriter, "write", write_fails)
    assert convert(data, tmp_path / "out") == 1
    err = capsys.readouterr().err
    assert err.count("data_hf: error:") == 1 and error.strerror in err and "rerun" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*")), "no output, no temporaries"
