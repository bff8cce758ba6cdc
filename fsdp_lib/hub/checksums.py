"""A downloaded model's files against the hub's checksums (model_download.py --checksums): huggingface_hub keeps each
file's ETag, the SHA-256 of a large (LFS) file or the git blob SHA-1 of a small one, as the blob's name in the
HF_HOME cache and in a --local-dir's .cache/huggingface/download/NAME.metadata. Verification otherwise reads headers
and sizes only; this reads every byte, so it finds a file corrupted at its own size (a bad disk, a partial copy of
HF_HOME to an offline machine). No torch."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_lib.errors import name_sample
from fsdp_lib.markers import INCOMPLETE_DOWNLOAD, VERIFICATION_RECORD

HUB_CHECKSUM = re.compile(r"[0-9a-f]{64}|[0-9a-f]{40}")  # SHA-256 (LFS) or git blob SHA-1
_CHUNK = 16 << 20


@dataclass
class ChecksumReport:
    checked: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)  # files the hub's checksum is not known for
    problems: list[str] = field(default_factory=list)

    def summary(self) -> str:
        unknown = f"; no hub checksum for {name_sample(self.unknown)}" if self.unknown else ""
        return f"checksums: {len(self.checked)} file(s) match the hub's{unknown}"


def download_note(local_dir: Path, name: str) -> tuple[str, float | None] | None:
    """(ETag, time of download or None) of local_dir/name from huggingface_hub's note in a --local-dir
    (.cache/huggingface/download/NAME.metadata: commit, ETag, time, a line each), or None without a readable one
    holding a checksum."""
    note = local_dir / ".cache" / "huggingface" / "download" / f"{name}.metadata"
    try:
        lines = note.read_text().splitlines()
        etag = lines[1].strip()
    except (OSError, IndexError):
        return None
    try:
        downloaded_at: float | None = float(lines[2])
    except (IndexError, ValueError):
        downloaded_at = None
    return (etag, downloaded_at) if HUB_CHECKSUM.fullmatch(etag) else None


def hub_etag(folder: Path, name: str) -> str | None:
    """The hub's checksum of folder/name as huggingface_hub recorded it, or None when it did not download it."""
    path = folder / name
    if path.is_symlink():  # a cache snapshot: snapshots/COMMIT/NAME -> ../../blobs/ETAG
        etag = Path(os.readlink(path)).name
        return etag if HUB_CHECKSUM.fullmatch(etag) else None
    note = download_note(folder, name)
    return note[0] if note is not None else None


def hub_checksum_of(path: Path, kind_of: str) -> str:
    """SHA-256 of the bytes (kind_of a 64-digit ETag), else the git blob SHA-1 the hub gives a small file."""
    digest = hashlib.sha256() if len(kind_of) == 64 else hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def check_against_hub(folder: Path) -> ChecksumReport:
    """Every file of the model folder (not huggingface_hub's .cache/ nor our verification record) against its ETag;
    a cache snapshot's link whose blob is gone is a problem too."""
    report = ChecksumReport()
    entries = [
        path
        for path in folder.rglob("*")
        if (path.is_file() or path.is_symlink())
        and ".cache" not in path.relative_to(folder).parts
        and path.name not in (VERIFICATION_RECORD, INCOMPLETE_DOWNLOAD)
    ]
    names = sorted(path.relative_to(folder).as_posix() for path in entries)
    for name in names:
        if not (folder / name).exists():
            report.problems.append(f"{name} is a link to a blob that is gone ({os.readlink(folder / name)})")
            continue
        etag = hub_etag(folder, name)
        if etag is None:
            report.unknown.append(name)
        elif hub_checksum_of(folder / name, etag) != etag:
            report.problems.append(
                f"{name} differs from the hub's copy (checksum {etag[:12]}...): changed or corrupt on disk"
            )
        else:
            report.checked.append(name)
    if not report.checked and not report.problems:
        in_cache = folder.parent.name == "snapshots"
        why = (
            "a copy of HF_HOME that replaced the cache's links by files (cp -L, scp -r, rsync without -l): the blob "
            "names that hold the hub's checksums are gone; copy it with cp -a or rsync -a"
            if in_cache
            else "not downloaded by huggingface_hub"
        )
        report.problems.append(f"no file of {folder} has a hub checksum ({why}): --checksums cannot check it")
    return report


def discard(folder: Path, names: list[str]) -> None:
    """Remove these files of a download, so that a rerun fetches them again: in a cache snapshot the link and its
    blob (huggingface_hub skips a blob that exists), in a --local-dir the file and huggingface_hub's note of it
    (which would say it is complete)."""
    for name in names:
        path = folder / name
        if path.is_symlink():
            path.resolve().unlink(missing_ok=True)
        else:
            (folder / ".cache" / "huggingface" / "download" / f"{name}.metadata").unlink(missing_ok=True)
        path.unlink(missing_ok=True)
