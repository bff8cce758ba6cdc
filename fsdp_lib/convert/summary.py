"""The run summary: Tally adds up the FileResults of every piece in output order (a file's pieces merged, its line
numbers made global), build_summary makes the dict saved as data_hf_summary.json in the dataset folder, and
print_summary and one_line are what the user reads at the end of a run."""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from fsdp_lib.convert.planning import ending_fix
from fsdp_lib.convert.publish import SUMMARY_NAME
from fsdp_lib.convert.reading import note_no_text
from fsdp_lib.convert.results import MAX_LISTED, REASONS, FileResult, Problem
from fsdp_lib.convert.writer import SplitWriter
from fsdp_lib.records.schema import DATASET_COLUMNS, PREFERENCE_COLUMNS, UNPAIRED_COLUMNS

# The counts of a FileResult that add up piece by piece into its file, then file by file into the run (a file is
# judged whole: whether it held text, conversations or pairs), and those that add up from each piece into the run.
FILE_COUNTS = (
    "strings_found", "conversations_found", "pairs_found", "unpaired_found", "prompts_found",
    "conversation_shaped_as_text", "preference_shaped_as_text",
)  # fmt: skip
PIECE_COUNTS = ("bytes_read", "dropped_empty", "dropped_short", "extra_rows_from_splitting", "rows_from_conversations")


@dataclass
class Tally:
    """Counts for the summary, fed file by file in output order."""

    files_found: int = 0
    files_read: int = 0
    files_with_text: int = 0
    files_with_conversations: int = 0
    files_with_pairs: int = 0
    files_with_preference: int = 0  # files with pairs or unpaired examples
    files_with_prompts: int = 0
    files_skipped: int = 0
    conversations_found: int = 0
    pairs_found: int = 0
    unpaired_found: int = 0
    prompts_found: int = 0
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
    other_endings: dict[str, int] = field(default_factory=dict)  # files --extensions does not list, by ending
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
        file.problems += [_in_file(problem, self._lines_before) for problem in result.problems]
        for problem in result.pending_chat_problems:
            if len(self.pending_chat_problems) < MAX_LISTED:
                self.pending_chat_problems.append(_in_file(problem, self._lines_before))
            else:
                self.unlisted_chat_problems[problem.reason] += 1
        self._lines_before += result.newlines
        self._rows_in_file += result.rows_kept
        _add_counts(file, result, FILE_COUNTS)
        _add_counts(self, result, PIECE_COUNTS)
        self.counts_by_reason.update(result.unlisted_problems)
        self.unlisted_chat_problems.update(result.unlisted_chat_problems)
        if result.fallback_encoding:
            self.fallback_decoded_pieces += 1
            if len(self.fallback_decoded) < MAX_LISTED:
                self.fallback_decoded.setdefault(result.path, result.fallback_encoding)
        if result.piece == result.pieces - 1:
            if result.pieces > 1:  # read_file already judged single-piece files
                note_no_text(file)
            self._finish_file(file)

    def adopt_chat_problems(self) -> None:
        """An auto run that writes conversations (or pairs): its bad conversation (or preference) records become
        problems. Only one kind is pending then: choose_column writes either kind only when no record of the
        other kind was read."""
        for problem in self.pending_chat_problems:
            self.add_problem(problem)
        self.counts_by_reason.update(self.unlisted_chat_problems)

    def _finish_file(self, file: FileResult) -> None:
        _add_counts(self, file, FILE_COUNTS)
        records = file.conversations_found + file.pairs_found + file.unpaired_found + file.prompts_found
        self.files_with_text += self._rows_in_file > records
        self.files_with_conversations += file.conversations_found > 0
        self.files_with_pairs += file.pairs_found > 0
        self.files_with_preference += file.pairs_found + file.unpaired_found > 0
        self.files_with_prompts += file.prompts_found > 0
        if file.conversation_shaped_as_text and len(self.conversation_text_files) < MAX_LISTED:
            self.conversation_text_files[file.path] = file.conversation_shaped_as_text
        if file.preference_shaped_as_text and len(self.preference_text_files) < MAX_LISTED:
            self.preference_text_files[file.path] = file.preference_shaped_as_text
        skipped = file.skipped_reason is not None
        self.files_skipped += skipped
        self.files_read -= skipped  # counted as read when listed; unreadable, binary or empty after all
        for index, problem in enumerate(file.problems):
            self.add_problem(problem, skipped_file=skipped and index == 0)


def _add_counts(total: Tally | FileResult, part: FileResult, names: tuple[str, ...]) -> None:
    for name in names:
        setattr(total, name, getattr(total, name) + getattr(part, name))


def _in_file(problem: Problem, lines_before: int) -> Problem:
    """A piece's problem with its line number counted from the start of the file (lines_before: the piece's)."""
    line = None if problem.line is None else problem.line + lines_before
    return Problem(problem.path, problem.reason, problem.detail, line)


