"""Convert a folder of text, Markdown, JSON, JSON Lines and YAML files into a Hugging Face dataset.

    python data_hf.py --data_folder splits --save_dir hf_datasets/my_corpus
    python data_hf.py --data-folder raw_text --save-dir hf_datasets/my_corpus --val-fraction 0.01 --overwrite
    python data_hf.py --data-folder chat_data --save-dir hf_datasets/my_chat --format chat --val-fraction 0.01
    python data_hf.py --data-folder dpo_data --save-dir hf_datasets/my_pairs --format preference --val-fraction 0.01
    python data_hf.py --data-folder math_problems --save-dir hf_datasets/my_prompts --format prompts

The result is a `datasets.Dataset` (or, with --val-fraction, a `DatasetDict` with `train` and `validation`),
written with the layout of `save_to_disk` so `datasets.load_from_disk` and fsdp_train.py read it directly. It has
one column: `text` (a string), or with --format chat `messages` (a list of {"role", "content"} turns, Arrow type
list<struct<role: string, content: string>>, one conversation per record; see parse_conversation in
fsdp_lib/records/conversation.py for the record shapes), or with --format preference three: `prompt`, `chosen` and
`rejected`, each a list of turns typed like `messages`, one preference pair per record (the prompt ends with a user
turn, each response starts with an assistant turn; see parse_preference in fsdp_lib/records/preference.py for the
record shapes: TRL standard and conversational, UltraFeedback, implicit prompt, Anthropic HH, ShareGPT, Alpaca), or
with --format prompts (for fsdp_train.py --objective grpo) two: `prompt`, a list of turns ending with a user turn
(from a prompt, question, problem or instruction + input key), and `columns_json`, every other field of the record
as one JSON object, which the reward functions get as columns (see fsdp_lib/records/prompts.py). --format auto (the
default; it never writes prompts) writes `messages` when every record
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
This file is the command line: the arguments, the outline of a run (convert) and main. The record shapes and the
dataset schema are fsdp_lib/records/ (shared with the trainer, which reads them back), the engine fsdp_lib/convert/
(streaming, reading, planning, workers, Arrow chunks, the writer, the summary, the atomic publish). Loading a saved
dataset (a data_hf.py folder or a cached hub dataset) is fsdp_lib/records/dataset.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import time
import uuid
from collections import Counter
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from tqdm import tqdm

from fsdp_lib.arguments import JoinRepeats, OneValueParser
from fsdp_lib.convert.extraction import DATA_FORMATS, DEFAULT_MAX_CHARS, JSON_MODES, RECORD_FORMATS
from fsdp_lib.convert.planning import (
    NOT_TEXT_ENDINGS,
    Options,
    file_ending,
    find_input_files,
    has_ending,
    is_compressed,
    normalize_extensions,
    plan_tasks,
    record_inputs,
)
from fsdp_lib.convert.publish import (
    SUMMARY_NAME,
    TMP_TAG,
    clean_stale_temporaries,
    occupied,
    publish,
    remove_path,
    replace_problem,
)
from fsdp_lib.convert.reading import piece_bytes_for
from fsdp_lib.convert.summary import Tally, build_summary, endings_text, one_line, print_summary
from fsdp_lib.convert.workers import run_tasks, worker_count
from fsdp_lib.convert.writer import SplitWriter, choose_column, finish_writers, unpair_into
from fsdp_lib.errors import broken_link, file_above, unreadable
from fsdp_lib.interrupts import exit_without_teardown, interrupt_exit_code, sigterm_as_interrupt
from fsdp_lib.markers import enclosing_folder, folder_kind, unfinished_splits
from fsdp_lib.records.dataset import load_text_dataset
from fsdp_lib.records.schema import DATASET_COLUMNS

# The engine is fsdp_lib/convert/ and the record shapes fsdp_lib/records/, neither of which imports torch. pyarrow and
# datasets are imported inside the functions of the parent process that use them: every spawned worker imports
# fsdp_lib/convert/workers.py (and this module, when it runs as a script), and pyarrow alone would add ~45 MB to each
# (datasets ~80 MB more, and a second of start-up).

DEFAULT_EXTENSIONS = (".txt", ".md", ".json", ".jsonl", ".yaml", ".yml")
# A row of 100M characters is at most 400 MB of UTF-8: far from Arrow's 2 GiB limit for one string array.
MAX_MAX_CHARS = 100_000_000
# Endings of files that are not text: a --data_folder file with one of these is refused, not read as text.
GUESSED_ENCODINGS = ("cp1252", "latin-1")  # what a file that is not UTF-8 (and has no byte-order mark) is read as
_DECOMPRESS = (
    "data_hf.py reads text files, not compressed ones; decompress them first (gunzip -k, unzstd, unxz -k, bunzip2 -k, "
    "unzip), then convert the folder"
)


class DataHfError(Exception):
    """A problem the user can fix; main() prints it and exits 1."""


# --- Command line -------------------------------------------------------------------------------------------


def _available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def build_parser() -> argparse.ArgumentParser:
    parser = OneValueParser(
        prog="data_hf.py",
        description="Convert text/Markdown/JSON/JSONL/YAML files into a Hugging Face dataset with one 'text' column "
        "(plain text), one 'messages' column (conversations), 'prompt', 'chosen' and 'rejected' columns "
        "(preference pairs, for DPO) or 'prompt' and 'columns_json' (prompts with their other fields, for GRPO).",
    )
    parser.add_argument(
        "--data_folder", "--data-folder", dest="data_folder", type=_path_arg, required=True,
        help="folder to read recursively (e.g. the splits/ of organize_data.py, or the raw folder itself); "
        "hidden files and folders are skipped",
    )  # fmt: skip
    parser.add_argument(
        "--save_dir", "--save-dir", dest="save_dir", type=_path_arg, required=True,
        help="output folder for datasets.load_from_disk (e.g. hf_datasets/my_corpus); must not exist unless --overwrite",
    )  # fmt: skip
    parser.add_argument(
        "--extensions", nargs="+", action=JoinRepeats, default=list(DEFAULT_EXTENSIONS), metavar="EXT",
        help=f"extensions to read, space- or comma-separated (default: {' '.join(DEFAULT_EXTENSIONS)}); .json, .jsonl, .ndjson, .yaml "
        "and .yml are parsed, any other extension is read as plain text",
    )  # fmt: skip
    parser.add_argument(
        "--format", dest="data_format", choices=DATA_FORMATS, default="auto",
        help="text: a 'text' column; chat: a 'messages' column, one conversation per record (messages, ShareGPT "
        "conversations, instruction/input/output, prompt/completion, question/answer; .txt/.md are skipped); "
        "preference: 'prompt', 'chosen' and 'rejected' columns (lists of messages), one pair per record with chosen "
        "and rejected (beside prompt, ShareGPT conversations, or instruction; or alone as whole conversations or "
        "Anthropic HH strings whose shared start is the prompt; .txt/.md are skipped); prompts: 'prompt' (a list of "
        "messages) and 'columns_json' (the record's other fields, e.g. the answer, as JSON), one prompt per record "
        "from a prompt, question, problem or instruction (+ input) key, for --objective grpo (.txt/.md are skipped); "
        "auto: chat if every record read is a conversation, preference if every one is a pair, else text, with a "
        "note counting them (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--json-mode", "--json_mode", dest="json_mode", choices=JSON_MODES, default="strings",
        help="text from JSON/JSONL/YAML: strings, one row per string value; records, one row per record (array "
        "element, top-level object, line, YAML document) with its strings joined by newlines (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--max-chars", "--max_chars", dest="max_chars", type=int, default=DEFAULT_MAX_CHARS,
        help="longest row in characters; longer text is split at blank lines, else at newlines; a longer "
        "conversation, preference pair or prompt record is skipped (default: %(default)s)",
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
        help="fail (exit 1, nothing written) if anything was skipped (a bad file, a bad JSONL line, ...) or a file "
        "that is not UTF-8 was read as cp1252 or Latin-1 (a guess)",
    )  # fmt: skip
    return parser


def validate_args(args: argparse.Namespace) -> list[str]:
    """Every problem with the flags, each naming the flag and the fix."""
    return [*_data_folder_problems(args), *_number_problems(args), *_save_dir_problems(args)]


def _path_arg(value: str) -> Path:
    """A path flag's value; an empty one (an unset shell variable) would mean the current folder."""
    if not value.strip():
        raise argparse.ArgumentTypeError("an empty path (an unset shell variable?); give the folder by name")
    return Path(value)


