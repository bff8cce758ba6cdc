"""Reading one file, or one piece of a large one, into rows: the bytes of the piece (cut at a blank line or a
newline, so that the pieces of a file tile it), their encoding (UTF-8, else Windows-1252, else Latin-1), the parser
of the file's kind (text, JSON, JSON Lines, YAML; a large JSON or YAML file streamed from the open file instead of
read whole), and every row and problem recorded in a FileResult. read_file is what a worker runs per piece."""

from __future__ import annotations

import codecs
import io
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import yaml

from fsdp_lib.convert.extraction import DEFAULT_MAX_CHARS, RECORD_FORMATS, ConversationText, Extraction
from fsdp_lib.convert.results import REASONS, FileResult, Problem, Row
from fsdp_lib.convert.streaming import JsonStreamError, YamlDepthBound, iter_json_values, yaml_loader
from fsdp_lib.records.preference import PreferencePair, UnpairedExample
from fsdp_lib.records.prompts import PromptRecord
from fsdp_lib.records.text import split_long_text

KIND_BY_EXTENSION = {".json": "json", ".jsonl": "jsonl", ".ndjson": "jsonl", ".yaml": "yaml", ".yml": "yaml"}
# Files above this size are read in pieces (text, JSON Lines) or streamed (JSON, YAML) so that no process ever
# holds a whole large file; it grows with --max-chars so that a file of at most --max-chars characters
# (at most 4 bytes each) is never cut by a piece boundary.
MIN_PIECE_BYTES = 4 << 20
# A streamed JSON file's top-level object is held whole as one record up to this size (parsed, a few times more);
# above it, it is a dump of records, not one, and is read member by member.
WHOLE_OBJECT_MAX_BYTES = 256 << 20
# A boundary search looks this far for a blank line or newline before cutting a text piece hard.
ALIGN_WINDOW = 1 << 20
_BLANK_LINE_BYTES = re.compile(rb"\n[ \t\r]*\n")


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


def file_kind(path: str | Path) -> str:
    """How a file is parsed: "json", "jsonl", "yaml", or "text" for every other extension."""
    return KIND_BY_EXTENSION.get(Path(path).suffix.lower(), "text")


def piece_bytes_for(max_chars: int) -> int:
    """The size of the pieces a large text or JSON Lines file is cut into, and above which JSON and YAML stream."""
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


def _unicode_encoding(start: bytes) -> str | None:
    """ "utf-32" or "utf-16" when `start` opens with that encoding's byte-order mark (UTF-32's first: FF FE 00 00
    starts like UTF-16's FF FE), else None."""
    boms = (
        ((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE), "utf-32"),
        ((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE), "utf-16"),
    )
    return next((name for marks, name in boms if start.startswith(marks)), None)


