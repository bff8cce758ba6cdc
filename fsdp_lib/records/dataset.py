"""Loading a saved dataset, shared by the trainer, data_hf.py, model_download.py and the demo: a folder written by
data_hf.py (save_to_disk), or a hub dataset ORG/NAME already in the HF_HOME cache, loaded offline. No torch here:
data_hf.py imports it, and its worker processes must stay small."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_lib.markers import INCOMPLETE_DOWNLOAD, unfinished_download
from fsdp_lib.offline import download_dataset_command, hub_dataset_snapshot, is_hub_dataset_id, set_offline
from fsdp_lib.records.schema import dataset_kind

if TYPE_CHECKING:
    import datasets


# --- Loading --------------------------------------------------------------------


def load_text_dataset(
    path: str | Path, text_column: str | None = None, column_flag: bool = True
) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """(train, validation or None) from a folder written by data_hf.py, or from a hub dataset id ORG/NAME fetched
    beforehand into the HF_HOME cache (`model_download.py --dataset ORG/NAME`), loaded offline.

    A data_hf.py folder is a Dataset, or a DatasetDict with a `train` and an optional `validation` split. Each split
    has a `text` column (plain text), a `messages` column (conversations: lists of {"role", "content"}) or
    `prompt`, `chosen` and `rejected` columns (preference pairs, each a list of messages), or a `prompt` column
    (--objective grpo's prompts, with any other columns); with
    `text_column` that column is used as the text instead (column_flag: the caller has --text-column, which
    messages suggest). Memory-mapped, never copied."""
    import datasets
    import pyarrow as pa

    folder = Path(path)
    if is_hub_dataset_id(str(path)):
        train, validation = load_hub_dataset(str(path))
        source = f"hub dataset {path}"
        how_to_make = f"check the dataset on the hub, or fetch it again with: {download_dataset_command(str(path))}"
    else:
        how_to_make = f"create it with: python data_hf.py --data_folder <your files> --save_dir {folder}"
        if not folder.is_dir():
            raise ValueError(f"dataset folder {folder} does not exist or is not a folder; {how_to_make}")
        if not (folder / "state.json").is_file() and not (folder / "dataset_dict.json").is_file():
            raise ValueError(f"{folder} is not a saved dataset (no state.json or dataset_dict.json); {how_to_make}")
        try:
            loaded = datasets.load_from_disk(str(folder))
        except IndexError as err:  # datasets saves a split without rows as no Arrow file, then cannot load it
            raise ValueError(f"{folder} holds a split without rows, which datasets cannot load; {how_to_make}") from err
        except (OSError, ValueError, pa.ArrowException) as err:
            raise ValueError(f"{folder} could not be loaded as a saved dataset ({err}); {how_to_make}") from err
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise ValueError(f"{folder} has the splits {sorted(loaded)} but no 'train' split; {how_to_make}")
            train, validation = loaded["train"], loaded.get("validation", loaded.get("test"))  # as a hub dataset
        else:
            train, validation = loaded, None
        source = str(folder)
    if text_column:
        train = use_as_text(train, text_column, "train", source)
        validation = use_as_text(validation, text_column, "validation", source)
    for name, split in (("train", train), ("validation", validation)):
        if split is not None and dataset_kind(split.column_names) is None:
            if hint := _shape_hint(split.column_names):
                raise ValueError(f"{source}: the {name} split has the columns {split.column_names}: {hint}")
            raise ValueError(
                f"{source}: the {name} split has the columns {split.column_names} but no 'text' or 'messages' "
                f"column, nor 'prompt', 'chosen' and 'rejected' (preference pairs) or 'prompt' alone (prompts for "
                f"--objective grpo); "
                + ("pass --text-column NAME to use another column as the text, or " if column_flag else "")
                + how_to_make
            )
    return train, validation


# Rows of a dataset the trainer cannot read as it is, which data_hf.py reads from JSON Lines.
_AS_FILES = (
    "write its rows to JSON Lines (datasets' Dataset.to_json('rows/train.jsonl')) and convert them with: python "
    "data_hf.py --data_folder rows --save_dir <new dataset> --format {}"
)


def _shape_hint(columns: list[str]) -> str | None:
    """What a dataset of a known shape without the trainer's columns is, and how to convert it; None otherwise.
    Pairs without a prompt column (TRL's implicit prompt, Anthropic HH strings) and question/problem prompts were
    told to pass --text-column, which would train one column as plain text."""
    names = {column.lower() for column in columns}
    if {"chosen", "rejected"} <= names and (asked := sorted(names & {"question", "query", "input", "instruction"})):
        return f"preference pairs whose prompt is in '{asked[0]}' (as in Orca DPO pairs): " + _AS_FILES.format(
            "preference"
        )
    if {"chosen", "rejected"} <= names:
        return (
            "preference pairs without a 'prompt' column (an implicit prompt, as in Anthropic HH): data_hf.py splits the "
            "prompt the two responses share off them; " + _AS_FILES.format("preference")
        )
    if names & {"question", "problem", "instruction", "query"}:
        return "prompts (or exchanges) under another name: " + _AS_FILES.format("prompts (for GRPO) or chat (for SFT)")
    return None


def use_as_text(split: Any, column: str, name: str, source: str) -> Any:
    """The split with `column` renamed to `text` (the column the trainer reads); None stays None."""
    if split is None:
        return None
    if column not in split.column_names:
        mixed = (
            f"; it has 'text': --text-column names the column of every --dataset-name, so to mix this one with a "
            f"dataset whose text is in {column!r}, rename that column to 'text' (datasets: "
            f"Dataset.rename_column({column!r}, 'text'), then save_to_disk) and leave --text-column out"
            if "text" in split.column_names
            else ""
        )
        raise ValueError(
            f"--text-column {column}: {source} has no column {column!r} in its {name} split "
            f"(columns: {split.column_names}){mixed}"
        )
    dtype = getattr(split.features[column], "dtype", None)
    if dtype not in ("string", "large_string"):
        listed = type(split.features[column]).__name__ in ("List", "Sequence", "LargeList", "list")
        kind = "lists (conversations?)" if listed else (f"{dtype} values" if dtype else "structured values")
        raise ValueError(
            f"--text-column {column}: the column {column!r} of {source}'s {name} split holds {kind}, not text; "
            "name a column of strings (a column of conversations trains as chat: data_hf.py --format chat writes it "
            "as 'messages')"
        )
    if column == "text":
        return split
    if "text" in split.column_names:
        split = split.remove_columns("text")
    return split.rename_column(column, "text")


# --- Hub datasets, offline ----------------------------------------------------------------------------------


def load_hub_dataset_dict(
    repo_id: str, revision: str | None = None, finished_only: bool = False
) -> datasets.DatasetDict:
    """Every split of a cached hub dataset, loaded from its snapshot folder with datasets' offline mode on: nothing
    here may reach the network. Split names come from the file names (train, validation, test) or the card.
    `finished_only`: refused while its download by model_download.py is unfinished (the shards it had fetched
    loaded, and a run trained on part of the data); the download's own check loads it before it is finished."""
    import datasets

    folder = hub_dataset_snapshot(repo_id, revision)
    if finished_only and (rerun := unfinished_download(folder)):
        raise ValueError(
            f"hub dataset {repo_id}: its download did not finish ({INCOMPLETE_DOWNLOAD}); finish it with: {rerun}"
        )
    saved = set_offline()
    try:
        return datasets.load_dataset(str(folder))
    except Exception as exc:  # noqa: BLE001 - datasets raises many types for unreadable files
        raise ValueError(f"hub dataset {repo_id}: the cached files in {folder} do not load ({exc})") from exc
    finally:
        set_offline(saved)


def load_hub_dataset(repo_id: str, revision: str | None = None) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """(train, validation, else test, else None) of a cached hub dataset, offline, its download finished."""
    loaded = load_hub_dataset_dict(repo_id, revision, finished_only=True)
    if "train" not in loaded:
        raise ValueError(f"hub dataset {repo_id} has the splits {sorted(loaded)} but no 'train' split")
    return loaded["train"], loaded.get("validation", loaded.get("test"))