def _data_folder_problems(args: argparse.Namespace) -> list[str]:
    folder, errors = args.data_folder, []
    if why := unreadable(folder):
        errors.append(f"--data_folder {folder} cannot be read ({why}); fix its permissions, or run as a user who can")
    elif not folder.exists():
        what = broken_link(folder) or "does not exist"
        errors.append(f"--data_folder {folder} {what}; pass the folder that holds your files")
    elif not (folder.is_dir() or folder.is_file()):
        errors.append(f"--data_folder {folder} is neither a folder nor a regular file (a pipe or a device?); pass "
                      "the folder that holds your files")  # fmt: skip
    elif folder.is_file() and not has_ending(folder.name, args.extensions):
        suffix = file_ending(folder.name)
        ending = f"ending in {suffix}" if suffix else "without an ending"
        fix = f"pass --extensions {suffix.lstrip('.')} to read it as plain text"
        if not suffix:
            fix = "rename it with an ending such as .txt, or pass the folder that holds your files"
        elif is_compressed(suffix):
            fix = _DECOMPRESS
        elif suffix in NOT_TEXT_ENDINGS:
            fix = "data_hf.py reads text files only: convert it to .jsonl or text first"
        errors.append(f"--data_folder {folder} is a file {ending}, which --extensions does not list; {fix}")
    elif manifest := unfinished_splits(folder):
        errors.append(
            f"--data_folder {folder}: organize_data.py has not finished these split folders ({manifest} says "
            '"complete": false), so files are missing from them; rerun the same organize_data.py command to finish, '
            "then convert"
        )
    elif (kind := folder_kind(folder)) is not None and kind.kind != "split folders":
        instead = (
            f"train on it with fsdp_train.py -d {folder}"
            if kind.kind == "dataset"
            else "pass the folder that holds your raw files"
        )
        errors.append(f"--data_folder {kind.describe(folder)}, not raw files; {instead}")
    if not args.extensions:
        errors.append(f"--extensions is empty; e.g. --extensions {' '.join(DEFAULT_EXTENSIONS)}")
    for ending in args.extensions:
        if is_compressed(ending):
            errors.append(f"--extensions {ending.lstrip('.')}: {_DECOMPRESS}")
        elif ending == "." or any(char in ending for char in "*?[]/\\"):
            typed = ending[1:] or ending  # as given: normalize_extensions put the dot in front
            example = f"--extensions {m[1]}" if (m := re.fullmatch(r"\*\.(\w+)", typed)) else "txt or .md"
            errors.append(f"--extensions {typed} is not a file ending; give endings such as {example} (no "
                          "wildcards, no paths)")  # fmt: skip
    return errors


