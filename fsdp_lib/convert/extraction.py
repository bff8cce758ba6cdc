"""From a parsed value to rows: what one JSON value, JSON Lines line or YAML document gives under --format and
--json-mode. Text rows are its strings (fsdp_lib/records/text.py); --format chat and preference parse every record
as one conversation or pair (fsdp_lib/records/conversation.py, preference.py); --format auto parses the records
shaped like either and keeps their strings too, until the run knows which kind it writes. Bad records are counted
in the FileResult, never raised."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from fsdp_lib.convert.results import FileResult, Problem, Row
from fsdp_lib.records.conversation import Conversation, calls_json, is_turn_list, parse_conversation
from fsdp_lib.records.preference import PreferencePair, UnpairedExample, parse_preference, record_kind
from fsdp_lib.records.prompts import PromptRecord, parse_prompt_record
from fsdp_lib.records.reasons import BadRecord
from fsdp_lib.records.text import extract_strings

DEFAULT_MAX_CHARS = 1_000_000
DATA_FORMATS = ("auto", "text", "chat", "preference", "prompts")
# The formats whose every record is parsed as one row (no text is extracted), and the kind of dataset each writes.
RECORD_FORMATS = {"chat": "messages", "preference": "preference", "prompts": "prompts"}
JSON_MODES = ("strings", "records")


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
        # a list of records, unless it is one conversation written as a bare list of turns (a whole file of them)
        one = self.data_format != "text" and is_turn_list(value)
        records = value if split_lists and isinstance(value, list) and not one else (value,)
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
    ) -> Conversation | PreferencePair | UnpairedExample | PromptRecord | None:
        """The conversation ("chat"), preference pair ("preference") or prompt ("prompts") of a record; None, with
        the bad record counted, if it cannot be one."""
        try:
            if records_seen is not None and isinstance(record, dict):
                if id(record) in records_seen:
                    raise BadRecord("repeated_yaml_alias", "an alias to a record already read")
                records_seen.add(id(record))
            parse = {"preference": parse_preference, "prompts": parse_prompt_record}.get(kind, parse_conversation)
            row = parse(record)
            chars = row_chars(row)
            if chars > self.max_chars:
                too_long = {"preference": "pair_too_long", "prompts": "prompt_too_long"}.get(
                    kind, "conversation_too_long"
                )
                if isinstance(row, UnpairedExample):
                    too_long = "example_too_long"
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
    if isinstance(row, (PreferencePair, UnpairedExample, PromptRecord)):
        return row.chars
    chars = sum(len(turn[1]) for turn in row)
    if not getattr(row, "uses_tools", False):
        return chars
    return chars + sum(len(calls_json(turn) or "") for turn in row) + len(row.tools or "")


class ConversationText(str):
    """A string of a conversation or preference record in an auto run: counted apart, because it is kept only if
    the run writes text; if every record is a conversation (or a pair) the run writes those instead."""
