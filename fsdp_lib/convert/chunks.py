"""Rows as Arrow chunks, built in the workers without pyarrow: a text column's rows as the two buffers of a string
array, a `messages` column's conversations as a list array of turn structs (with the tool fields, nulls where a
turn has none), a preference dataset's three such columns. The parent wraps the buffers into Arrow arrays without
a copy (fsdp_lib/convert/writer.py); the digest of every buffer feeds the dataset fingerprint."""

from __future__ import annotations

import hashlib
import re
from array import array
from dataclasses import dataclass
from itertools import accumulate

from fsdp_lib.records.conversation import Conversation, ToolTurn
from fsdp_lib.records.preference import PreferencePair, UnpairedExample
from fsdp_lib.records.prompts import PromptRecord
from fsdp_lib.records.schema import PREFERENCE_COLUMNS, Turns
from fsdp_lib.records.tool_calls import TURN_FIELDS

# Rows travel from workers as the two buffers of an Arrow string array: UTF-8 bytes and int32 offsets (Arrow's
# little-endian layout, native on x86 and ARM). Chunks stay under 2 GiB so the offsets cannot overflow.
_INT32 = next(code for code in "ilh" if array(code).itemsize == 4)
CHUNK_BYTES = 1 << 30
_SURROGATE = re.compile("[\ud800-\udfff]")


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
    return _turn_columns([[getattr(pair, name) for pair in pairs] for name in PREFERENCE_COLUMNS], "preference")


def encode_unpaired(examples: list[UnpairedExample]) -> tuple[list[EncodedRows], int]:
    """(Arrow-layout chunks of an unpaired dataset: the prompt and completion columns and the boolean label, number
    of messages whose lone surrogates were replaced)."""
    columns = [[example.prompt for example in examples], [example.completion for example in examples]]
    return _turn_columns(columns, "unpaired", [example.label for example in examples])


def _turn_columns(
    columns: list[list[Turns]], column: str, labels: list[bool] | None = None
) -> tuple[list[EncodedRows], int]:
    """Chunks of `column` (a dataset kind) whose fields are the `columns` of turns, then the labels if any."""
    encoded = [_encoded_contents(conversations) for conversations in columns]
    count = len(columns[0])
    sizes = [sum(sum(map(len, contents[ends[i] : ends[i + 1]])) for contents, ends, _ in encoded) for i in range(count)]
    bounds = _chunk_bounds(sizes)
    chunks = []
    for first, last in zip(bounds, bounds[1:], strict=False):
        fields = tuple(
            _messages_chunk(conversations[first:last], contents[ends[first] : ends[last]], with_tools=False)
            for conversations, (contents, ends, _) in zip(columns, encoded, strict=True)
        )
        if labels is not None:
            fields += (_bool_chunk(labels[first:last]),)
        digest = hashlib.blake2b(b"".join(part.digest for part in fields), digest_size=16).digest()
        chunks.append(EncodedRows(last - first, b"", b"", digest, column, fields=fields))
    return chunks, sum(replaced for _, _, replaced in encoded)


def _bool_chunk(values: list[bool]) -> EncodedRows:
    """A boolean array chunk: Arrow's bitmap (bit i set = row i is true) in `values`."""
    bitmap = bytearray((len(values) + 7) // 8)
    for index, value in enumerate(values):
        if value:
            bitmap[index >> 3] |= 1 << (index & 7)
    digest = hashlib.blake2b(bytes(bitmap) + len(values).to_bytes(8, "little"), digest_size=16).digest()
    return EncodedRows(len(values), b"", bytes(bitmap), digest, "bool")


def encode_prompts(records: list[PromptRecord]) -> tuple[list[EncodedRows], int]:
    """(Arrow-layout chunks of a prompts dataset, its prompt turns and its columns_json strings, number of strings
    whose lone surrogates were replaced). Like a preference chunk: the columns of a chunk hold the same rows."""
    prompts = [record.prompt for record in records]
    contents, ends, replaced = _encoded_contents(prompts)
    columns, replaced_in_columns = _utf8([record.columns_json for record in records])
    sizes = [sum(map(len, contents[ends[i] : ends[i + 1]])) + len(columns[i]) for i in range(len(records))]
    bounds = _chunk_bounds(sizes)
    chunks = []
    for first, last in zip(bounds, bounds[1:], strict=False):
        fields = (
            _messages_chunk(prompts[first:last], contents[ends[first] : ends[last]], with_tools=False),
            _string_chunk(columns[first:last]),
        )
        digest = hashlib.blake2b(b"".join(part.digest for part in fields), digest_size=16).digest()
        chunks.append(EncodedRows(last - first, b"", b"", digest, "prompts", fields=fields))
    return chunks, replaced + replaced_in_columns
