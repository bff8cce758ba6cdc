"""Convert a folder of text, Markdown, JSON, JSON Lines and YAML files into a Hugging Face dataset.

    python data_hf.py --data_folder splits --save_dir hf_datasets/my_corpus
    python data_hf.py --data-folder raw_text --save-dir hf_datasets/my_corpus --val-fraction 0.01 --overwrite
    python data_hf.py --data-folder chat_data --save-dir hf_datasets/my_chat --format chat --val-fraction 0.01
    python data_hf.py --data-folder dpo_data --save-dir hf_datasets/my_pairs --format preference --val-fraction 0.01

The result is a `datasets.Dataset` (or, with --val-fraction, a `DatasetDict` with `train` and `validation`),
written with the layout of `save_to_disk` so `datasets.load_from_disk` and fsdp_train.py read it directly. It has
one column: `text` (a string), or with --format chat `messages` (a list of {"role", "content"} turns, Arrow type
list<struct<role: string, content: string>>, one conversation per record; see parse_conversation for the record
shapes), or with --format preference three: `prompt`, `chosen` and `rejected`, each a list of turns typed like
`messages`, one preference pair per record (the prompt ends with a user turn, each response starts with an
assistant turn; see parse_preference for the record shapes: TRL standard and conversational, UltraFeedback,
implicit prompt, Anthropic HH, ShareGPT, Alpaca). --format auto (the default) writes `messages` when every record
read is a conversation, the preference columns when every record read is a pair (chosen + rejected), else `text`.
Text rows, one per extracted string (--json-mode records: one per record):

- .txt / .md (and any extension not listed below): the file's text, split at blank lines when longer than
  --max-chars characters;
- .json: every string value, recursively through objects and arrays (keys, numbers and booleans are not text);
- .jsonl: the same for every line;
- .yaml / .yml: the same for every document (yaml safe loader only: no tag can execute code).

Bad input never crashes the run and never disappears silently: each skipped file, line or piece is counted by
reason in the summary printed at the end and saved as `data_hf_summary.json` inside the dataset folder.
The dataset is written to a hidden temporary folder beside --save_dir and renamed into place only when complete.
Loading a saved dataset (a data_hf.py folder or a cached hub dataset) is fsdp_lib/records/dataset.py, shared with the
trainer; this module imports it from there.
"""

from __future__ import annotations

import argparse
import codecs
import hashlib
import io
import json
import multiprocessing
import os
import re
import shutil
import socket
import stat
import sys
import threading
import time
import uuid
from array import array
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from tqdm import tqdm

from fsdp_lib.records.conversation import Conversation, ToolTurn, calls_json, conversation_json, parse_conversation
from fsdp_lib.records.dataset import load_text_dataset
from fsdp_lib.records.preference import PreferencePair, parse_preference, preference_json, record_kind
from fsdp_lib.records.reasons import RECORD_REASONS, BadRecord
from fsdp_lib.records.schema import DATASET_COLUMNS, PREFERENCE_COLUMNS, Turns, turn_fields
from fsdp_lib.records.text import extract_strings, split_long_text
from fsdp_lib.records.tool_calls import TURN_FIELDS

# pyarrow and datasets are imported inside the functions of the parent process that use them: every spawned worker
# imports this module, and pyarrow alone would add ~45 MB to each (datasets ~80 MB more, and a second of start-up).
if TYPE_CHECKING:
    import datasets
    import pyarrow as pa

# --- Constants ---------------------------------------------------------------------------------------------

DEFAULT_EXTENSIONS = (".txt", ".md", ".json", ".jsonl", ".yaml", ".yml")
KIND_BY_EXTENSION = {".json": "json", ".jsonl": "jsonl", ".ndjson": "jsonl", ".yaml": "yaml", ".yml": "yaml"}
DEFAULT_MAX_CHARS = 1_000_000
# A row of 100M characters is at most 400 MB of UTF-8: far from Arrow's 2 GiB limit for one string array.
MAX_MAX_CHARS = 100_000_000
# Files above this size are read in pieces (text, JSON Lines) or streamed (JSON, YAML) so that no process ever
# holds a whole large file; it grows with --max-chars so that a file of at most --max-chars characters
# (at most 4 bytes each) is never cut by a piece boundary.
MIN_PIECE_BYTES = 4 << 20
# Small files are grouped into tasks of about this much input so that per-task overhead stays negligible.
TASK_BYTES = 2 << 20
TASK_FILES = 256
# Same as datasets' save_to_disk default (config.MAX_SHARD_SIZE = "500MB").
SHARD_BYTES = 500_000_000
# Below this much input, worker processes (about a second each to start) would cost more than they save.
PARALLEL_MIN_BYTES = 32 << 20
# Results waiting to be written, per worker: bounds the parent's memory when one task is slow.
TASKS_IN_FLIGHT_PER_PROC = 2
# A boundary search looks this far for a blank line or newline before cutting a text piece hard.
ALIGN_WINDOW = 1 << 20
SUMMARY_NAME = "data_hf_summary.json"
MAX_LISTED = 1000  # per list in the summary; the counts are always complete
TMP_TAG = ".data_hf-tmp-"
OLD_TAG = ".data_hf-old-"

# Why a file, a line or a piece is skipped; a record's reasons are fsdp_lib/records/reasons.py's.
FILE_REASONS = {
    "empty_file": "the file is empty or holds only whitespace",
    "binary": "NUL bytes: a binary file (or UTF-16/UTF-32 text: convert it to UTF-8)",
    "invalid_json": "malformed JSON; the values before the error are kept",
    "invalid_jsonl_line": "a malformed line in a JSON Lines file; the other lines are kept",
    "invalid_yaml": "malformed YAML; the documents before the error are kept",
    "yaml_unsupported_tag": "a YAML tag the safe loader refuses (e.g. !!python/...); nothing was executed",
    "too_deep": "nested deeper than the JSON/YAML parser's recursion limit",
    "no_text": "parsed, but holds no string values",
    "read_error": "could not be read (permissions, broken link, not a regular file)",
    "text_file_in_chat_run": "a text file (not .json/.jsonl/.yaml) in a --format chat run: not read",
    "text_file_in_preference_run": "a text file (not .json/.jsonl/.yaml) in a --format preference run: not read",
}
REASONS = {**FILE_REASONS, **RECORD_REASONS}

