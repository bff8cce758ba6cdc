"""Writing the dataset: SplitWriter streams one split's Arrow chunks into shards with the layout of
`save_to_disk` (state.json and dataset_info.json from datasets' own templates, so `datasets.load_from_disk` reads
it); arrow_type and column_features give each column of the schema (fsdp_lib/records/schema.py) its Arrow type and
datasets feature; choose_column decides which kind of dataset a run keeps, and finish_writers keeps its writers.
pyarrow and datasets are imported in the functions that use them: the worker processes never load them."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_lib.convert.chunks import EncodedRows
from fsdp_lib.convert.extraction import RECORD_FORMATS
from fsdp_lib.convert.publish import remove_path
from fsdp_lib.records.schema import DATASET_COLUMNS, turn_fields

if TYPE_CHECKING:
    import datasets
    import pyarrow as pa

# Same as datasets' save_to_disk default (config.MAX_SHARD_SIZE = "500MB").
SHARD_BYTES = 500_000_000


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
        self._open_shard()
        self._writer.write_batch(self._pa.record_batch(self._arrays(chunk), schema=self.schema))
        self.rows += chunk.count
        self.text_bytes += chunk.text_bytes
        self.digest.update(chunk.digest)
        self._shard_size += chunk.text_bytes + len(chunk.offsets)
        if self._shard_size >= self.shard_bytes:
            self._close_shard()

    def _open_shard(self) -> None:
        if self._writer is None:
            part = self.folder / f"data-{len(self._parts):05d}.arrow.part"
            self._parts.append(part)
            self._sink = self._pa.OSFile(str(part), "wb")
            self._writer = self._pa.ipc.new_stream(self._sink, self.schema)
            self._shard_size = 0

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
        if chunk.column == "bool":
            return pa.Array.from_buffers(pa.bool_(), chunk.count, [None, pa.py_buffer(chunk.values)])
        if chunk.roles is None or chunk.contents is None:
            return self._strings(chunk)
        turns = [self._strings(part) for part in (chunk.roles, chunk.contents, *chunk.turn_fields)]
        messages = pa.StructArray.from_arrays(turns, fields=list(list_type.value_type))
        offsets = pa.Array.from_buffers(pa.int32(), chunk.count + 1, [None, pa.py_buffer(chunk.offsets)])
        return pa.ListArray.from_arrays(offsets, messages, type=list_type)

    def write_batch(self, batch: pa.RecordBatch) -> None:
        """An Arrow record batch of this writer's schema (unpair_into's), its buffers' hash in the digest."""
        if batch.num_rows == 0:
            return
        self._open_shard()
        self._writer.write_batch(batch)
        self.rows += batch.num_rows
        self.text_bytes += batch.nbytes
        for column in batch.columns:
            for buffer in column.buffers():
                if buffer is not None:
                    self.digest.update(buffer)
        self._shard_size += batch.nbytes
        if self._shard_size >= self.shard_bytes:
            self._close_shard()

    @property
    def parts(self) -> list[Path]:
        return list(self._parts)

    def close_shard(self) -> None:
        self._close_shard()

    def discard(self) -> None:
        """Drop what was written (the column --format auto did not choose)."""
        self._close_shard()
        remove_path(self.folder)

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
            remove_path(self.folder)
        # The templates come from datasets' own save_to_disk, so only the two fields it fills from the data change.
        state = dict(state_template, _data_files=names, _fingerprint=self.digest.hexdigest())
        (folder / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
        (folder / "dataset_info.json").write_text(json.dumps(info_template, indent=2, sort_keys=True) + "\n")


def arrow_type(column: str) -> pa.DataType:
    """The Arrow type of a column: `text` and `tools` a string; `messages` list<struct<role, content, tool_calls,
    name, tool_call_id: string>>; a preference dataset's `prompt`, `chosen`, `rejected` list<struct<role: string,
    content: string>>: the types datasets gives the features of column_features."""
    import pyarrow as pa

    if column in ("text", "tools", "columns_json"):
        return pa.string()
    if column == "label":
        return pa.bool_()
    return pa.list_(pa.struct([pa.field(name, pa.string()) for name in turn_fields(column)]))


def column_features(column: str) -> datasets.Features:
    """The datasets features of a dataset of the kind `column` ("text"; "messages": messages and tools; or
    "preference": the columns prompt, chosen and rejected, lists of role/content turns)."""
    import datasets

    features = {}
    for name in DATASET_COLUMNS[column]:
        if name in ("text", "tools", "columns_json"):
            features[name] = datasets.Value("string")
        elif name == "label":
            features[name] = datasets.Value("bool")
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


def choose_column(
    data_format: str, plain_text_rows: int, conversations: int, pairs: int = 0, conversation_records: int = 0,
    preference_records: int = 0, unpaired: int = 0,
) -> str:  # fmt: skip
    """The kind of dataset a run writes (a key of DATASET_COLUMNS): "text" for --format text, "messages" for
    --format chat, "preference" for --format preference, or "unpaired" when that run read unpaired examples (its
    pairs are then unpaired: unpair_into). --format auto writes "messages" when it found conversations and nothing
    else, "preference" (or "unpaired") when it found preference data and nothing else, else "text", exactly as
    --format text would. Nothing else: no other text (rows from text files or from other records) and no record of
    the other kind (`conversation_records`, `preference_records`: records of each kind read, usable or not)."""
    preference = "unpaired" if unpaired else "preference"
    if data_format != "auto":
        return preference if data_format == "preference" else RECORD_FORMATS.get(data_format, "text")
    if plain_text_rows:
        return "text"
    if (pairs or unpaired) and not conversation_records:
        return preference
    return "messages" if conversations and not preference_records else "text"


def unpair_into(pairs: SplitWriter, examples: SplitWriter) -> None:
    """Append the rows `pairs` wrote (prompt, chosen, rejected) to `examples` as unpaired examples: for each pair,
    (prompt, chosen, true) then (prompt, rejected, false), in order. Read back from its closed shards, batch by
    batch, so memory does not grow with the data."""
    import pyarrow as pa

    pairs.close_shard()
    for part in pairs.parts:
        with pa.memory_map(str(part)) as source:
            for batch in pa.ipc.open_stream(source):
                n = batch.num_rows
                twice = pa.array([i // 2 for i in range(2 * n)], type=pa.int64())
                alternate = pa.array([i // 2 + (i % 2) * n for i in range(2 * n)], type=pa.int64())
                responses = pa.concat_arrays([batch.column("chosen"), batch.column("rejected")])
                labels = pa.array([i % 2 == 0 for i in range(2 * n)], type=pa.bool_())
                columns = [batch.column("prompt").take(twice), responses.take(alternate), labels]
                examples.write_batch(pa.record_batch(columns, schema=examples.schema))


def finish_writers(
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
        remove_path(tmp / f"parts-{writer_column}")
    if "dataset_dict.json" in templates:
        (tmp / "dataset_dict.json").write_text(json.dumps(templates["dataset_dict.json"]) + "\n")
    return chosen