def _file_start(path: str | Path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(4)


def unicode_file(path: str | Path) -> str | None:
    """ "utf-16" or "utf-32" for a file that opens with that byte-order mark (such files are decoded as a stream when
    large, never cut into byte pieces, which could split a character), else None."""
    try:
        return _unicode_encoding(_file_start(path))
    except OSError:  # unreadable: the reader reports it
        return None


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
        result.problems.append(Problem(result.path, err.reason, err.detail + kept + _unread_rest(err, read)))


def _unread_rest(err: JsonStreamError, read: Callable[[int], str]) -> str:
    """What an error in a JSON file cost: the parser cannot find its way back into the document, so everything
    after the error is lost (99,990 records of a 100,000-element array with a bad 11th one). Says how much, so the
    loss is not hidden in one counted problem."""
    rest, blank = len(err.unread), not err.unread.strip()
    while chunk := read(1 << 20):
        rest, blank = rest + len(chunk), blank and not chunk.strip()
    if blank:
        return ""
    share = 100 * rest / (err.offset + rest)
    return f"; the rest of the file, {rest:,} characters ({share:.0f}%), was not read: fix the file there and rerun"


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
        except Exception as err:  # noqa: BLE001 - a value its tag cannot hold: !!int abc, !!float x, !!bool maybe
            reason, detail = "invalid_yaml", f"a value its tag cannot hold ({type(err).__name__}: {err})"
        else:
            count += 1
            yield from extraction.items(document, result, split_lists=True, yaml_document=True)
            continue
        kept = f"; read {count} document(s) before it" if count else ""
        result.problems.append(Problem(result.path, reason, detail + kept))
        return


def _jsonl_items(data: bytes, result: FileResult, extraction: Extraction, lines_before: int = 0) -> Iterator[Row]:
    """Rows of every line of JSON Lines bytes (numbered after `lines_before`). Lines are parsed from bytes
    (json.loads decodes UTF-8 and drops a BOM itself), so the piece is never held a second time as text; a line that
    is not UTF-8 is decoded like a legacy text file."""
    result.newlines = data.count(b"\n")
    start, number = 0, lines_before
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
    JSON object is one record, read whole, where records are wanted (extraction.whole_records), as in a small file;
    with --format text --json-mode strings, or in a file over WHOLE_OBJECT_MAX_BYTES (a dump such as {"data": [...]}
    rather than one record), it is read member by member, so that memory stays flat."""
    unicode = unicode_file(path)
    has_nul, encoding, depth = (False, unicode, _UNSCANNED) if unicode else _scan_large_file(path)
    result.bytes_read = os.path.getsize(path)
    if has_nul:
        result.problems.append(Problem(path, "binary", "the file contains NUL bytes"))
        return
    if encoding != "utf-8-sig":
        result.fallback_encoding = encoding
    with open(path, encoding=encoding, newline="") as fh:
        if kind == "json":
            whole = extraction.whole_records and result.bytes_read <= WHOLE_OBJECT_MAX_BYTES
            yield from _json_items(fh.read, result, extraction, whole_objects=whole)
        else:
            yield from _yaml_items(fh, yaml_loader(depth), result, extraction)


_UNSCANNED = YamlDepthBound()  # a UTF-16/32 file's depth is not scanned: the loader safe at any depth
_UNSCANNED.deep_block = True


class NulInText(ValueError):
    """Decoded UTF-16/32 text with NUL characters: binary data behind a byte-order mark."""


def _items_transcoded(kind: str, path: str, unicode: str, result: FileResult, extraction: Extraction) -> Iterator[Row]:
    """A text or JSON Lines file in UTF-16/32 (its byte-order mark says which) too large to hold: decoded as a
    stream and handled in pieces of about the size UTF-8 files are cut into, each ending at a blank line (text) or at
    a newline (JSON Lines), as a UTF-8 file's pieces end; JSON Lines lines keep their numbers across pieces."""
    result.bytes_read, result.fallback_encoding = os.path.getsize(path), unicode
    limit, lines, pending, size = piece_bytes_for(extraction.max_chars), 0, [], 0
    try:
        with open(path, encoding=unicode, newline="") as fh:  # the codec consumes the byte-order mark
            for line in fh:
                pending.append(line)
                size += len(line)
                if size >= limit and (kind == "jsonl" or not line.strip()):
                    yield from _transcoded_piece(kind, "".join(pending), lines, result, extraction)
                    lines, pending, size = lines + len(pending), [], 0
            if pending:
                yield from _transcoded_piece(kind, "".join(pending), lines, result, extraction)
    except UnicodeDecodeError as err:
        result.problems.append(
            Problem(path, "binary", f"not {unicode.upper()} after its byte-order mark ({err.reason})")
        )
    except NulInText as err:
        result.problems.append(Problem(path, "binary", str(err)))
    result.newlines = lines


def _transcoded_piece(kind: str, text: str, lines: int, result: FileResult, extraction: Extraction) -> Iterator[Row]:
    if "\x00" in text:
        raise NulInText("the decoded text contains NUL characters")
    if kind == "jsonl":
        yield from _jsonl_items(text.encode("utf-8"), result, extraction, lines_before=lines)
    else:
        yield text


def _raw_items(
    path: str, kind: str, start: int, end: int | None, extraction: Extraction, result: FileResult
) -> Iterator[Row]:
    whole = start == 0 and end is None
    large = whole and os.path.getsize(path) > piece_bytes_for(extraction.max_chars)
    if kind in ("json", "yaml") and large:
        yield from _items_streamed(kind, path, result, extraction)
        return
    if large and (unicode := unicode_file(path)):
        yield from _items_transcoded(kind, path, unicode, result, extraction)
        return
    offset, data = _read_bytes(path, kind, start, end)
    result.bytes_read = len(data)
    unicode = _unicode_encoding(data if whole else _file_start(path))
    if unicode and whole:  # UTF-16/32 text with its BOM (Windows editors, PowerShell): read as the UTF-8 it says
        try:
            data = data.decode(unicode).encode("utf-8")
        except UnicodeDecodeError:
            unicode = None  # a BOM on bytes that are not that encoding: judged as bytes below
    if b"\x00" in data:
        where = "the file contains" if whole else f"bytes {offset}-{offset + len(data)} contain"
        result.problems.append(Problem(path, "binary", f"{where} NUL bytes"))
        return
    if whole and (not data or data.isspace()):
        result.problems.append(Problem(path, "empty_file", "0 bytes" if not data else "only whitespace"))
        return
    if kind == "jsonl":
        result.fallback_encoding = unicode
        yield from _jsonl_items(data, result, extraction)
        return
    depth = YamlDepthBound()
    if kind == "yaml":
        depth.feed(data)
    text, fallback = decode_bytes(data, at_file_start=offset == 0)
    result.fallback_encoding = unicode or fallback
    del data  # a piece is held once, as text
    yield from _items_in_memory(kind, text, yaml_loader(depth), result, extraction)


def iter_rows(
    path: str | Path, result: FileResult, extraction: Extraction, min_chars: int = 0, start: int = 0,
    end: int | None = None,
) -> Iterator[Row]:  # fmt: skip
    """Rows of one file (or of the piece [start, end) of a large one), recording problems and counts in `result`:
    text rows (str) of at most extraction.max_chars characters and min_chars or more, conversations and preference
    pairs. A generator, so a large JSON or YAML file is never held whole."""
    max_chars = extraction.max_chars
    try:
        for item in _raw_items(str(path), file_kind(path), start, end, extraction, result):
            if isinstance(item, PreferencePair):
                result.pairs_found += 1
                yield item
                continue
            if isinstance(item, UnpairedExample):
                result.unpaired_found += 1
                yield item
                continue
            if isinstance(item, PromptRecord):
                result.prompts_found += 1
                yield item
                continue
            if not isinstance(item, str):
                result.conversations_found += 1
                yield item
                continue
            result.strings_found += 1
            from_conversation = isinstance(item, ConversationText)
            rows = split_long_text(item, max_chars) if len(item) > max_chars else (item,)
            kept = 0
            for row in rows:
                if not row or row.isspace():
                    result.dropped_empty += 1
                elif min_chars and (len(row) < min_chars or len(row.strip()) < min_chars):
                    result.dropped_short += 1
                else:
                    kept += 1
                    result.rows_from_conversations += from_conversation
                    yield str(row)
            result.extra_rows_from_splitting += max(kept - 1, 0)  # rows kept beyond the string's one
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
    result.rows = list(iter_rows(path, result, Extraction(data_format, json_mode, max_chars), min_chars, start, end))
    result.rows_kept = len(result.rows)
    if start == 0 and end is None:
        note_no_text(result)
    return result


def note_no_text(result: FileResult) -> None:
    """A whole file that parsed fine but held no string at all gets a problem, so it does not vanish silently."""
    found = (result.strings_found or result.conversations_found or result.pairs_found or result.prompts_found
             or result.unpaired_found)  # fmt: skip
    if not (found or result.problems):
        result.problems.append(Problem(result.path, "no_text", REASONS["no_text"]))
