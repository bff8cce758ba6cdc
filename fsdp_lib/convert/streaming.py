"""Parsing JSON and YAML a chunk at a time, so that no process ever holds a whole large file.

iter_json_values reads the top-level values of a JSON text incrementally (the elements of a top-level array, the
members of an object, or several values one after another) and raises JsonStreamError after yielding every value
before the first malformed one. For YAML, YamlDepthBound bounds the nesting of the bytes chunk by chunk and
yaml_loader picks the safe loader that cannot crash on them: the fast C loader, or the pure-Python one where the
text might nest deeper than libyaml's recursion survives.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from itertools import accumulate

import yaml

_JSON_DECODER = json.JSONDecoder()


def _dates_as_written(loader: type) -> type:
    """The safe loader with dates and timestamps kept as the text written: JSON has no date type, a date is text
    worth training on, and an impossible one (2023-02-29) would otherwise fail the whole document."""
    kept = type(f"Text{loader.__name__}", (loader,), {})
    kept.add_constructor("tag:yaml.org,2002:timestamp", yaml.constructor.SafeConstructor.construct_yaml_str)
    return kept


# The C loader is about 10x faster; both construct with SafeConstructor, so no tag can run code.
_YAML_LOADER = _dates_as_written(getattr(yaml, "CSafeLoader", yaml.SafeLoader))
_YAML_PY_LOADER = _dates_as_written(yaml.SafeLoader)
# libyaml's composer, behind CSafeLoader, recurses in C once per nesting level and kills the process (a segfault,
# not an exception) somewhere between 10,000 and 100,000 levels with an 8 MB stack. A text that might nest deeper
# than YAML_C_MAX_DEPTH goes to the pure-Python loader instead, whose recursion ends in a RecursionError.
YAML_C_MAX_DEPTH = 2000
# Block nesting needs indentation or "- ", "? ", ": " indicators at the start of a line; a run of them that is
# cut by a chunk boundary is caught in one of its halves, hence a quarter of the limit per chunk.
_YAML_DEEP_BLOCK = re.compile(rb"^(?:[ \t]|[-?:][ \t]){%d}" % (YAML_C_MAX_DEPTH // 4), re.M)
_FLOW_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
_NOT_FLOW_BRACKET = bytes(sorted(set(range(256)) - set(_FLOW_STEP)))


class JsonStreamError(Exception):
    """JSON that stops being readable; `reason` is invalid_json or too_deep, `detail` says where."""

    def __init__(self, reason: str, detail: str, offset: int = 0, unread: str = "") -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.offset = offset  # characters before the error
        self.unread = unread  # what the reader held past the error; the rest of the input is still unread


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
        message = message.removesuffix(" at")  # json's "Unterminated string starting at" says where itself
        offset = self._chars_before + pos
        return JsonStreamError(reason, f"{message} at line {line} (char {offset})", offset, self.buf[pos:])

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


def yaml_loader(depth: YamlDepthBound) -> type:
    """The safe loader for YAML of that depth bound: the C one, unless it might recurse too deep for it."""
    return _YAML_PY_LOADER if depth.may_exceed() else _YAML_LOADER
