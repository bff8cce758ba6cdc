"""Running the work: each task read and its rows split train/validation (assign_split: by a hash of the text, or of
a conversation's or pair's JSON) and encoded as Arrow chunks, in worker processes or, for small inputs and large
streamed JSON/YAML files, in the parent. process_task is what a worker process runs; it and the worker initializer
are top-level functions here, so the spawned workers import them by name."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass

from fsdp_lib.convert import reading
from fsdp_lib.convert.chunks import (
    EncodedRows,
    encode_conversations,
    encode_pairs,
    encode_prompts,
    encode_rows,
    encode_unpaired,
)
from fsdp_lib.convert.extraction import row_chars
from fsdp_lib.convert.planning import Options, Task
from fsdp_lib.convert.reading import iter_rows, note_no_text, read_file
from fsdp_lib.convert.results import FileResult, Row
from fsdp_lib.records.conversation import conversation_json
from fsdp_lib.records.preference import PreferencePair, UnpairedExample, preference_json
from fsdp_lib.records.prompts import PromptRecord, prompt_json

# Below this much input, worker processes (about a second each to start) would cost more than they save.
PARALLEL_MIN_BYTES = 32 << 20
# Results waiting to be written, per worker: bounds the parent's memory when one task is slow.
TASKS_IN_FLIGHT_PER_PROC = 2


@dataclass
class TaskOutput:
    """Rows of a task per split, and its per-piece results (rows removed: they travel encoded)."""

    splits: dict[str, list[EncodedRows]]
    files: list[FileResult]
    rows_with_surrogates: int = 0


def assign_split(text: str, val_fraction: float) -> str:
    """ "validation" for a stable `val_fraction` share of texts, else "train". Depends only on the text, so reruns
    give the same split and duplicates of a text never straddle train and validation."""
    if val_fraction <= 0:
        return "train"
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return "validation" if int.from_bytes(digest, "big") / 2**64 < val_fraction else "train"


def row_split(row: Row, val_fraction: float) -> str:
    """The split of a text row, or of a conversation or preference pair by the hash of its canonical JSON."""
    if isinstance(row, str):
        return assign_split(row, val_fraction)
    if isinstance(row, PreferencePair | UnpairedExample):
        return assign_split(preference_json(row), val_fraction)
    if isinstance(row, PromptRecord):
        return assign_split(prompt_json(row), val_fraction)
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
        prompts = [row for row in split_rows if isinstance(row, PromptRecord)]
        unpaired = [row for row in split_rows if isinstance(row, UnpairedExample)]
        output.splits[split], replaced = encode_rows(texts)
        encoders = ((encode_conversations, conversations), (encode_pairs, pairs), (encode_prompts, prompts),
                    (encode_unpaired, unpaired))  # fmt: skip
        for encode, kept in encoders:
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
    """Rows of a large JSON or YAML file in outputs of about reading.MIN_PIECE_BYTES characters (runs in the
    parent). The piece size is read from its module at each call: one setting governs both."""
    piece = task.pieces[0]
    result = FileResult(path=piece.path)
    rows: list[Row] = []
    size = 0
    for row in iter_rows(piece.path, result, options.extraction, options.min_chars):
        rows.append(row)
        result.rows_kept += 1
        size += row_chars(row)
        if size >= reading.MIN_PIECE_BYTES:
            yield _rows_to_output(rows, [], options.val_fraction)
            rows, size = [], 0
    note_no_text(result)
    yield _rows_to_output(rows, [result], options.val_fraction)


def worker_count(input_bytes: int, tasks: list[Task], num_proc: int) -> int:
    """The processes that read `input_bytes` of input: the parent alone (1) under PARALLEL_MIN_BYTES, else
    --num-proc, at most one per task."""
    return 1 if input_bytes < PARALLEL_MIN_BYTES else min(num_proc, len(tasks))


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
    forever, because each of them holds the task queue open; a watcher thread ends the worker instead. Workers
    ignore Ctrl-C (the terminal sends it to every process of the group): the parent alone reports it, in one line,
    and shuts the pool down, each worker finishing its task (ended mid-write, a worker could leave the pool's
    result pipe half-written and the shutdown waiting on it forever)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

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
