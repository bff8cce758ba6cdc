"""Which training checkpoint to resume from: find the complete ones (`step_N/` folders), verify the newest
against its checksums.json (each rank checks a share of the files), move damaged ones aside as
`corrupt_step_N`, and remove folders of interrupted saves. Saving and loading live in checkpoint.py."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch.distributed as dist

from fsdp_lib.errors import CheckpointError
from fsdp_lib.integrity import checksum_problems
from fsdp_lib.markers import EXPERIMENT_STATE, step_dirs, step_of
from fsdp_lib.runtime import Dist, broadcast_object, log
from fsdp_lib.train.checkpoint import CHECKSUM_FILE


def latest_intact_checkpoint(root: Path, d: Dist, export: bool = False) -> Path | None:
    """The newest complete checkpoint whose files match their checksums. Damaged newer ones are reported and
    moved aside (corrupt_step_N; `export`: said as what an --export-only then exports); if every checkpoint is
    damaged, nothing is moved and the run stops.
    Rank 0 first removes incomplete folders: the experiment lock makes sure no live run is writing them."""
    found = None
    if d.is_main and root.is_dir():
        for tmp in sorted(root.glob(".tmp_step_*")):
            log(f"removing incomplete checkpoint {tmp} (a save was interrupted)")
            shutil.rmtree(tmp, ignore_errors=True)
        found = [str(p) for p in step_dirs(root)]
    damaged: list[tuple[Path, list[str]]] = []
    for path in map(Path, reversed(broadcast_object(found, d) or [])):
        problems = verify_checkpoint(path, d)
        if not problems:
            _set_aside(root, damaged, path, d, export)
            return path
        damaged.append((path, problems))
    if damaged:
        details = "\n".join(f"  {p}" for _, problems in damaged for p in problems)
        raise CheckpointError(
            f"no intact checkpoint in {root}; damaged files:\n{details}\nNothing was resumed or moved. "
            f"Restore those files; or, to start over from step 0, move the damaged checkpoints aside and delete "
            f"{root.parent / EXPERIMENT_STATE} and {root.parent / 'final'}; or use a new --experiment-name."
        )
    return None


def verify_checkpoint(path: Path, d: Dist) -> list[str]:
    """Every rank checks its share of the files against checksums.json, in parallel; all get every problem."""
    misnamed = _misnamed(path) if d.is_main else []
    try:
        recorded = json.loads((path / CHECKSUM_FILE).read_text())["files"]
    except FileNotFoundError:
        if _written_with_checksums(path):  # lost since (a partial copy or sync): nothing vouches for its files
            return broadcast_object([*misnamed, f"{path / CHECKSUM_FILE}: missing, though the checkpoint was written "
                                                 "with it (a partial copy?)"], d)  # fmt: skip
        log(f"WARNING: {path} has no {CHECKSUM_FILE} (written by an older version); its files are not verified")
        return broadcast_object(misnamed, d)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"{path / CHECKSUM_FILE}: unreadable ({exc})"]
    mine = sorted(recorded)[d.rank :: d.world_size]
    found: list[list[str] | None] = [None] * d.world_size
    dist.all_gather_object(found, checksum_problems(path, mine, recorded) + misnamed, group=d.cpu_group)
    return [problem for part in found for problem in part or []]


def _written_with_checksums(path: Path) -> bool:
    """Whether the checkpoint's train_state.json says it was saved with a checksums.json (this version's are)."""
    try:
        return json.loads((path / "train_state.json").read_text()).get("checksummed") is True
    except (OSError, ValueError, AttributeError):
        return False


def _misnamed(path: Path) -> list[str]:
    """A folder copied or renamed by hand (cp -r step_10 step_30) is the newest by its name but resumes at its own
    step, so every rerun would train the same steps again from it."""
    try:
        step = json.loads((path / "train_state.json").read_text())["train_state"]["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return []  # the load says what is wrong with it
    named = step_of(path)
    if step == named:
        return []
    return [
        f"{path / 'train_state.json'}: step {step}, but the folder is named step {named} (copied or renamed by hand?)"
    ]


def _set_aside(root: Path, damaged: list[tuple[Path, list[str]]], intact: Path, d: Dist, export: bool) -> None:
    then = (
        f"EXPORTING THE OLDER CHECKPOINT {intact.name}, not the newest; to export that one, restore its files, "
        "move it back and export again"
        if export
        else f"RESUMING FROM THE OLDER CHECKPOINT {intact.name}; the steps after it are trained again"
    )
    for path, problems in damaged:
        if d.is_main:
            aside = root / f"corrupt_{path.name}"
            for n in range(2, 1000):
                if not aside.exists():
                    break
                aside = root / f"corrupt_{path.name}_{n}"
            os.rename(path, aside)
            files = "\n".join(f"  {p}" for p in problems)
            log(f"WARNING: checkpoint {path.name} is damaged:\n{files}\nMoved it aside to {aside}. {then}.")
    dist.barrier(group=d.cpu_group)