# Rows travel from workers as the two buffers of an Arrow string array: UTF-8 bytes and int32 offsets (Arrow's
# little-endian layout, native on x86 and ARM). Chunks stay under 2 GiB so the offsets cannot overflow.
_INT32 = next(code for code in "ilh" if array(code).itemsize == 4)
CHUNK_BYTES = 1 << 30
_BLANK_LINE_BYTES = re.compile(rb"\n[ \t\r]*\n")
_SURROGATE = re.compile("[\ud800-\udfff]")
_JSON_DECODER = json.JSONDecoder()
# The C loader is about 10x faster; both construct with SafeConstructor, so no tag can run code.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
# libyaml's composer, behind CSafeLoader, recurses in C once per nesting level and kills the process (a segfault,
# not an exception) somewhere between 10,000 and 100,000 levels with an 8 MB stack. A text that might nest deeper
# than YAML_C_MAX_DEPTH goes to the pure-Python loader instead, whose recursion ends in a RecursionError.
YAML_C_MAX_DEPTH = 2000
# Block nesting needs indentation or "- ", "? ", ": " indicators at the start of a line; a run of them that is
# cut by a chunk boundary is caught in one of its halves, hence a quarter of the limit per chunk.
_YAML_DEEP_BLOCK = re.compile(rb"^(?:[ \t]|[-?:][ \t]){%d}" % (YAML_C_MAX_DEPTH // 4), re.M)
_FLOW_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
_NOT_FLOW_BRACKET = bytes(sorted(set(range(256)) - set(_FLOW_STEP)))

DATA_FORMATS = ("auto", "text", "chat", "preference")
# The formats whose every record is parsed as one row (no text is extracted), and the kind of dataset each writes.
RECORD_FORMATS = {"chat": "messages", "preference": "preference"}
JSON_MODES = ("strings", "records")
# Per piece of a file, the bad records listed with their detail; past this they are only counted.
RECORD_PROBLEMS_LISTED = MAX_LISTED


# --- Pure extraction -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """Something that was skipped: a file, a JSON Lines line, a piece of a large file, or the tail of a document."""

    path: str
    reason: str  # a key of REASONS
    detail: str
    line: int | None = None

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line is not None else self.path
        return f"{where}: {self.reason}: {self.detail}"


@dataclass
class FileResult:
    """What reading one file (or one piece of a large file) gave."""

    path: str
    rows: list[Row] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    bytes_read: int = 0
    strings_found: int = 0  # extracted strings (--json-mode records: records) before splitting and filtering
    conversations_found: int = 0  # conversation rows (--format chat or auto)
    pairs_found: int = 0  # preference pairs (--format preference or auto)
    records_seen: int = 0  # JSON/YAML records looked at, to number the bad ones
    conversation_shaped_as_text: int = 0  # records that look like conversations, extracted as text
    preference_shaped_as_text: int = 0  # records with chosen + rejected, extracted as text
    rows_from_conversations: int = 0  # of the text rows kept, those from conversation or preference records (auto)
    unlisted_problems: Counter[str] = field(default_factory=Counter)  # bad records past RECORD_PROBLEMS_LISTED
    # auto: bad conversation or preference records, problems only if the run writes conversations or pairs
    pending_chat_problems: list[Problem] = field(default_factory=list)
    unlisted_chat_problems: Counter[str] = field(default_factory=Counter)
    rows_kept: int = 0  # len(rows), kept when rows are sent separately as Arrow data
    dropped_empty: int = 0  # empty or whitespace-only strings
    dropped_short: int = 0  # rows under --min-chars
    extra_rows_from_splitting: int = 0
    fallback_encoding: str | None = None  # set when the bytes were not UTF-8
    newlines: int = 0  # lines in a JSON Lines piece, to number the lines of the next piece
    piece: int = 0
    pieces: int = 1

    @property
    def skipped_reason(self) -> str | None:
        """The reason nothing was kept from this file, or None if rows were kept or nothing went wrong."""
        if self.strings_found or self.conversations_found or self.pairs_found or not self.problems:
            return None
        return self.problems[0].reason

    def skip_record(self, problem: Problem, pending: bool = False) -> None:
        """Count a bad record; the first RECORD_PROBLEMS_LISTED are kept with their detail, so that a file of a
        million records that are not conversations does not hold a million problems in memory. `pending`: an
        auto run's bad conversation or pair, a problem only if the run writes rows of its kind."""
        listed, unlisted = (
            (self.pending_chat_problems, self.unlisted_chat_problems) if pending
            else (self.problems, self.unlisted_problems)
        )  # fmt: skip
        if len(listed) < RECORD_PROBLEMS_LISTED:
            listed.append(problem)
        else:
            unlisted[problem.reason] += 1


def assign_split(text: str, val_fraction: float) -> str:
    """ "validation" for a stable `val_fraction` share of texts, else "train". Depends only on the text, so reruns
    give the same split and duplicates of a text never straddle train and validation."""
    if val_fraction <= 0:
        return "train"
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return "validation" if int.from_bytes(digest, "big") / 2**64 < val_fraction else "train"


def decode_bytes(data: bytes, *, at_file_start: bool) -> tuple[str, str | None]:
    """Text of `data` and the fallback encoding used (None for UTF-8): UTF-8 (a BOM at the file start dropped),
    else Windows-1252, else Latin-1, which decodes any bytes, so legacy text is read rather than dropped."""
    try:
        return data.decode("utf-8-sig" if at_file_start else "utf-8"), None
    except UnicodeDecodeError:
        pass
    try:
        return data.decode("cp1252"), "cp1252"
    except UnicodeDecodeError:  # cp1252 leaves five byte values undefined
        return data.decode("latin-1"), "latin-1"


class JsonStreamError(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class _JsonReader:
    """JSON text read incrementally: the buffer holds what is left of the current chunk, and grows only while one
    value longer than a chunk is being decoded."""

    def __init__(self, read: Callable[[int], str]) -> None:
        self._read = read
        self.buf = ""
        self.pos = 0
        self.eof = False
        self._lines_before = 0  # in text already dropped from the buffer, for error positions
        self._chars_before = 0

    def fill(self, size: int = 1 << 20) -> None:
        more = self._read(size)
        if not more:
            self.eof = True
            return
        self._lines_before += self.buf.count("\n", 0, self.pos)
        self._chars_before += self.pos
        self.buf, self.pos = self.buf[self.pos :] + more, 0

    def error(self, reason: str, message: str, pos: int) -> JsonStreamError:
        line = self._lines_before + self.buf.count("\n", 0, pos) + 1
        return JsonStreamError(reason, f"{message} at line {line} (char {self._chars_before + pos})")

    def peek(self) -> str:
        """The next non-whitespace character, or "" at the end of the input."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if self.eof:
                return ""
            self.fill()

    def expect(self, allowed: str, message: str) -> str:
        char = self.peek()
        if not char or char not in allowed:
            found = repr(char) if char else "end of data (truncated file?)"
            raise self.error("invalid_json", f"{message}, found {found}", self.pos)
        self.pos += 1
        return char

    def value(self) -> object:
        if not self.peek():
            raise self.error("invalid_json", "Expecting value, found end of data (truncated file?)", self.pos)
        size = 1 << 20
        while True:
            try:
                result, end = _JSON_DECODER.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as err:
                # A value cut by the end of the buffer looks malformed: read more and retry. Errors far from the
                # end are real (a string cannot hold a raw newline, so an unterminated one stops at its line).
                if not self.eof and (err.pos >= len(self.buf) - 16 or err.msg.startswith("Unterminated")):
                    size = min(size * 2, 64 << 20)
                    self.fill(size)
                    continue
                raise self.error("invalid_json", err.msg, err.pos) from None
            except RecursionError:
                raise self.error("too_deep", "nesting too deep for the JSON parser", self.pos) from None
            except ValueError as err:  # e.g. an integer over Python's 4300-digit conversion limit
                raise self.error("invalid_json", str(err), self.pos) from None
            if end >= len(self.buf) and not self.eof:  # a number may go on in the next chunk
                self.fill(size)
                continue
            self.pos = end
            return result


def iter_json_values(read: Callable[[int], str], *, whole_objects: bool = False) -> Iterator[object]:
    """The top-level values of a JSON text read incrementally with `read(n)`: the elements of a top-level array,
    the member values of a top-level object (the object itself with `whole_objects`), or the value itself.
    Several top-level values one after another (JSON Lines saved as .json) are all read. Memory holds one element,
    not the whole document.

    Raises JsonStreamError after yielding every value before the first malformed or too deeply nested one.
    """
    reader = _JsonReader(read)
    while opener := reader.peek():
        if opener not in "[{" or (opener == "{" and whole_objects):
            yield reader.value()
            continue
        closer = "]" if opener == "[" else "}"
        reader.pos += 1
        if reader.peek() == closer:
            reader.pos += 1
            continue
        while True:
            if opener == "{":
                if reader.peek() != '"':  # only a string can start a key: expect() raises with the position
                    reader.expect('"', "Expecting property name enclosed in double quotes")
                reader.value()  # the key: not text
                reader.expect(":", "Expecting ':' delimiter")
            yield reader.value()
            if reader.expect("," + closer, f"Expecting ',' or '{closer}'") == closer:
                break


# What a task yields: a text row, a conversation (--format chat) or a preference pair (--format preference).
Row = str | Conversation | PreferencePair
# --- Reading one file ---------------------------------------------------------------------------------------


def file_kind(path: str | Path) -> str:
    """How a file is parsed: "json", "jsonl", "yaml", or "text" for every other extension."""
    return KIND_BY_EXTENSION.get(Path(path).suffix.lower(), "text")


def piece_bytes_for(max_chars: int) -> int:
    return max(MIN_PIECE_BYTES, 4 * max_chars)


def _align(fh: io.BufferedReader, offset: int, size: int, kind: str) -> int:
    """The piece boundary for a nominal byte offset: just after the next blank line (text) or newline (JSON Lines,
    or text without blank lines). Both neighbouring pieces compute it the same way, so pieces tile the file."""
    if offset <= 0 or offset >= size:
        return max(0, min(offset, size))
    fh.seek(offset)
    window = fh.read(ALIGN_WINDOW)
    if kind == "text":
        match = _BLANK_LINE_BYTES.search(window)
        if match:
            return offset + match.end()
    position, chunk = offset, window
    while chunk:
        newline = chunk.find(b"\n")
        if newline >= 0:
            return position + newline + 1
        if kind == "text":  # no line break in a whole window: cut hard, but not inside a UTF-8 sequence
            skip = 0
            while skip < 3 and skip < len(window) and 0x80 <= window[skip] <= 0xBF:
                skip += 1
            return offset + skip
        position += len(chunk)  # a JSON Lines line is never cut: look further
        chunk = fh.read(ALIGN_WINDOW)
    return size


def _read_bytes(path: str, kind: str, start: int, end: int | None) -> tuple[int, bytes]:
    """(offset, bytes) of the piece [start, end) after boundary alignment; the whole file when end is None."""
    with open(path, "rb") as fh:
        if start == 0 and end is None:
            return 0, fh.read()
        size = os.fstat(fh.fileno()).st_size
        first = _align(fh, start, size, kind)
        last = size if end is None or end >= size else _align(fh, end, size, kind)
        if last <= first:
            return first, b""
        fh.seek(first)
        return first, fh.read(last - first)


class YamlDepthBound:
    """A loose upper bound on the nesting depth of YAML bytes fed chunk by chunk: flow brackets counted as if none
    were inside quotes, plus the longest run of indentation and block indicators starting a line. Loose on purpose:
    it only decides which loader is safe, never what is read."""

    def __init__(self) -> None:
        self.flow, self.deepest_flow, self.deep_block = 0, 0, False

    def feed(self, chunk: bytes) -> None:
        self.deep_block = self.deep_block or _YAML_DEEP_BLOCK.search(chunk) is not None
        brackets = chunk.translate(None, _NOT_FLOW_BRACKET)
        if brackets:
            depths = list(accumulate(map(_FLOW_STEP.__getitem__, brackets), initial=self.flow))
            self.flow, self.deepest_flow = depths[-1], max(self.deepest_flow, max(depths))

    def may_exceed(self, limit: int = YAML_C_MAX_DEPTH) -> bool:
        return self.deep_block or self.deepest_flow + limit // 2 > limit


def _yaml_loader(depth: YamlDepthBound) -> type:
    return yaml.SafeLoader if depth.may_exceed() else _YAML_LOADER


def _scan_large_file(path: str) -> tuple[bool, str, YamlDepthBound]:
    """(has NUL bytes, encoding to open it with, YAML depth bound) for a file too large to decode in memory."""
    utf8 = codecs.getincrementaldecoder("utf-8")()
    is_utf8, is_cp1252, has_nul = True, True, False
    depth = YamlDepthBound()
    with open(path, "rb") as fh:
        while chunk := fh.read(MIN_PIECE_BYTES):
            depth.feed(chunk)
            has_nul = has_nul or b"\x00" in chunk
            is_cp1252 = is_cp1252 and not re.search(rb"[\x81\x8d\x8f\x90\x9d]", chunk)
            if is_utf8:
                try:
                    utf8.decode(chunk)
                except UnicodeDecodeError:
                    is_utf8 = False
    if is_utf8:
        try:
            utf8.decode(b"", final=True)
        except UnicodeDecodeError:
            is_utf8 = False
    return has_nul, "utf-8-sig" if is_utf8 else "cp1252" if is_cp1252 else "latin-1", depth


@dataclass(frozen=True)
class Extraction:
    """What a value parsed from JSON, JSON Lines or YAML gives: text rows (--json-mode strings: one per string;
    records: one per record, its strings joined by newlines), conversations (--format chat, or auto for
    conversation-shaped records) or preference pairs (--format preference, or auto for records with chosen and
    rejected). A record is an element of a top-level JSON array, a top-level JSON object, a JSON Lines line, a YAML
    document, or an element of a YAML document that is a list."""

    data_format: str = "text"  # one of DATA_FORMATS
    json_mode: str = "strings"  # one of JSON_MODES
    max_chars: int = DEFAULT_MAX_CHARS

    @property
    def whole_records(self) -> bool:
        """Whether a top-level JSON object must be parsed whole, as one record."""
        return self.data_format != "text" or self.json_mode == "records"

    def items(
        self, value: object, result: FileResult, *, split_lists: bool, yaml_document: bool = False,
        line: int | None = None,
    ) -> Iterator[Row]:  # fmt: skip
        """Rows of one parsed value. `split_lists`: a list value holds records (a whole JSON document, a YAML
        document). `yaml_document`: the value is a YAML document, whose aliases are followed once."""
        if self.data_format == "text" and self.json_mode == "strings" and not isinstance(value, (dict, list)):
            yield from extract_strings(value)  # the common scalar case, without the record bookkeeping below
            return
        records = value if split_lists and isinstance(value, list) else (value,)
        strings_seen: set[int] | None = None
        records_seen: set[int] | None = None
        if yaml_document:  # aliases: each container is read once; the document itself counts as read
            strings_seen, records_seen = {id(value)} if records is value else set(), set()
        for record in records:
            result.records_seen += 1
            if self.data_format in RECORD_FORMATS:
                row = self._row(record, self.data_format, result, records_seen, line)
                if row is not None:
                    yield row
                continue
            if isinstance(record, str):
                yield record  # the text of a bare string record in either --json-mode: no bookkeeping needed
                continue
            kind = record_kind(record)
            if kind == "preference":
                result.preference_shaped_as_text += 1
            elif kind == "chat":
                result.conversation_shaped_as_text += 1
            if kind is not None and self.data_format == "auto":
                row = self._row(record, kind, result, records_seen, line)
                if row is not None:
                    yield row
            texts = self._texts(record, strings_seen)
            # auto: the text of a conversation or pair is kept only if the run turns out to be a text run (see Tally)
            yield from (map(ConversationText, texts) if kind is not None and self.data_format == "auto" else texts)

    def _texts(self, record: object, strings_seen: set[int] | None) -> Iterator[str]:
        strings = extract_strings(record, track_shared=strings_seen is not None, seen=strings_seen)
        if self.json_mode == "strings":
            yield from strings
            return
        held = list(strings)  # a record's strings: the row is built from them anyway
        if held:  # a record without strings gives no row; one of blank strings an empty row, counted as dropped
            yield "\n".join(string for string in held if string.strip())

    def _row(
        self, record: object, kind: str, result: FileResult, records_seen: set[int] | None, line: int | None
    ) -> Conversation | PreferencePair | None:
        """The conversation ("chat") or preference pair ("preference") of a record; None, with the bad record
        counted, if it cannot be one."""
        try:
            if records_seen is not None and isinstance(record, dict):
                if id(record) in records_seen:
                    raise BadRecord("repeated_yaml_alias", "an alias to a record already read")
                records_seen.add(id(record))
            row = parse_preference(record) if kind == "preference" else parse_conversation(record)
            chars = row_chars(row)
            if chars > self.max_chars:
                too_long = "pair_too_long" if kind == "preference" else "conversation_too_long"
                raise BadRecord(too_long, f"{chars} characters > --max-chars {self.max_chars}")
        except BadRecord as err:
            where = "" if line is not None else f"record {result.records_seen}: "
            result.skip_record(Problem(result.path, err.reason, where + err.detail, line), self.data_format == "auto")
            return None
        return row


def row_chars(row: Row) -> int:
    """Characters of a row: of a text, of a conversation's contents, or of a pair's three columns."""
    if isinstance(row, str):
        return len(row)
    if isinstance(row, PreferencePair):
        return row.chars
    chars = sum(len(turn[1]) for turn in row)
    if not getattr(row, "uses_tools", False):
        return chars
    return chars + sum(len(calls_json(turn) or "") for turn in row) + len(row.tools or "")


class ConversationText(str):
    """A string of a conversation or preference record in an auto run: counted apart, because it is kept only if
    the run writes text; if every record is a conversation (or a pair) the run writes those instead."""


def _json_items(
    read: Callable[[int], str], result: FileResult, extraction: Extraction, whole_objects: bool
) -> Iterator[Row]:
    count = 0
    try:
        for item in iter_json_values(read, whole_objects=whole_objects):
            count += 1
            yield from extraction.items(item, result, split_lists=False)
    except JsonStreamError as err:
        kept = f"; read {count} value(s) before it" if count else ""
        result.problems.append(Problem(result.path, err.reason, err.detail + kept))


def _yaml_items(stream: str | io.TextIOBase, loader: type, result: FileResult, extraction: Extraction) -> Iterator[Row]:
    documents = yaml.load_all(stream, Loader=loader)
    count = 0
    while True:
        try:
            document = next(documents)
        except StopIteration:
            return
        except RecursionError:
            reason, detail = "too_deep", "nesting too deep for the YAML parser"
        except yaml.YAMLError as err:
            unsupported = isinstance(err, yaml.constructor.ConstructorError) and "for the tag" in str(err)
            reason = "yaml_unsupported_tag" if unsupported else "invalid_yaml"
            detail = " ".join(str(err).split())
        else:
            count += 1
            yield from extraction.items(document, result, split_lists=True, yaml_document=True)
            continue
        kept = f"; read {count} document(s) before it" if count else ""
        result.problems.append(Problem(result.path, reason, detail + kept))
        return


def _jsonl_items(data: bytes, result: FileResult, extraction: Extraction) -> Iterator[Row]:
    """Rows of every line of JSON Lines bytes. Lines are parsed from bytes (json.loads decodes UTF-8 and drops a
    BOM itself), so the piece is never held a second time as text; a line that is not UTF-8 is decoded like a
    legacy text file."""
    result.newlines = data.count(b"\n")
    start, number = 0, 0
    while start < len(data):
        end = data.find(b"\n", start)
        end = len(data) if end < 0 else end
        line, start, number = data[start:end], end + 1, number + 1
        if not line or line.isspace():
            continue
        try:
            try:
                value = json.loads(line)
            except UnicodeDecodeError:
                text, result.fallback_encoding = decode_bytes(line, at_file_start=False)
                value = json.loads(text)
        except RecursionError:
            result.problems.append(Problem(result.path, "too_deep", "nesting too deep for the JSON parser", number))
            continue
        except ValueError as err:
            result.problems.append(Problem(result.path, "invalid_jsonl_line", str(err), number))
            continue
        yield from extraction.items(value, result, split_lists=False, line=number)


def _items_in_memory(
    kind: str, text: str, yaml_loader: type, result: FileResult, extraction: Extraction
) -> Iterator[Row]:
    if kind == "text":
        yield text
    elif kind == "yaml":
        yield from _yaml_items(text, yaml_loader, result, extraction)
    else:
        try:  # the fast path; the streaming parser below keeps what comes before an error
            value = json.loads(text)
        except (ValueError, RecursionError):
            # Several values one after another (JSON Lines saved as .json), or a malformed file. Top-level objects
            # are records only if they all parse (or with --format chat or preference): a truncated object is read
            # member by member, as --format text always does, so that its values before the error are kept.
            whole = extraction.data_format in RECORD_FORMATS or (extraction.whole_records and _parses(text))
            yield from _json_items(io.StringIO(text).read, result, extraction, whole)
        else:
            yield from extraction.items(value, result, split_lists=True)


def _parses(text: str) -> bool:
    """Whether every top-level value of a JSON text parses (values are not kept: memory stays that of the text)."""
    try:
        for _ in iter_json_values(io.StringIO(text).read, whole_objects=True):
            pass
    except JsonStreamError:
        return False
    return True


def _items_streamed(kind: str, path: str, result: FileResult, extraction: Extraction) -> Iterator[Row]:
    """Rows of a large JSON or YAML file, parsed from the open file one element or document at a time. A top-level
    JSON object is read member by member here, whatever the mode, so that memory stays flat."""
    has_nul, encoding, depth = _scan_large_file(path)
    result.bytes_read = os.path.getsize(path)
    if has_nul:
        result.problems.append(Problem(path, "binary", "the file contains NUL bytes"))
        return
    if encoding != "utf-8-sig":
        result.fallback_encoding = encoding
    with open(path, encoding=encoding, newline="") as fh:
        if kind == "json":
            yield from _json_items(fh.read, result, extraction, whole_objects=False)
        else:
            yield from _yaml_items(fh, _yaml_loader(depth), result, extraction)


def _raw_items(
    path: str, kind: str, start: int, end: int | None, extraction: Extraction, result: FileResult
) -> Iterator[Row]:
    whole = start == 0 and end is None
    if kind in ("json", "yaml") and whole and os.path.getsize(path) > piece_bytes_for(extraction.max_chars):
        yield from _items_streamed(kind, path, result, extraction)
        return
    offset, data = _read_bytes(path, kind, start, end)
    result.bytes_read = len(data)
    if b"\x00" in data:
        where = "the file contains" if whole else f"bytes {offset}-{offset + len(data)} contain"
        result.problems.append(Problem(path, "binary", f"{where} NUL bytes"))
        return
    if whole and (not data or data.isspace()):
        result.problems.append(Problem(path, "empty_file", "0 bytes" if not data else "only whitespace"))
        return
    if kind == "jsonl":
        yield from _jsonl_items(data, result, extraction)
        return
    depth = YamlDepthBound()
    if kind == "yaml":
        depth.feed(data)
    text, result.fallback_encoding = decode_bytes(data, at_file_start=offset == 0)
    del data  # a piece is held once, as text
    yield from _items_in_memory(kind, text, _yaml_loader(depth), result, extraction)


def iter_rows(
    path: str | Path,
    result: FileResult,
    max_chars: int = DEFAULT_MAX_CHARS,
    min_chars: int = 0,
    start: int = 0,
    end: int | None = None,
    *,
    data_format: str = "text",
    json_mode: str = "strings",
) -> Iterator[Row]:
    """Rows of one file (or of the piece [start, end) of a large one), recording problems and counts in `result`:
    text rows (str), conversations and preference pairs. A generator, so a large JSON or YAML file is never held
    whole."""
    extraction = Extraction(data_format, json_mode, max_chars)
    try:
        for item in _raw_items(str(path), file_kind(path), start, end, extraction, result):
            if isinstance(item, PreferencePair):
                result.pairs_found += 1
                yield item
                continue
            if not isinstance(item, str):
                result.conversations_found += 1
                yield item
                continue
            result.strings_found += 1
            from_conversation = isinstance(item, ConversationText)
            rows = split_long_text(item, max_chars) if len(item) > max_chars else (item,)
            result.extra_rows_from_splitting += len(rows) - 1
            for row in rows:
                if not row or row.isspace():
                    result.dropped_empty += 1
                elif min_chars and (len(row) < min_chars or len(row.strip()) < min_chars):
                    result.dropped_short += 1
                else:
                    result.rows_from_conversations += from_conversation
                    yield str(row)
    except OSError as err:
        result.problems.append(Problem(str(path), "read_error", err.strerror or str(err)))


def read_file(
    path: str | Path,
    max_chars: int = DEFAULT_MAX_CHARS,
    min_chars: int = 0,
    start: int = 0,
    end: int | None = None,
    *,
    data_format: str = "text",
    json_mode: str = "strings",
) -> FileResult:
    """All rows of one file (or of the piece [start, end) of a large one) with what was skipped and why."""
    result = FileResult(path=str(path))
    modes = {"data_format": data_format, "json_mode": json_mode}
    result.rows = list(iter_rows(path, result, max_chars, min_chars, start, end, **modes))
    result.rows_kept = len(result.rows)
    if start == 0 and end is None:
        _note_no_text(result)
    return result


def _note_no_text(result: FileResult) -> None:
    """A whole file that parsed fine but held no string at all gets a problem, so it does not vanish silently."""
    if not (result.strings_found or result.conversations_found or result.pairs_found or result.problems):
        result.problems.append(Problem(result.path, "no_text", REASONS["no_text"]))


# --- Finding and planning the work --------------------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """One file, or one byte range of a large text/JSON Lines file (end None: to the end of the file)."""

    path: str
    size: int
    start: int = 0
    end: int | None = None
    index: int = 0
    count: int = 1


@dataclass(frozen=True)
class Task:
    """Pieces read together by one worker. A streamed task (one large JSON/YAML file) runs in the parent so its
    rows are written as they are parsed instead of being collected in a worker."""

    pieces: tuple[Piece, ...]
    streamed: bool = False


@dataclass(frozen=True)
class Options:
    max_chars: int
    min_chars: int
    val_fraction: float
    data_format: str = "text"  # --format
    json_mode: str = "strings"  # --json-mode


def normalize_extensions(values: Iterable[str]) -> tuple[str, ...]:
    """ ".txt", "txt", "txt,md" -> lower-case suffixes with a dot, duplicates dropped, order kept."""
    found: dict[str, None] = {}
    for value in values:
        for part in value.split(","):
            part = part.strip().lower()
            if part:
                found["." + part.lstrip(".")] = None
    return tuple(found)


def find_input_files(
    root: Path, extensions: Iterable[str], exclude: Iterable[Path] = ()
) -> tuple[list[tuple[Path, int]], list[Problem]]:
    """(path, size) of every file under `root` with one of `extensions`, sorted by path, and the problems met.

    Hidden files and folders (name starting with ".") are skipped; symlinks are followed, but each folder is
    entered once, so link loops end. Folders in `exclude` (the output) are never entered.
    """
    wanted = set(extensions)
    if root.is_file():
        return [(root, root.stat().st_size)], []
    problems: list[Problem] = []
    excluded = {(s.st_dev, s.st_ino) for s in (_stat_or_none(p) for p in exclude) if s is not None}
    visited: set[tuple[int, int]] = set()
    found: list[tuple[Path, int]] = []

    def on_error(err: OSError) -> None:
        problems.append(Problem(str(err.filename), "read_error", f"folder not readable: {err.strerror}"))

    for folder, subfolders, names in os.walk(root, followlinks=True, onerror=on_error):
        identity = _stat_or_none(Path(folder))
        if identity is None or (identity.st_dev, identity.st_ino) in visited:
            subfolders[:] = []  # a link loop, or a folder already reached through another link
            continue
        visited.add((identity.st_dev, identity.st_ino))
        keep = []
        for name in sorted(subfolders):
            sub = _stat_or_none(Path(folder, name))
            if not name.startswith(".") and (sub is None or (sub.st_dev, sub.st_ino) not in excluded):
                keep.append(name)
        subfolders[:] = keep
        for name in names:
            if name.startswith(".") or Path(name).suffix.lower() not in wanted:
                continue
            path = Path(folder, name)
            try:
                info = path.stat()
            except OSError as err:
                problems.append(Problem(str(path), "read_error", f"{err.strerror} (a broken link?)"))
                continue
            if not stat.S_ISREG(info.st_mode):
                problems.append(Problem(str(path), "read_error", "not a regular file"))
                continue
            found.append((path, info.st_size))
    found.sort(key=lambda item: item[0].relative_to(root).parts)
    return found, problems


def _stat_or_none(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except OSError:
        return None


def plan_tasks(files: Iterable[tuple[Path, int]], piece_bytes: int) -> list[Task]:
    """Group small files into tasks of about TASK_BYTES, cut large text and JSON Lines files into pieces of
    `piece_bytes`, and stream large JSON and YAML files. File order is kept, so the output order is too."""
    tasks: list[Task] = []
    group: list[Piece] = []
    group_bytes = 0
    for path, size in files:
        if size <= piece_bytes:
            group.append(Piece(str(path), size))
            group_bytes += size
            if group_bytes >= TASK_BYTES or len(group) >= TASK_FILES:
                tasks.append(Task(tuple(group)))
                group, group_bytes = [], 0
            continue
        if group:
            tasks.append(Task(tuple(group)))
            group, group_bytes = [], 0
        if file_kind(path) in ("json", "yaml"):
            tasks.append(Task((Piece(str(path), size),), streamed=True))
            continue
        count = -(-size // piece_bytes)
        for index in range(count):
            end = None if index == count - 1 else (index + 1) * piece_bytes
            tasks.append(Task((Piece(str(path), size, index * piece_bytes, end, index, count),)))
    if group:
        tasks.append(Task(tuple(group)))
    return tasks


# --- Running the work ---------------------------------------------------------------------------------------


@dataclass
class EncodedRows:
    """Rows as the buffers of an Arrow array, built without pyarrow (which is also ~7x faster than pa.array for
    non-ASCII text) and wrapped into an array by the parent without a copy. A `text` chunk is one string array; a
    `messages` chunk is a list array whose `offsets` index the messages, with the roles and contents of all its
    messages as two string arrays (and `values` empty); a `preference` chunk is three `messages` chunks of the
    same rows, one per column in PREFERENCE_COLUMNS (and `offsets` and `values` empty). A chat chunk also holds
    its turns' tool fields (TURN_FIELDS) and its rows' `tools`, string arrays with nulls (`validity`)."""

    count: int
    offsets: bytes  # count + 1 int32 offsets into values (text) or into the messages (messages)
    values: bytes  # the rows' UTF-8 bytes, back to back
    digest: bytes  # blake2b of every buffer, for the dataset fingerprint
    column: str = "text"  # a key of DATASET_COLUMNS
    roles: EncodedRows | None = None
    contents: EncodedRows | None = None
    fields: tuple[EncodedRows, ...] = ()  # preference: the prompt, chosen and rejected chunks
    validity: bytes | None = None  # a string array's null bitmap (Arrow's: bit i set = row i is not null)
    turn_fields: tuple[EncodedRows, ...] = ()  # messages: tool_calls, name, tool_call_id of every turn
    tools: EncodedRows | None = None  # messages: the `tools` column of the rows

    @property
    def text_bytes(self) -> int:
        parts = (self.roles, self.contents, *self.fields, *self.turn_fields, self.tools)
        return len(self.values) + sum(part.text_bytes for part in parts if part is not None)


@dataclass
class TaskOutput:
    """Rows of a task per split, and its per-piece results (rows removed: they travel encoded)."""

    splits: dict[str, list[EncodedRows]]
    files: list[FileResult]
    rows_with_surrogates: int = 0


def _utf8(strings: list[str]) -> tuple[list[bytes], int]:
    """UTF-8 of `strings` and how many had lone surrogates (from JSON "\\udXXX" escapes, which have no UTF-8
    form) replaced by U+FFFD."""
    try:
        return [string.encode("utf-8") for string in strings], 0
    except UnicodeEncodeError:
        replaced = sum(1 for string in strings if _SURROGATE.search(string))
        return [_SURROGATE.sub("\ufffd", string).encode("utf-8") for string in strings], replaced


def _chunk_bounds(sizes: list[int]) -> list[int]:
    """Row indices that cut rows of `sizes` bytes into chunks under CHUNK_BYTES (Arrow's int32 offsets)."""
    if sum(sizes) < CHUNK_BYTES:
        return [0, len(sizes)]
    bounds, size = [0], 0  # rare: a task's text over 1 GiB, e.g. with a huge --max-chars
    for index, row_size in enumerate(sizes):
        if size + row_size >= CHUNK_BYTES and index > bounds[-1]:
            bounds.append(index)
            size = 0
        size += row_size
    bounds.append(len(sizes))
    return bounds


def _string_chunk(encoded: list[bytes]) -> EncodedRows:
    offsets = array(_INT32, accumulate(map(len, encoded), initial=0)).tobytes()
    values = b"".join(encoded)
    digest = hashlib.blake2b(offsets, digest_size=16)
    digest.update(values)
    return EncodedRows(len(encoded), offsets, values, digest.digest())


def _null_chunk(count: int) -> EncodedRows:
    """A string array chunk of `count` nulls: zero offsets, no values, a bitmap of zeros."""
    offsets, validity = bytes(4 * (count + 1)), bytes((count + 7) // 8)
    digest = hashlib.blake2b(offsets + validity, digest_size=16).digest()
    return EncodedRows(count, offsets, b"", digest, validity=validity)


def _nullable_chunk(strings: list[str | None]) -> EncodedRows:
    """A string array chunk whose None entries are nulls."""
    if not any(value is not None for value in strings):
        return _null_chunk(len(strings))
    bitmap = bytearray((len(strings) + 7) // 8)
    for index, value in enumerate(strings):
        if value is not None:
            bitmap[index >> 3] |= 1 << (index & 7)
    validity = bytes(bitmap)
    chunk = _string_chunk(_utf8(["" if value is None else value for value in strings])[0])
    digest = hashlib.blake2b(chunk.digest + validity, digest_size=16).digest()
    return EncodedRows(chunk.count, chunk.offsets, chunk.values, digest, validity=validity)


def encode_rows(rows: list[str]) -> tuple[list[EncodedRows], int]:
    """(Arrow-layout chunks of `rows`, number of rows whose lone surrogates were replaced by U+FFFD)."""
    encoded, replaced = _utf8(rows)
    bounds = _chunk_bounds(list(map(len, encoded)))
    return [_string_chunk(encoded[first:last]) for first, last in zip(bounds, bounds[1:], strict=False)], replaced


def _messages_chunk(conversations: list[Turns], contents: list[bytes], with_tools: bool = True) -> EncodedRows:
    """One `messages` chunk of `conversations`, whose contents are already UTF-8 (`contents`, in order); a chat
    chunk (`with_tools`) with the turns' tool fields and the rows' tools, a preference column's without."""
    roles = _string_chunk([turn[0].encode() for conversation in conversations for turn in conversation])
    texts = _string_chunk(contents)
    offsets = array(_INT32, accumulate(map(len, conversations), initial=0)).tobytes()
    turn_fields: tuple[EncodedRows, ...] = ()
    tools = None
    if with_tools and not any(getattr(conversation, "uses_tools", False) for conversation in conversations):
        turn_fields = tuple(_null_chunk(roles.count) for _ in TURN_FIELDS)
        tools = _null_chunk(len(conversations))
    elif with_tools:
        tool_turns = [
            turn if isinstance(turn, ToolTurn) else None for conversation in conversations for turn in conversation
        ]
        turn_fields = tuple(
            _nullable_chunk([None if turn is None else getattr(turn, name) for turn in tool_turns])
            for name in TURN_FIELDS
        )
        tools = _nullable_chunk([getattr(conversation, "tools", None) for conversation in conversations])
    parts = b"".join(part.digest for part in (roles, texts, *turn_fields, *([tools] if tools else [])))
    digest = hashlib.blake2b(offsets + parts, digest_size=16).digest()
    return EncodedRows(
        len(conversations), offsets, b"", digest, "messages", roles, texts, turn_fields=turn_fields, tools=tools
    )


def _encoded_contents(conversations: list[Turns]) -> tuple[list[bytes], list[int], int]:
    """(UTF-8 of every content, index of each conversation's first content and one past the end, number of
    contents whose lone surrogates were replaced)."""
    contents, replaced = _utf8([turn[1] for conversation in conversations for turn in conversation])
    return contents, list(accumulate(map(len, conversations), initial=0)), replaced


def encode_conversations(conversations: list[Conversation]) -> tuple[list[EncodedRows], int]:
    """(Arrow-layout chunks of a `messages` column, number of messages whose lone surrogates were replaced)."""
    contents, ends, replaced = _encoded_contents(conversations)
    bounds = _chunk_bounds([sum(map(len, contents[ends[i] : ends[i + 1]])) for i in range(len(conversations))])
    chunks = [
        _messages_chunk(conversations[first:last], contents[ends[first] : ends[last]])
        for first, last in zip(bounds, bounds[1:], strict=False)
    ]
    return chunks, replaced


def encode_pairs(pairs: list[PreferencePair]) -> tuple[list[EncodedRows], int]:
    """(Arrow-layout chunks of the prompt, chosen and rejected columns, number of messages whose lone surrogates
    were replaced). The three columns of a chunk hold the same rows, so a chunk is one record batch."""
    columns = [[getattr(pair, name) for pair in pairs] for name in PREFERENCE_COLUMNS]
    encoded = [_encoded_contents(conversations) for conversations in columns]
    sizes = [
        sum(sum(map(len, contents[ends[i] : ends[i + 1]])) for contents, ends, _ in encoded) for i in range(len(pairs))
    ]
    bounds = _chunk_bounds(sizes)
    chunks = []
    for first, last in zip(bounds, bounds[1:], strict=False):
        fields = tuple(
            _messages_chunk(conversations[first:last], contents[ends[first] : ends[last]], with_tools=False)
            for conversations, (contents, ends, _) in zip(columns, encoded, strict=True)
        )
        digest = hashlib.blake2b(b"".join(part.digest for part in fields), digest_size=16).digest()
        chunks.append(EncodedRows(last - first, b"", b"", digest, "preference", fields=fields))
    return chunks, sum(replaced for _, _, replaced in encoded)


def row_split(row: Row, val_fraction: float) -> str:
    """The split of a text row, or of a conversation or preference pair by the hash of its canonical JSON."""
    if isinstance(row, str):
        return assign_split(row, val_fraction)
    if isinstance(row, PreferencePair):
        return assign_split(preference_json(row), val_fraction)
    return assign_split(conversation_json(row), val_fraction)


def _rows_to_output(rows: list[Row], files: list[FileResult], val_fraction: float) -> TaskOutput:
    by_split: dict[str, list[Row]] = {"train": rows}
    if val_fraction > 0:
        by_split = {"train": [], "validation": []}
        for row in rows:
            by_split[row_split(row, val_fraction)].append(row)
    output = TaskOutput(splits={}, files=files)
    for split, split_rows in by_split.items():
        texts = [row for row in split_rows if isinstance(row, str)]
        conversations = [row for row in split_rows if isinstance(row, tuple)]
        pairs = [row for row in split_rows if isinstance(row, PreferencePair)]
        output.splits[split], replaced = encode_rows(texts)
        for encode, kept in ((encode_conversations, conversations), (encode_pairs, pairs)):
            if kept:
                chunks, replaced_in_messages = encode(kept)
                output.splits[split] += chunks
                replaced += replaced_in_messages
        output.rows_with_surrogates += replaced
    return output


def process_task(task: Task, options: Options) -> TaskOutput:
    """Read every piece of a task (runs in a worker process)."""
    rows: list[Row] = []
    files = []
    for piece in task.pieces:
        modes = {"data_format": options.data_format, "json_mode": options.json_mode}
        result = read_file(piece.path, options.max_chars, options.min_chars, piece.start, piece.end, **modes)
        result.piece, result.pieces = piece.index, piece.count
        rows.extend(result.rows)
        result.rows = []
        files.append(result)
    return _rows_to_output(rows, files, options.val_fraction)


def _stream_task(task: Task, options: Options) -> Iterator[TaskOutput]:
    """Rows of a large JSON or YAML file in outputs of about MIN_PIECE_BYTES characters (runs in the parent)."""
    piece = task.pieces[0]
    result = FileResult(path=piece.path)
    rows: list[Row] = []
    size = 0
    modes = {"data_format": options.data_format, "json_mode": options.json_mode}
    for row in iter_rows(piece.path, result, options.max_chars, options.min_chars, **modes):
        rows.append(row)
        result.rows_kept += 1
        size += row_chars(row)
        if size >= MIN_PIECE_BYTES:
            yield _rows_to_output(rows, [], options.val_fraction)
            rows, size = [], 0
    _note_no_text(result)
    yield _rows_to_output(rows, [result], options.val_fraction)


def run_tasks(tasks: list[Task], options: Options, num_proc: int) -> Iterator[TaskOutput]:
    """Outputs of `tasks` in task order. Workers run at most TASKS_IN_FLIGHT_PER_PROC tasks each ahead of the
    writer, so memory stays bounded however large the corpus is."""
    if num_proc <= 1 or sum(not task.streamed for task in tasks) <= 1:
        for task in tasks:
            yield from _stream_task(task, options) if task.streamed else [process_task(task, options)]
        return
    # spawn, not fork: the parent may hold pyarrow threads, and forking a threaded process can deadlock.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(num_proc, context, initializer=_exit_with_parent, initargs=(os.getpid(),)) as pool:
        pending: deque[Future[TaskOutput] | Task] = deque()
        try:
            for task in tasks:
                pending.append(task if task.streamed else pool.submit(process_task, task, options))
                while len(pending) > num_proc * TASKS_IN_FLIGHT_PER_PROC:
                    yield from _resolve(pending.popleft(), options)
            while pending:
                yield from _resolve(pending.popleft(), options)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise


def _exit_with_parent(parent_pid: int) -> None:
    """Worker initializer: if the parent is killed (kill -9 skips every cleanup), the workers would wait for tasks
    forever, because each of them holds the task queue open; a watcher thread ends the worker instead."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="data_hf-parent-watch", daemon=True).start()


def _resolve(item: Future[TaskOutput] | Task, options: Options) -> Iterator[TaskOutput]:
    if isinstance(item, Task):
        yield from _stream_task(item, options)
    else:
        yield item.result()


# --- Writing the dataset ------------------------------------------------------------------------------------


class SplitWriter:
    """Writes one split as Arrow stream shards plus the state.json/dataset_info.json that `save_to_disk` would
    write, streaming batch by batch: nothing is memory-mapped back, so memory does not grow with the output."""

    def __init__(self, folder: Path, column: str = "text", shard_bytes: int = SHARD_BYTES) -> None:
        import pyarrow as pa

        self._pa = pa
        # A plain Arrow schema: datasets takes the features from dataset_info.json (written from its own template)
        # and infers them from the Arrow type, so nothing version-specific is written by hand.
        self.column = column  # the kind of dataset, a key of DATASET_COLUMNS
        self.schema = pa.schema([pa.field(name, arrow_type(name)) for name in DATASET_COLUMNS[column]])
        self.folder = folder  # where the shards are written; finish() moves them to the split's folder
        self.shard_bytes = shard_bytes
        self.rows = 0
        self.text_bytes = 0
        self.digest = hashlib.blake2b(digest_size=8)
        self._parts: list[Path] = []
        self._writer: pa.ipc.RecordBatchStreamWriter | None = None
        self._sink: pa.NativeFile | None = None
        self._shard_size = 0
        folder.mkdir(parents=True, exist_ok=True)

    def write(self, chunk: EncodedRows) -> None:
        if chunk.count == 0:
            return
        if chunk.column != self.column:
            raise ValueError(f"a {chunk.column!r} chunk cannot go into a {self.column!r} column")
        pa = self._pa
        if self._writer is None:
            part = self.folder / f"data-{len(self._parts):05d}.arrow.part"
            self._parts.append(part)
            self._sink = pa.OSFile(str(part), "wb")
            self._writer = pa.ipc.new_stream(self._sink, self.schema)
            self._shard_size = 0
        self._writer.write_batch(pa.record_batch(self._arrays(chunk), schema=self.schema))
        self.rows += chunk.count
        self.text_bytes += chunk.text_bytes
        self.digest.update(chunk.digest)
        self._shard_size += chunk.text_bytes + len(chunk.offsets)
        if self._shard_size >= self.shard_bytes:
            self._close_shard()

    def _arrays(self, chunk: EncodedRows) -> list[pa.Array]:
        """The chunk's columns, in schema order: one array, a chat chunk's messages and tools, or a preference
        chunk's three."""
        parts = chunk.fields or ((chunk, chunk.tools) if chunk.tools is not None else (chunk,))
        return [self._array(part, schema_field.type) for part, schema_field in zip(parts, self.schema, strict=True)]

    def _strings(self, chunk: EncodedRows) -> pa.Array:
        pa = self._pa
        bitmap = None if chunk.validity is None else pa.py_buffer(chunk.validity)
        return pa.StringArray.from_buffers(chunk.count, pa.py_buffer(chunk.offsets), pa.py_buffer(chunk.values), bitmap)

    def _array(self, chunk: EncodedRows, list_type: pa.DataType) -> pa.Array:
        """The chunk's buffers wrapped as an Arrow array, without a copy."""
        pa = self._pa
        if chunk.roles is None or chunk.contents is None:
            return self._strings(chunk)
        turns = [self._strings(part) for part in (chunk.roles, chunk.contents, *chunk.turn_fields)]
        messages = pa.StructArray.from_arrays(turns, fields=list(list_type.value_type))
        offsets = pa.Array.from_buffers(pa.int32(), chunk.count + 1, [None, pa.py_buffer(chunk.offsets)])
        return pa.ListArray.from_arrays(offsets, messages, type=list_type)

    def discard(self) -> None:
        """Drop what was written (the column --format auto did not choose)."""
        self._close_shard()
        _remove(self.folder)

    def _close_shard(self) -> None:
        if self._writer is not None and self._sink is not None:
            self._writer.close()
            self._sink.close()
        self._writer = self._sink = None

    def finish(self, folder: Path, state_template: dict[str, Any], info_template: dict[str, Any]) -> None:
        """Close the last shard, move the shards into `folder` under their final names and write the metadata
        load_from_disk reads there."""
        self._close_shard()
        folder.mkdir(parents=True, exist_ok=True)
        if not self._parts:  # an empty split still needs one shard holding the schema
            part = self.folder / "data-00000.arrow.part"
            with self._pa.OSFile(str(part), "wb") as sink, self._pa.ipc.new_stream(sink, self.schema):
                pass
            self._parts.append(part)
        names = []
        for index, part in enumerate(self._parts):
            name = f"data-{index:05d}-of-{len(self._parts):05d}.arrow"
            part.rename(folder / name)
            names.append({"filename": name})
        if self.folder != folder:
            _remove(self.folder)
        # The templates come from datasets' own save_to_disk, so only the two fields it fills from the data change.
        state = dict(state_template, _data_files=names, _fingerprint=self.digest.hexdigest())
        (folder / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
        (folder / "dataset_info.json").write_text(json.dumps(info_template, indent=2, sort_keys=True) + "\n")


def arrow_type(column: str) -> pa.DataType:
    """The Arrow type of a column: `text` and `tools` a string; `messages` list<struct<role, content, tool_calls,
    name, tool_call_id: string>>; a preference dataset's `prompt`, `chosen`, `rejected` list<struct<role: string,
    content: string>>: the types datasets gives the features of column_features."""
    import pyarrow as pa

    if column in ("text", "tools"):
        return pa.string()
    return pa.list_(pa.struct([pa.field(name, pa.string()) for name in turn_fields(column)]))


def column_features(column: str) -> datasets.Features:
    """The datasets features of a dataset of the kind `column` ("text"; "messages": messages and tools; or
    "preference": the columns prompt, chosen and rejected, lists of role/content turns)."""
    import datasets

    features = {}
    for name in DATASET_COLUMNS[column]:
        if name in ("text", "tools"):
            features[name] = datasets.Value("string")
        else:
            features[name] = datasets.List({field: datasets.Value("string") for field in turn_fields(name)})
    return datasets.Features(features)


def _metadata_templates(scratch: Path, splits: list[str], column: str = "text") -> dict[str, dict[str, Any]]:
    """The JSON metadata files of an empty dataset with `splits`, keyed by relative path ("state.json",
    "train/state.json", "dataset_dict.json", ...), exactly as the installed datasets version's save_to_disk
    writes them. Saved in `scratch`, inside the temporary output folder, so no cache is left anywhere."""
    import datasets

    features = column_features(column)
    progress_was_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        columns: dict[str, list] = {name: [] for name in features}
        if splits == ["train"]:
            datasets.Dataset.from_dict(columns, features=features).save_to_disk(str(scratch))
        else:
            empty = {split: datasets.Dataset.from_dict(columns, features=features, split=split) for split in splits}
            datasets.DatasetDict(empty).save_to_disk(str(scratch))
    finally:
        if progress_was_on:
            datasets.enable_progress_bars()
    templates = {path.relative_to(scratch).as_posix(): json.loads(path.read_text()) for path in scratch.rglob("*.json")}
    shutil.rmtree(scratch)
    return templates


# --- The run summary ----------------------------------------------------------------------------------------


@dataclass
class Tally:
    """Counts for the summary, fed file by file in output order."""

    files_found: int = 0
    files_read: int = 0
    files_with_text: int = 0
    files_with_conversations: int = 0
    files_with_pairs: int = 0
    files_skipped: int = 0
    conversations_found: int = 0
    pairs_found: int = 0
    conversation_shaped_as_text: int = 0
    preference_shaped_as_text: int = 0
    rows_from_conversations: int = 0
    plain_text_rows: int = 0  # text rows not from conversation or preference records; set by convert()
    # files with conversation-shaped (preference) records extracted as text, and how many (the first MAX_LISTED)
    conversation_text_files: dict[str, int] = field(default_factory=dict)
    preference_text_files: dict[str, int] = field(default_factory=dict)
    pending_chat_problems: list[Problem] = field(default_factory=list)
    unlisted_chat_problems: Counter[str] = field(default_factory=Counter)
    bytes_read: int = 0
    strings_found: int = 0
    dropped_empty: int = 0
    dropped_short: int = 0
    extra_rows_from_splitting: int = 0
    rows_with_surrogates: int = 0
    counts_by_reason: Counter[str] = field(default_factory=Counter)
    skipped_files: list[dict[str, Any]] = field(default_factory=list)
    problems: list[dict[str, Any]] = field(default_factory=list)
    fallback_decoded: dict[str, str] = field(default_factory=dict)
    fallback_decoded_pieces: int = 0
    _current: FileResult | None = None
    _rows_in_file: int = 0
    _lines_before: int = 0

    def add_problem(self, problem: Problem, *, skipped_file: bool = False) -> None:
        self.counts_by_reason[problem.reason] += 1
        entry = {"path": problem.path, "reason": problem.reason, "detail": problem.detail}
        if problem.line is not None:
            entry["line"] = problem.line
        target = self.skipped_files if skipped_file else self.problems
        if len(target) < MAX_LISTED:
            target.append(entry)

    def add_piece(self, result: FileResult) -> None:
        """Merge the result of one piece; pieces of a file arrive consecutively, in order."""
        if result.piece == 0:
            self._current, self._rows_in_file, self._lines_before = FileResult(path=result.path), 0, 0
        file = self._current
        if file is None:
            raise RuntimeError(f"piece {result.piece} of {result.path} arrived before piece 0")
        for problem in result.problems:
            line = None if problem.line is None else problem.line + self._lines_before
            file.problems.append(Problem(problem.path, problem.reason, problem.detail, line))
        self._lines_before += result.newlines
        self._rows_in_file += result.rows_kept
        file.strings_found += result.strings_found
        file.conversations_found += result.conversations_found
        file.pairs_found += result.pairs_found
        file.conversation_shaped_as_text += result.conversation_shaped_as_text
        file.preference_shaped_as_text += result.preference_shaped_as_text
        self.rows_from_conversations += result.rows_from_conversations
        self.counts_by_reason.update(result.unlisted_problems)
        for problem in result.pending_chat_problems:
            line = None if problem.line is None else problem.line + self._lines_before - result.newlines
            if len(self.pending_chat_problems) < MAX_LISTED:
                self.pending_chat_problems.append(Problem(problem.path, problem.reason, problem.detail, line))
            else:
                self.unlisted_chat_problems[problem.reason] += 1
        self.unlisted_chat_problems.update(result.unlisted_chat_problems)
        for name in ("bytes_read", "dropped_empty", "dropped_short", "extra_rows_from_splitting"):
            setattr(self, name, getattr(self, name) + getattr(result, name))
        if result.fallback_encoding:
            self.fallback_decoded_pieces += 1
            if len(self.fallback_decoded) < MAX_LISTED:
                self.fallback_decoded.setdefault(result.path, result.fallback_encoding)
        if result.piece == result.pieces - 1:
            if result.pieces > 1:  # read_file already judged single-piece files
                _note_no_text(file)
            self._finish_file(file)

    def adopt_chat_problems(self) -> None:
        """An auto run that writes conversations (or pairs): its bad conversation (or preference) records become
        problems. Only one kind is pending then: choose_column writes either kind only when no record of the
        other kind was read."""
        for problem in self.pending_chat_problems:
            self.add_problem(problem)
        self.counts_by_reason.update(self.unlisted_chat_problems)

    def _finish_file(self, file: FileResult) -> None:
        self.strings_found += file.strings_found
        self.conversations_found += file.conversations_found
        self.pairs_found += file.pairs_found
        self.conversation_shaped_as_text += file.conversation_shaped_as_text
        self.preference_shaped_as_text += file.preference_shaped_as_text
        self.files_with_text += self._rows_in_file > file.conversations_found + file.pairs_found
        self.files_with_conversations += file.conversations_found > 0
        self.files_with_pairs += file.pairs_found > 0
        if file.conversation_shaped_as_text and len(self.conversation_text_files) < MAX_LISTED:
            self.conversation_text_files[file.path] = file.conversation_shaped_as_text
        if file.preference_shaped_as_text and len(self.preference_text_files) < MAX_LISTED:
            self.preference_text_files[file.path] = file.preference_shaped_as_text
        skipped = file.skipped_reason is not None
        self.files_skipped += skipped
        for index, problem in enumerate(file.problems):
            self.add_problem(problem, skipped_file=skipped and index == 0)


def _summary(
    tally: Tally, args: argparse.Namespace, writers: dict[str, SplitWriter], column: str, seconds: float
) -> dict[str, Any]:
    rows = {split: writer.rows for split, writer in writers.items()}
    text = column == "text"  # the text counters describe rows that a conversation dataset does not hold
    files_with_rows = {"messages": tally.files_with_conversations, "preference": tally.files_with_pairs}
    return {
        "data_folder": str(args.data_folder),
        "save_dir": str(args.save_dir),
        "column": column,  # the kind of dataset: text, messages or preference
        "columns": list(DATASET_COLUMNS[column]),
        "notes": _format_notes(tally, args.data_format, column),
        "options": {
            "format": args.data_format,
            "json_mode": args.json_mode,
            "extensions": list(args.extensions),
            "max_chars": args.max_chars,
            "min_chars": args.min_chars,
            "val_fraction": args.val_fraction,
            "strict": args.strict,
        },
        "files_found": tally.files_found,
        "files_read": tally.files_read,
        "files_with_rows": files_with_rows.get(column, tally.files_with_text),
        "files_skipped": tally.files_skipped,
        "bytes_read": tally.bytes_read,
        "rows": rows,
        "rows_total": sum(rows.values()),
        "text_bytes": sum(writer.text_bytes for writer in writers.values()),
        "strings_found": tally.strings_found if text else 0,
        "conversations_found": tally.conversations_found,
        "pairs_found": tally.pairs_found,
        "conversation_records_as_text": tally.conversation_shaped_as_text if text else 0,
        "conversation_text_files": tally.conversation_text_files if text else {},
        "preference_records_as_text": tally.preference_shaped_as_text if text else 0,
        "preference_text_files": tally.preference_text_files if text else {},
        "dropped_empty_strings": tally.dropped_empty if text else 0,
        "dropped_below_min_chars": tally.dropped_short if text else 0,
        "extra_rows_from_splitting": tally.extra_rows_from_splitting if text else 0,
        "rows_with_lone_surrogates_replaced": tally.rows_with_surrogates,
        "counts_by_reason": dict(sorted(tally.counts_by_reason.items())),
        "skipped_files": tally.skipped_files,
        "problems": tally.problems,
        "fallback_decoded_files": tally.fallback_decoded,
        "fallback_decoded_pieces": tally.fallback_decoded_pieces,
        "content_digest": {split: writer.digest.hexdigest() for split, writer in writers.items()},
        "seconds": round(seconds, 3),
        "reasons": {reason: REASONS[reason] for reason in sorted(tally.counts_by_reason)},
    }


def _format_notes(tally: Tally, data_format: str, column: str) -> list[str]:
    """What the user should know about conversations and preference pairs in this run (printed, and saved in the
    summary)."""
    if column == "messages" and data_format == "auto":
        return [
            f"--format auto: every record read is a conversation, so the dataset has a 'messages' column "
            f"({tally.conversations_found} conversations), as --format chat writes; pass --format text to extract "
            "their strings as text instead"
        ]
    if column == "preference" and data_format == "auto":
        return [
            f"--format auto: every record read is a preference pair (chosen + rejected), so the dataset has the "
            f"columns {', '.join(PREFERENCE_COLUMNS)} ({tally.pairs_found} pairs), as --format preference writes; pass "
            "--format text to extract their strings as text instead"
        ]
    if column != "text":
        return []
    why = ""
    if data_format == "auto" and tally.plain_text_rows:
        why = " because the folder also holds other text"
    elif data_format == "auto" and tally.conversation_shaped_as_text and tally.preference_shaped_as_text:
        why = " because the folder mixes conversations and preference pairs"
    notes = []
    if tally.conversation_shaped_as_text:
        files = ", ".join(list(tally.conversation_text_files)[:3])
        notes.append(
            f"{tally.conversation_shaped_as_text} record(s) look like conversations (messages, conversations, "
            f"instruction/output, prompt/completion, question/answer; e.g. in {files}) and were extracted as text{why}. "
            "To fine-tune on them as chat, convert them on their own: python data_hf.py --format chat --data_folder "
            "<their folder> --save_dir <new dataset>"
        )
    if tally.preference_shaped_as_text:
        files = ", ".join(list(tally.preference_text_files)[:3])
        notes.append(
            f"{tally.preference_shaped_as_text} record(s) look like preference pairs (chosen + rejected; e.g. in "
            f"{files}) and were extracted as text{why}. To train on them with DPO, convert them on their own: python "
            "data_hf.py --format preference --data_folder <their folder> --save_dir <new dataset>"
        )
    return notes


def _print_summary(summary: dict[str, Any], shown: int = 20) -> None:
    """Each skipped file with its reason, the other problems and the counts by reason (all of them, up to
    MAX_LISTED each, are in the JSON summary)."""
    for title, entries in (("skipped files", summary["skipped_files"]), ("other problems", summary["problems"])):
        if not entries:
            continue
        print(f"data_hf: {title}:")
        for entry in entries[:shown]:
            where = f"{entry['path']}:{entry['line']}" if "line" in entry else entry["path"]
            print(f"  {where}: {entry['reason']}: {entry['detail']}")
        if len(entries) > shown:
            print(f"  ... {len(entries) - shown} more listed in {SUMMARY_NAME}")
    for path, encoding in list(summary["fallback_decoded_files"].items())[:shown]:
        print(f"data_hf: note: {path} is not UTF-8; decoded as {encoding}")
    for note in summary["notes"]:
        print(f"data_hf: note: {note}")


def _one_line(summary: dict[str, Any]) -> str:
    megabytes = summary["bytes_read"] / 1e6
    speed = megabytes / summary["seconds"] if summary["seconds"] else 0.0
    rows = summary["rows"]
    split_text = f" (train {rows['train']}, validation {rows['validation']})" if "validation" in rows else ""
    counts = summary["counts_by_reason"]
    reasons = f" ({', '.join(f'{reason} {count}' for reason, count in counts.items())})" if counts else ""
    unit = {"messages": "conversations", "preference": "preference pairs"}.get(summary["column"], "rows")
    return (
        f"data_hf: {summary['files_found']} files, {megabytes:.1f} MB -> {summary['rows_total']} {unit}{split_text} "
        f"in {summary['seconds']:.1f} s ({speed:.1f} MB/s); {summary['files_skipped']} files skipped, "
        f"{sum(counts.values())} problems{reasons}"
    )


# --- Output folder: atomic publish and stale temporaries ----------------------------------------------------


class DataHfError(Exception):
    """A problem the user can fix; main() prints it and exits 1."""


def _occupied(save_dir: Path) -> bool:
    """True if something is at `save_dir` that writing there would replace (an empty folder does not count)."""
    if save_dir.is_dir() and not save_dir.is_symlink():
        return any(save_dir.iterdir())
    return save_dir.exists() or save_dir.is_symlink()


def _looks_like_output(folder: Path) -> bool:
    names = ("state.json", "dataset_dict.json", SUMMARY_NAME)
    return any((folder / name).is_file() for name in names) or not any(folder.iterdir())


def _owner_pid(name: str, prefix: str, host: str) -> int | None:
    """The pid in a temporary folder name made by this host, else None (another host's run: leave it alone)."""
    parts = name[len(prefix) :].rsplit("-", 2)
    if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
        return None
    return int(parts[1])


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def clean_stale_temporaries(save_dir: Path) -> list[str]:
    """Deal with the folders a killed run left beside `save_dir`: a dataset that an interrupted --overwrite had
    moved aside is moved back if `save_dir` is missing, and unfinished outputs are deleted. Folders of runs
    still alive, or made on another host, are left alone. Returns what was done."""
    parent, host, notes = save_dir.parent, socket.gethostname(), []
    if not parent.is_dir():
        return notes
    for tag in (OLD_TAG, TMP_TAG):  # old first: restoring beats deleting a complete new output
        prefix = f".{save_dir.name}{tag}"
        for name in sorted(n for n in os.listdir(parent) if n.startswith(prefix)):
            pid = _owner_pid(name, prefix, host)
            if pid is None or _is_running(pid):
                continue
            stale = parent / name
            if tag == OLD_TAG and not (save_dir.exists() or save_dir.is_symlink()):
                stale.rename(save_dir)
                notes.append(f"restored {save_dir} from {name}, moved aside by an interrupted --overwrite run")
            else:
                _remove(stale)
                notes.append(f"removed {name}, left by an interrupted run (pid {pid})")
    return notes


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def publish(tmp: Path, save_dir: Path, run_id: str) -> None:
    """Move the finished `tmp` to `save_dir`. An existing dataset is moved aside first and deleted only after the
    new one is in place, so at every instant a complete dataset exists (or is restored by the next run)."""
    if not (save_dir.exists() or save_dir.is_symlink()):
        os.rename(tmp, save_dir)
        return
    aside = save_dir.parent / f".{save_dir.name}{OLD_TAG}{run_id}"
    os.rename(save_dir, aside)
    try:
        os.rename(tmp, save_dir)
    except BaseException:
        os.rename(aside, save_dir)
        raise
    _remove(aside)


# --- Command line -------------------------------------------------------------------------------------------


def _available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="data_hf.py",
        description="Convert text/Markdown/JSON/JSONL/YAML files into a Hugging Face dataset with one 'text' column "
        "(plain text), one 'messages' column (conversations) or 'prompt', 'chosen' and 'rejected' columns "
        "(preference pairs, for DPO).",
    )
    parser.add_argument(
        "--data_folder", "--data-folder", dest="data_folder", type=Path, required=True,
        help="folder to read recursively (e.g. the splits/ of organize_data.py, or the raw folder itself); "
        "hidden files and folders are skipped",
    )  # fmt: skip
    parser.add_argument(
        "--save_dir", "--save-dir", dest="save_dir", type=Path, required=True,
        help="output folder for datasets.load_from_disk (e.g. hf_datasets/my_corpus); must not exist unless --overwrite",
    )  # fmt: skip
    parser.add_argument(
        "--extensions", nargs="+", default=list(DEFAULT_EXTENSIONS), metavar="EXT",
        help=f"extensions to read, space- or comma-separated (default: {' '.join(DEFAULT_EXTENSIONS)}); .json, .jsonl, .ndjson, .yaml "
        "and .yml are parsed, any other extension is read as plain text",
    )  # fmt: skip
    parser.add_argument(
        "--format", dest="data_format", choices=DATA_FORMATS, default="auto",
        help="text: a 'text' column; chat: a 'messages' column, one conversation per record (messages, ShareGPT "
        "conversations, instruction/input/output, prompt/completion, question/answer; .txt/.md are skipped); "
        "preference: 'prompt', 'chosen' and 'rejected' columns (lists of messages), one pair per record with chosen "
        "and rejected (beside prompt, ShareGPT conversations, or instruction; or alone as whole conversations or "
        "Anthropic HH strings whose shared start is the prompt; .txt/.md are skipped); auto: chat if every record "
        "read is a conversation, preference if every one is a pair, else text, with a note counting them "
        "(default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--json-mode", "--json_mode", dest="json_mode", choices=JSON_MODES, default="strings",
        help="text from JSON/JSONL/YAML: strings, one row per string value; records, one row per record (array "
        "element, top-level object, line, YAML document) with its strings joined by newlines (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--max-chars", "--max_chars", dest="max_chars", type=int, default=DEFAULT_MAX_CHARS,
        help="longest row in characters; longer text is split at blank lines, else at newlines; a longer "
        "conversation or preference pair is skipped (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--min-chars", "--min_chars", dest="min_chars", type=int, default=0,
        help="drop rows shorter than this many characters, leading/trailing whitespace not counted (default: 0); "
        "empty and whitespace-only strings are always dropped",
    )  # fmt: skip
    parser.add_argument(
        "--val-fraction", "--val_fraction", dest="val_fraction", type=float, default=0.0,
        help="share of rows for a 'validation' split, chosen by a hash of the text (of a conversation or a "
        "preference pair: of its JSON) so reruns agree; writes a "
        "DatasetDict with 'train' and 'validation' (default: 0, a single Dataset)",
    )  # fmt: skip
    parser.add_argument(
        "--num-proc", "--num_proc", dest="num_proc", type=int, default=_available_cores(),
        help="worker processes reading files (default: the cores available, %(default)s); inputs under 32 MB are "
        "read in the main process, where starting workers would cost more than they save",
    )  # fmt: skip
    parser.add_argument(
        "--overwrite", action="store_true",
        help="replace an existing --save_dir; the old dataset is removed only after the new one is complete",
    )  # fmt: skip
    parser.add_argument(
        "--strict", action="store_true",
        help="fail (exit 1, nothing written) if anything was skipped: a bad file, a bad JSONL line, ...",
    )  # fmt: skip
    return parser


def validate_args(args: argparse.Namespace) -> list[str]:
    """Every problem with the flags, each naming the flag and the fix."""
    errors = []
    if not args.data_folder.exists():
        errors.append(f"--data_folder {args.data_folder} does not exist; pass the folder that holds your files")
    if not args.extensions:
        errors.append(f"--extensions is empty; e.g. --extensions {' '.join(DEFAULT_EXTENSIONS)}")
    if not 1 <= args.max_chars <= MAX_MAX_CHARS:
        errors.append(f"--max-chars {args.max_chars} must be between 1 and {MAX_MAX_CHARS}")
    if args.min_chars < 0:
        errors.append(f"--min-chars {args.min_chars} must be 0 or more")
    elif args.min_chars > args.max_chars:
        errors.append(f"--min-chars {args.min_chars} exceeds --max-chars {args.max_chars}: every row would be dropped")
    if not 0.0 <= args.val_fraction < 1.0:
        errors.append(f"--val-fraction {args.val_fraction} must be in [0, 1), e.g. 0.01")
    if args.num_proc < 1:
        errors.append(f"--num-proc {args.num_proc} must be 1 or more")
    save_dir = args.save_dir
    if _occupied(save_dir):
        if not save_dir.is_dir():
            errors.append(f"--save_dir {save_dir} exists and is not a folder; choose another --save_dir")
        elif not args.overwrite:
            errors.append(
                f"--save_dir {save_dir} already exists; pass --overwrite to replace it, or choose another path"
            )
        elif not _looks_like_output(save_dir):
            errors.append(
                f"--save_dir {save_dir} is not a dataset written by data_hf.py (no state.json, dataset_dict.json or "
                f"{SUMMARY_NAME}); refusing to delete it even with --overwrite: choose another --save_dir"
            )
        elif args.data_folder.exists() and args.data_folder.resolve().is_relative_to(save_dir.resolve()):
            errors.append(
                f"--data_folder {args.data_folder} is inside --save_dir {save_dir}, which --overwrite replaces"
            )
    return errors


def _record_inputs(files: list[tuple[Path, int]], data_format: str) -> tuple[list[tuple[Path, int]], list[Problem]]:
    """With --format chat or preference, text files are not read (they cannot hold conversations or pairs): each is
    a skipped file."""
    if data_format not in RECORD_FORMATS:
        return files, []
    what = "conversations" if data_format == "chat" else "preference pairs"
    skipped = [
        Problem(str(path), f"text_file_in_{data_format}_run", f"{what} are read from .json/.jsonl/.ndjson/.yaml/.yml "
                "files only; convert text files with --format text")
        for path, _ in files if file_kind(path) == "text"
    ]  # fmt: skip
    return [(path, size) for path, size in files if file_kind(path) != "text"], skipped


def choose_column(
    data_format: str, plain_text_rows: int, conversations: int, pairs: int = 0, conversation_records: int = 0,
    preference_records: int = 0,
) -> str:  # fmt: skip
    """The kind of dataset a run writes (a key of DATASET_COLUMNS): "text" for --format text, "messages" for
    --format chat, "preference" for --format preference. --format auto writes "messages" when it found conversations
    and nothing else, "preference" when it found preference pairs and nothing else, else "text", exactly as --format
    text would. Nothing else: no other text (rows from text files or from other records) and no record of the other
    kind (`conversation_records`, `preference_records`: records of each kind read, usable or not)."""
    if data_format != "auto":
        return RECORD_FORMATS.get(data_format, "text")
    if plain_text_rows:
        return "text"
    if pairs and not conversation_records:
        return "preference"
    return "messages" if conversations and not preference_records else "text"


def convert(args: argparse.Namespace, tmp: Path) -> tuple[dict[str, Any], dict[str, SplitWriter]]:
    """Read the input and write the dataset into the empty folder `tmp`. Returns the summary and the writers."""
    started = time.monotonic()
    files, walk_problems = find_input_files(args.data_folder, args.extensions, exclude=[args.save_dir])
    files, text_files_skipped = _record_inputs(files, args.data_format)
    skipped = walk_problems + text_files_skipped
    tally = Tally(files_found=len(files) + len(skipped), files_read=len(files), files_skipped=len(skipped))
    for problem in skipped:
        tally.add_problem(problem, skipped_file=True)
    if not files:
        kinds = f"files with the extensions {' '.join(args.extensions)}"
        if text_files_skipped:
            what = "conversation" if args.data_format == "chat" else "preference"
            kinds = f"{what} files (.json .jsonl .ndjson .yaml .yml; --format {args.data_format})"
        raise DataHfError(
            f"no {kinds} under --data_folder {args.data_folder} (hidden files and folders are skipped); check the path "
            "or pass --extensions"
        )
    options = Options(args.max_chars, args.min_chars, args.val_fraction, args.data_format, args.json_mode)
    tasks = plan_tasks(files, piece_bytes_for(args.max_chars))
    splits = ["train", "validation"] if args.val_fraction > 0 else ["train"]
    columns = {"text": ["text"], "chat": ["messages"], "preference": ["preference"]}.get(
        args.data_format, ["text", "messages", "preference"]
    )
    # Shards go to a folder per kind: an auto run learns only at the end which of the three it keeps.
    writers = {(c, split): SplitWriter(tmp / f"parts-{c}" / split, c) for c in columns for split in splits}
    with tqdm(total=len(files), unit="file", desc="data_hf", disable=None, file=sys.stderr) as progress:
        small = sum(size for _, size in files) < PARALLEL_MIN_BYTES
        for output in run_tasks(tasks, options, 1 if small else min(args.num_proc, len(tasks))):
            for split, chunks in output.splits.items():
                for chunk in chunks:
                    if chunk.count:
                        writers[chunk.column, split].write(chunk)
            tally.rows_with_surrogates += output.rows_with_surrogates
            for result in output.files:
                tally.add_piece(result)
                progress.update(result.piece == result.pieces - 1)
    rows: Counter[str] = Counter()
    for (column, _), writer in writers.items():
        rows[column] += writer.rows
    tally.plain_text_rows = rows["text"] - tally.rows_from_conversations
    column = choose_column(
        args.data_format, tally.plain_text_rows, rows["messages"], rows["preference"],
        tally.conversation_shaped_as_text, tally.preference_shaped_as_text,
    )  # fmt: skip
    if args.data_format == "auto" and column != "text":
        tally.adopt_chat_problems()
    chosen = _finish_writers(writers, column, splits, tmp)
    return _summary(tally, args, chosen, column, time.monotonic() - started), chosen


def _finish_writers(
    writers: dict[tuple[str, str], SplitWriter], column: str, splits: list[str], tmp: Path
) -> dict[str, SplitWriter]:
    """Finish the writers of `column` into the dataset layout in `tmp`, drop the others; returns them by split."""
    templates = _metadata_templates(tmp / ".templates", splits, column)
    chosen = {}
    for (writer_column, split), writer in writers.items():
        if writer_column != column:
            writer.discard()
            continue
        prefix = f"{split}/" if len(splits) > 1 else ""
        writer.finish(tmp / prefix, templates[f"{prefix}state.json"], templates[f"{prefix}dataset_info.json"])
        chosen[split] = writer
    for writer_column in {writer_column for writer_column, _ in writers}:
        _remove(tmp / f"parts-{writer_column}")
    if "dataset_dict.json" in templates:
        (tmp / "dataset_dict.json").write_text(json.dumps(templates["dataset_dict.json"]) + "\n")
    return chosen


def _refusals(summary: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """Why the converted dataset must not be published."""
    refusals = []
    problems = sum(summary["counts_by_reason"].values())
    if args.strict and problems:
        refusals.append(f"--strict: {problems} problem(s) found (listed above); fix them or drop --strict")
    if summary["rows_total"] == 0:
        found = {"messages": "conversations", "preference": "preference pairs"}.get(summary["column"])
        what = f"{found} were found (see the counts by reason above)" if found else "rows were extracted"
        refusals.append(f"no {what} from --data_folder {args.data_folder}; nothing to save")
    return refusals


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.extensions = normalize_extensions(args.extensions)
    errors = validate_args(args)
    for error in errors:
        print(f"data_hf: error: {error}", file=sys.stderr)
    if errors:
        return 1
    for note in clean_stale_temporaries(args.save_dir):
        print(f"data_hf: {note}", file=sys.stderr)
    run_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    # Beside --save_dir, hence on the same filesystem, so the final rename is atomic; hidden, so a --data_folder
    # that contains the output never reads it.
    tmp = args.save_dir.parent / f".{args.save_dir.name}{TMP_TAG}{run_id}"
    try:
        tmp.mkdir(parents=True)
    except OSError as err:
        print(f"data_hf: error: cannot create a folder beside --save_dir {args.save_dir}: {err}", file=sys.stderr)
        return 1
    try:
        summary, writers = convert(args, tmp)
        _print_summary(summary)
        refusals = _refusals(summary, args)
        if refusals:
            raise DataHfError("; ".join(refusals))
        for split, writer in writers.items():
            if len(writers) > 1 and writer.rows == 0:
                print(
                    f"data_hf: warning: --val-fraction {args.val_fraction} gave an empty {split} split", file=sys.stderr
                )
        (tmp / SUMMARY_NAME).write_text(json.dumps(summary, indent=2) + "\n")
        train, validation = load_text_dataset(tmp)  # proves the folder loads before it replaces anything
        if len(train) + (len(validation) if validation is not None else 0) != summary["rows_total"]:
            raise DataHfError(
                f"internal error: the written dataset in {tmp} does not hold {summary['rows_total']} rows"
            )
        if _occupied(args.save_dir) and not args.overwrite:
            raise DataHfError(f"--save_dir {args.save_dir} appeared while converting; pass --overwrite or another path")
        publish(tmp, args.save_dir, run_id)
    except DataHfError as err:
        print(f"data_hf: error: {err}", file=sys.stderr)
        return 1
    except BrokenProcessPool:
        print(
            "data_hf: error: a worker process died (out of memory?); nothing was written. Rerun with --num-proc 1 "
            "to see which file causes it",
            file=sys.stderr,
        )
        return 1
    except OSError as err:  # disk full or no permission while writing: one message, never a traceback
        print(
            f"data_hf: error: writing the dataset failed: {err}. --save_dir {args.save_dir} was not changed; free "
            f"disk space or fix permissions and rerun the same command",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        print("data_hf: interrupted; nothing was written", file=sys.stderr)
        return 130
    finally:
        if tmp.exists():
            _remove(tmp)
    print(f"{_one_line(summary)} -> {args.save_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