def build_summary(
    tally: Tally, args: argparse.Namespace, writers: dict[str, SplitWriter], column: str, seconds: float
) -> dict[str, Any]:
    """The summary of a run that wrote the kind `column` with `writers` (one per split), as saved in SUMMARY_NAME:
    the options, the counts, the problems listed (up to MAX_LISTED each) and the reasons explained."""
    rows = {split: writer.rows for split, writer in writers.items()}
    text = column == "text"  # the text counters describe rows that a conversation dataset does not hold
    files_with_rows = {
        "messages": tally.files_with_conversations, "preference": tally.files_with_pairs,
        "unpaired": tally.files_with_preference, "prompts": tally.files_with_prompts,
    }  # fmt: skip
    return {
        "data_folder": str(args.data_folder),
        "save_dir": str(args.save_dir),
        "column": column,  # the kind of dataset: text, messages, preference, unpaired or prompts
        "columns": list(DATASET_COLUMNS[column]),
        "notes": _ending_notes(tally.other_endings) + _format_notes(tally, args.data_format, column),
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
        "files_not_read_by_ending": tally.other_endings,
        "bytes_read": tally.bytes_read,
        "rows": rows,
        "rows_total": sum(rows.values()),
        "text_bytes": sum(writer.text_bytes for writer in writers.values()),
        "strings_found": tally.strings_found if text else 0,
        "conversations_found": tally.conversations_found,
        "pairs_found": tally.pairs_found,
        "unpaired_found": tally.unpaired_found,
        "prompts_found": tally.prompts_found,
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


def endings_text(counts: dict[str, int], shown: int = 6) -> str:
    """ "3 .jsonl.gz files, 1 .csv file, 2 files without an ending" (the most common first)."""
    parts = [
        f"{count} {ending + ' ' if ending else ''}file{'s' if count > 1 else ''}{'' if ending else ' without an ending'}"
        for ending, count in list(counts.items())[:shown]
    ]
    more = sum(list(counts.values())[shown:])
    return ", ".join(parts + ([f"{more} more"] if more else []))


def _ending_notes(other_endings: dict[str, int]) -> list[str]:
    """That files were passed over for their ending, so a corpus of .jsonl.gz files is not silently left out."""
    if not other_endings:
        return []
    fixes = "; ".join(dict.fromkeys(f"for {ending or 'no ending'}, {ending_fix(ending)}" for ending in other_endings))
    return [f"not read, their ending is not in --extensions: {endings_text(other_endings)}; to convert them: {fixes}"]


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
    if column == "unpaired":
        notes = []
        if data_format == "auto":
            notes.append(
                f"--format auto: every record read is preference data, so the dataset has the columns "
                f"{', '.join(UNPAIRED_COLUMNS)}, as --format preference writes; pass --format text to extract their "
                "strings as text instead"
            )
        if tally.pairs_found:
            notes.append(
                f"the run read {tally.unpaired_found} unpaired example(s) (completion + label) and {tally.pairs_found} "
                f"pair(s): a dataset holds one kind, so each pair became two unpaired examples (chosen: label true, "
                "rejected: label false), which --objective kto trains on; convert the pairs on their own for DPO"
            )
        return notes
    if column != "text":
        return []
    why = " because the folder also holds other text" if data_format == "auto" and tally.plain_text_rows else ""
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
            f"{tally.preference_shaped_as_text} record(s) look like preference data (pairs: chosen + rejected, or "
            f"unpaired examples: completion + label; e.g. in {files}) and were extracted as text{why}. To train on "
            "them with DPO or KTO, convert them on their own: python data_hf.py --format preference --data_folder "
            "<their folder> --save_dir <new dataset>"
        )
    return notes


def print_summary(summary: dict[str, Any], shown: int = 20) -> None:
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


def one_line(summary: dict[str, Any]) -> str:
    """The last line a run prints: files, megabytes, rows (per split), seconds, speed and problems."""
    megabytes = summary["bytes_read"] / 1e6
    speed = megabytes / summary["seconds"] if summary["seconds"] else 0.0
    rows = summary["rows"]
    split_text = f" (train {rows['train']}, validation {rows['validation']})" if "validation" in rows else ""
    counts = summary["counts_by_reason"]
    reasons = f" ({', '.join(f'{reason} {count}' for reason, count in counts.items())})" if counts else ""
    unit = {
        "messages": "conversations",
        "preference": "preference pairs",
        "unpaired": "unpaired examples",
        "prompts": "prompts",
    }.get(  # fmt: skip
        summary["column"], "rows"
    )
    return (
        f"data_hf: {summary['files_found']} files, {megabytes:.1f} MB -> {summary['rows_total']} {unit}{split_text} "
        f"in {summary['seconds']:.1f} s ({speed:.1f} MB/s); {summary['files_skipped']} files skipped, "
        f"{sum(counts.values())} problems{reasons}"
    )