def _number_problems(args: argparse.Namespace) -> list[str]:
    errors = []
    if not 1 <= args.max_chars <= MAX_MAX_CHARS:
        errors.append(f"--max-chars {args.max_chars} must be between 1 and {MAX_MAX_CHARS}, e.g. --max-chars 200000")
    elif args.min_chars > args.max_chars:
        errors.append(f"--min-chars {args.min_chars} exceeds --max-chars {args.max_chars}: every row would be dropped")
    if args.min_chars < 0:
        errors.append(f"--min-chars {args.min_chars} must be 0 or more")
    if not 0.0 <= args.val_fraction < 1.0:
        errors.append(f"--val-fraction {args.val_fraction} must be in [0, 1), e.g. 0.01")
    most_workers = max(64, 2 * _available_cores())  # each worker is a process with its own memory
    if not 1 <= args.num_proc <= most_workers:
        errors.append(
            f"--num-proc {args.num_proc} must be between 1 and {most_workers} (twice this machine's "
            f"{_available_cores()} cores, at least 64): each worker is a process with its own memory"
        )
    return errors


def _save_dir_problems(args: argparse.Namespace) -> list[str]:
    save_dir = args.save_dir
    if why := broken_link(save_dir):
        return [f"--save_dir {save_dir} {why}; fix the link, or choose another --save_dir"]
    if save_dir.is_dir() and os.path.ismount(save_dir):  # found only at the end, after the whole conversion
        return [
            f"--save_dir {save_dir} is a mount point (a container volume?): the dataset is written beside it and "
            f"renamed into place, which cannot replace a mount point; pass a folder inside it, e.g. {save_dir / 'NAME'}"
        ]
    if occupied(save_dir):
        if not save_dir.is_dir():
            return [f"--save_dir {save_dir} exists and is not a folder; choose another --save_dir"]
        if problem := replace_problem(save_dir):  # before suggesting --overwrite: it would be refused too
            return [problem]
        if not args.overwrite:
            return [f"--save_dir {save_dir} already exists; pass --overwrite to replace it, or choose another path"]
        if args.data_folder.exists() and args.data_folder.resolve().is_relative_to(save_dir.resolve()):
            return [f"--data_folder {args.data_folder} is inside --save_dir {save_dir}, which --overwrite replaces"]
    if blocker := file_above(save_dir.absolute()):
        return [f"--save_dir {save_dir}: {blocker} is a file, not a folder; choose a --save_dir under a folder"]
    if inside := enclosing_folder(save_dir):
        return [
            f"--save_dir {save_dir} is {inside}, whose tool would delete or misread it; "
            "give the dataset a folder of its own: choose another --save_dir, e.g. hf_datasets/NAME"
        ]
    return []


