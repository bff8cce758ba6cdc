"""What reading a file gives: its rows (Row: a text, a conversation, a preference pair or a prompt), the problems met
(Problem, each with a reason of REASONS) and the counts the summary adds up (FileResult)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from fsdp_lib.records.conversation import Conversation
from fsdp_lib.records.preference import PreferencePair, UnpairedExample
from fsdp_lib.records.prompts import PromptRecord
from fsdp_lib.records.reasons import RECORD_REASONS

# Why a file, a line or a piece is skipped (a record's reasons are RECORD_REASONS).
FILE_REASONS = {
    "empty_file": "the file is empty or holds only whitespace",
    "binary": "NUL bytes: a binary file (or UTF-16/UTF-32 text without a byte-order mark: convert it to UTF-8)",
    "invalid_json": "malformed JSON; the values before the error are kept",
    "invalid_jsonl_line": "a malformed line in a JSON Lines file; the other lines are kept",
    "invalid_yaml": "malformed YAML; the documents before the error are kept",
    "yaml_unsupported_tag": "a YAML tag the safe loader refuses (e.g. !!python/...); nothing was executed",
    "too_deep": "nested deeper than the JSON/YAML parser's recursion limit",
    "no_text": "parsed, but holds no string values",
    "read_error": "could not be read (permissions, broken link, not a regular file)",
    "not_raw_data": "a folder inside --data_folder that a tool wrote (a dataset, a training experiment, a model "
    "folder, the token cache): its files are not raw data; not read",
    "text_file_in_chat_run": "a text file (not .json/.jsonl/.yaml) in a --format chat run: not read",
    "text_file_in_preference_run": "a text file (not .json/.jsonl/.yaml) in a --format preference run: not read",
    "text_file_in_prompts_run": "a text file (not .json/.jsonl/.yaml) in a --format prompts run: not read",
}
# Every reason a run may count, with the explanation the summary saves beside it.
REASONS = {**FILE_REASONS, **RECORD_REASONS}
MAX_LISTED = 1000  # per list in the summary; the counts are always complete
# Per piece of a file, the bad records listed with their detail; past this they are only counted.
RECORD_PROBLEMS_LISTED = MAX_LISTED
# What a task yields: a text row, a conversation (--format chat), a preference pair (--format preference) or a
# prompt (--format prompts).
Row = str | Conversation | PreferencePair | UnpairedExample | PromptRecord


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
    unpaired_found: int = 0  # unpaired examples: completion + label (--format preference or auto)
    prompts_found: int = 0  # prompt records (--format prompts)
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
        if (
            self.strings_found
            or self.conversations_found
            or self.pairs_found
            or self.unpaired_found
            or self.prompts_found
            or not self.problems
        ):
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