def convert(args: argparse.Namespace, tmp: Path) -> tuple[dict[str, Any], dict[str, SplitWriter], int]:
    """Read the input and write the dataset into the empty folder `tmp`. Returns the summary, the writers, and the
    records an auto run found shaped like conversations or preference pairs but could not use, when it found nothing
    else: their strings are no text dataset (the run is refused)."""
    started = time.monotonic()
    files, walk_problems, other_endings = find_input_files(args.data_folder, args.extensions, exclude=[args.save_dir])
    files, text_files_skipped = record_inputs(files, args.data_format)
    # a folder skipped (unreadable, another tool's, unfinished splits) is a problem, not a file found and skipped
    folders, skipped = [], []
    for problem in walk_problems:
        (folders if os.path.isdir(problem.path) else skipped).append(problem)
    skipped += text_files_skipped
    tally = Tally(files_found=len(files) + len(skipped), files_read=len(files), files_skipped=len(skipped))
    tally.other_endings = other_endings
    for problem in skipped:
        tally.add_problem(problem, skipped_file=True)
    for problem in folders:
        tally.add_problem(problem)
    if not files:
        raise DataHfError(_no_files_message(args, len(text_files_skipped), other_endings))
    options = Options(args.max_chars, args.min_chars, args.val_fraction, args.data_format, args.json_mode)
    tasks = plan_tasks(files, piece_bytes_for(args.max_chars))
    splits = ["train", "validation"] if args.val_fraction > 0 else ["train"]
    columns = list(DATASET_COLUMNS) if args.data_format == "auto" else [RECORD_FORMATS.get(args.data_format, "text")]
    if args.data_format == "preference":  # pairs, or unpaired examples: the run learns at the end which it keeps
        columns.append("unpaired")
    # Shards go to a folder per kind: an auto run learns only at the end which of the three it keeps.
    writers = {(c, split): SplitWriter(tmp / f"parts-{c}" / split, c) for c in columns for split in splits}
    with tqdm(total=len(files), unit="file", desc="data_hf", disable=None, file=sys.stderr) as progress:
        processes = worker_count(sum(size for _, size in files), tasks, args.num_proc)
        for output in run_tasks(tasks, options, processes):
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
        tally.conversation_shaped_as_text, tally.preference_shaped_as_text, rows["unpaired"],
    )  # fmt: skip
    if column == "unpaired":  # a dataset holds one kind: the run's pairs become unpaired examples too
        for split in splits:
            unpair_into(writers["preference", split], writers["unpaired", split])
    shaped = tally.conversation_shaped_as_text + tally.preference_shaped_as_text
    # Records shaped like conversations or pairs and no plain text beside them: none usable, or two kinds mixed.
    # Either way --format auto would write their strings as text: refused (counted here, said by _refusals).
    unusable = shaped if column == "text" and not tally.plain_text_rows else 0
    if args.data_format == "auto" and (column != "text" or unusable):
        tally.adopt_chat_problems()  # why the records failed, counted by reason in the summary
    chosen = finish_writers(writers, column, splits, tmp)
    return build_summary(tally, args, chosen, column, time.monotonic() - started), chosen, unusable


def _no_files_message(args: argparse.Namespace, text_files: int, other_endings: dict[str, int]) -> str:
    """Why a run found nothing to read, and the fix."""
    where = f"under --data_folder {args.data_folder} (hidden files and folders are skipped)"
    if not text_files:
        found = f"; it holds {endings_text(other_endings)}" if other_endings else ""
        fix = _DECOMPRESS if any(map(is_compressed, other_endings)) else "check the path or pass --extensions"
        if other_endings and all(ending in NOT_TEXT_ENDINGS for ending in other_endings):
            fix = "data_hf.py reads text files only: convert them to .jsonl or text first"
        return f"no files with the extensions {' '.join(args.extensions)} {where}{found}; {fix}"
    what = {"chat": "conversation", "preference": "preference", "prompts": "prompt"}[args.data_format]
    return (
        f"no {what} files (.json .jsonl .ndjson .yaml .yml; --format {args.data_format}) {where}: its {text_files} "
        f"text file(s) are not read with --format {args.data_format}; pass --format text to convert plain text, or "
        "point --data_folder at your .json/.jsonl records"
    )


def _refusals(summary: dict[str, Any], args: argparse.Namespace, unusable: int) -> list[str]:
    """Why the converted dataset must not be published."""
    refusals = []
    mixed = summary["conversation_records_as_text"] and summary["preference_records_as_text"]
    if args.data_format == "auto" and unusable and mixed:
        refusals.append(
            f"--format auto: the folder mixes {summary['conversation_records_as_text']} conversation(s) and "
            f"{summary['preference_records_as_text']} preference pair(s) and holds no plain text; a dataset holds one "
            "kind: convert each kind's files on their own with --format chat and --format preference, or pass "
            "--format text to keep their strings as plain text"
        )
    elif args.data_format == "auto" and unusable:
        refusals.append(
            f"--format auto: all {unusable} record(s) have the shape of conversations or preference pairs but none "
            "could be used (the counts by reason above say why); fix them and rerun, or pass --format text to keep "
            "their strings as plain text"
        )
    problems = sum(summary["counts_by_reason"].values())
    if args.strict and problems:
        refusals.append(f"--strict: {problems} problem(s) found (listed above); fix them or drop --strict")
    guessed = [path for path, encoding in summary["fallback_decoded_files"].items() if encoding in GUESSED_ENCODINGS]
    if args.strict and guessed:  # Shift JIS or GBK read as cp1252 is mojibake, not a problem the reader can see
        refusals.append(
            f"--strict: {len(guessed)} file(s) are not UTF-8 and were read as {summary['fallback_decoded_files'][guessed[0]]}"
            f" (a guess; e.g. {guessed[0]}): a file in another legacy encoding (Shift JIS, GBK, ...) would become "
            "wrong text; convert them to UTF-8 (iconv -f THEIR_ENCODING -t UTF-8) or drop --strict"
        )
    if summary["rows_total"] == 0:
        found = {"messages": "conversations", "preference": "preference pairs", "prompts": "prompts"}.get(
            summary["column"]
        )
        what = f"{found} were found (see the counts by reason above)" if found else "rows were extracted"
        short = summary.get("dropped_below_min_chars", 0)
        fix = f": {short} row(s) were shorter than --min-chars {args.min_chars}; lower it" if short else ""
        refusals.append(f"no {what} from --data_folder {args.data_folder}; nothing to save{fix}")
    return refusals


def main(argv: list[str] | None = None) -> int:
    try:
        with sigterm_as_interrupt():
            return _convert_and_publish(argv)
    except KeyboardInterrupt as interrupt:  # Ctrl-C or SIGTERM: the temporary folder is gone, --save_dir untouched
        print("data_hf: interrupted; nothing was written", file=sys.stderr)
        return interrupt_exit_code(interrupt)


def _convert_and_publish(argv: list[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and on bad flags; callers of main() get the code
        return exc.code if isinstance(exc.code, int) else 2
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
        print(
            f"data_hf: error: cannot create a folder beside --save_dir {args.save_dir} ({err.strerror}: "
            f"{err.filename}); choose a --save_dir in a folder you can write, or fix its permissions",
            file=sys.stderr,
        )
        return 1
    try:
        summary, writers, unusable = convert(args, tmp)
        refusals = _refusals(summary, args, unusable)
        if refusals and unusable:  # not "extracted as text" notes above a refusal: nothing is written
            summary["notes"] = []
        print_summary(summary)
        if refusals:
            raise DataHfError("; ".join(refusals))
        if len(writers) > 1 and writers["train"].rows == 0 and writers["validation"].rows:
            raise DataHfError(
                f"--val-fraction {args.val_fraction} put all {writers['validation'].rows:,} rows in the validation "
                "split and none in train: use a smaller --val-fraction, e.g. 0.01"
            )
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
        if occupied(args.save_dir) and not args.overwrite:
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
    finally:
        if tmp.exists():
            remove_path(tmp)
    print(f"{one_line(summary)} -> {args.save_dir}")
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())
