"""Talking to the hub: fetching a model's training files into the HF_HOME cache or a plain folder (free space
checked up front, complete files skipped on a rerun, interrupted ones resumed), finding a model already in the
cache, and turning what huggingface_hub raises into a message that names the cause and the fix. No torch."""

from __future__ import annotations

import contextlib
import errno
import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp_lib.errors import file_above, name_sample
from fsdp_lib.hub.checksums import HUB_CHECKSUM, discard, download_note, hub_checksum_of, hub_etag
from fsdp_lib.hub.console import ToolError, interruptible, log
from fsdp_lib.hub.plan import glob_escape, is_weight_file, plan_download
from fsdp_lib.hub.verify import (
    DOWNLOAD_SOURCE,
    VERIFICATION_RECORD,
    folder_source,
    read_verification_record,
    remove_verification_record,
    write_download_source,
)
from fsdp_lib.markers import INCOMPLETE_DOWNLOAD, WHOLE_FOLDER_KINDS, enclosing_folder, folder_kind, unfinished_download
from fsdp_lib.model.hf_files import shards_from_index
from fsdp_lib.model.memory_plan import format_bytes
from fsdp_lib.offline import cached_snapshot

OFFLINE_HINT = "on an offline machine copy HF_HOME from one that has internet"
# Seconds any request to the hub may wait to connect or between bytes where huggingface_hub sets no timeout of its
# own (its default is none: a hub or proxy that accepts and never answers hung a download for ever, in the file
# list, the tree listing or a revision's lookup). Its file downloads keep their own (HF_HUB_DOWNLOAD_TIMEOUT).
HUB_TIMEOUT_S = 60.0


def bound_hub_requests() -> None:
    """Every request huggingface_hub sends waits at most HUB_TIMEOUT_S (read when it is sent) where it would wait for
    ever: its client is the default one plus a request hook filling the timeouts left unset."""
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils import _http

    def bounded(request: Any) -> None:
        limits = {"connect": None, "read": None, "write": None, "pool": None, **request.extensions.get("timeout", {})}
        request.extensions["timeout"] = {
            key: HUB_TIMEOUT_S if value is None else value for key, value in limits.items()
        }

    def client() -> Any:
        made = _http.default_client_factory()
        made.event_hooks = {**made.event_hooks, "request": [*made.event_hooks["request"], bounded]}
        return made

    set_client_factory(client)


# A hub id: NAME or ORG/NAME, each part letters, digits, '-', '_' and '.', at most 96 characters.
HUB_ID_PART = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?|[A-Za-z0-9]")


def offline_mode_message(repo_id: str) -> str:
    return (
        f"HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set, so {repo_id} cannot be downloaded: this machine is"
        f" offline. Unset it where there is internet and rerun; {OFFLINE_HINT} (then check the copy with"
        " --verify-only)"
    )


def hub_id_problem(flag: str, value: str | None, example: str, parts: tuple[int, ...] = (1, 2)) -> str | None:
    """Why `value` is not a hub id for `flag` (an empty value, a URL, a local path, spaces, too many parts), or None."""
    if value is None:
        return None
    if not value.strip():
        return f"{flag} is empty; pass a hub id such as {example}"
    if value.startswith(("http://", "https://", "huggingface.co/", "hf.co/")):
        guess = "/".join(part for part in value.split("/")[3:] if part not in ("datasets", "tree", "main"))
        shown = f" ({flag} {guess})" if guess and hub_id_problem(flag, guess, example, parts) is None else ""
        return f"{flag} {value} is a URL; pass the hub id, the part after huggingface.co/{shown}, e.g. {example}"
    if Path(value).expanduser().exists():
        kind = folder_kind(Path(value).expanduser())
        if kind is not None and kind.kind == "dataset":
            use = f"A dataset folder needs no download: train on it with fsdp_train.py -d {value}"
        elif kind is not None and kind.kind == "model":
            use = (
                f"A model folder needs no download: train with fsdp_train.py -m {value}, check it with"
                f" --verify-only --local-dir {value}"
            )
        else:
            use = "A local folder needs no download: a model folder trains with fsdp_train.py -m, a dataset with -d"
        return f"{flag} {value} is a local path; {flag} takes a hub id. {use}"
    if value.startswith((".", "/", "~")):
        return f"{flag} {value} looks like a local path and does not exist; pass a hub id such as {example}"
    names = value.split("/")
    if len(names) not in parts or not all(HUB_ID_PART.fullmatch(name) for name in names):
        return (
            f"{flag} {value!r}: expected a hub id {'ORG/NAME' if parts == (2,) else 'ORG/NAME or NAME'} of"
            f" letters, digits, '-', '_' and '.', e.g. {example}"
        )
    return None


def explain_hub_error(exc: BaseException, repo_id: str, revision: str, flag: str = "--model-name") -> str | None:
    """A message naming the cause and the fix for an exception raised while talking to the hub, or None.

    Looks through the whole __cause__/__context__ chain: huggingface_hub often wraps the real error (a refused
    connection inside LocalEntryNotFoundError, an ENOSPC inside its own OSError).
    """
    from huggingface_hub import errors as hub_errors

    chain = _exception_chain(exc)
    names = {cls.__name__ for error in chain for cls in type(error).__mro__}

    def first(cls: type[BaseException]) -> Any:
        return next((error for error in chain if isinstance(error, cls)), None)

    http_error = first(hub_errors.HfHubHTTPError)
    status = getattr(getattr(http_error, "response", None), "status_code", None)
    if any(isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT) for error in chain):
        return (
            f"disk full while downloading {repo_id} ({_first_line(exc)}); free space or point HF_HOME / --local-dir"
            " at a larger disk, then rerun: files already complete are kept"
        )
    if "OfflineModeIsEnabled" in names:
        return offline_mode_message(repo_id)
    if first(hub_errors.GatedRepoError):
        return (
            f"{repo_id} is gated: accept its licence at https://huggingface.co/{repo_id} while logged in, then pass"
            " a token with read access (HF_TOKEN=... or --token)"
        )
    if first(hub_errors.RevisionNotFoundError):
        return f"revision {revision!r} not found in {repo_id}; check --revision (a branch, tag or commit hash)"
    if first(hub_errors.RepositoryNotFoundError):
        return (
            f"repository {repo_id} not found, or it is private or gated and you are not authorised: check"
            f" {flag}, and pass a token (HF_TOKEN=... or --token) if it is private or gated"
        )
    if missing := first(hub_errors.RemoteEntryNotFoundError):
        url = str(getattr(getattr(missing, "response", None), "url", "") or "")
        name = url.rsplit("/resolve/", 1)[-1].split("/", 1)[-1] if "/resolve/" in url else "a file"
        return (
            f"{repo_id}: {name} was listed but is not there any more (HTTP 404): the repository changed during the "
            "download; rerun to fetch the new commit"
        )
    if status in (401, 403):
        return (
            f"not authorised to download {repo_id} (HTTP {status}): pass a valid token (HF_TOKEN=... or --token);"
            " a fine-grained token needs read access to this repo, or to public gated repos"
        )
    if status is not None and status >= 500:
        return f"the hub answered HTTP {status} for {repo_id} ({_first_line(http_error)}); retry later"
    if names & {"ConnectError", "ConnectionError", "TimeoutException", "Timeout", "NetworkError", "ProxyError"}:
        return (
            f"cannot reach the hub ({_first_line(exc)}); {OFFLINE_HINT}. With internet, check HF_ENDPOINT and proxies"
        )
    if "RemoteProtocolError" in names or "Consistency check failed" in str(exc):
        return f"the connection dropped while downloading {repo_id} ({_first_line(exc)}); rerun to resume"
    if first(hub_errors.LocalEntryNotFoundError):
        return f"cannot reach the hub ({_first_line(exc)}); {OFFLINE_HINT}"
    if "TooManyRedirects" in names:
        return (
            f"the hub (or a proxy) answered {repo_id}'s download with a redirect loop ({_first_line(exc)}); check "
            "HF_ENDPOINT and proxies (HTTPS_PROXY), then rerun"
        )
    if http_error is not None:
        return f"the hub answered HTTP {status} for {repo_id} ({_first_line(http_error)})"
    if "HTTPError" in names or "RequestError" in names:  # httpx's other transport and protocol errors
        return f"talking to the hub failed for {repo_id} ({_first_line(exc)}); rerun to resume"
    return None


@contextlib.contextmanager
def explained_hub_errors(repo_id: str, revision: str, flag: str = "--model-name") -> Iterator[None]:
    """Raise what explain_hub_error can explain as a ToolError with its message; anything else passes unchanged."""
    try:
        yield
    except ToolError:
        raise
    except Exception as exc:
        message = explain_hub_error(exc, repo_id, revision, flag)
        if message is None:
            raise
        raise ToolError(message) from exc


def _exception_chain(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def check_free_space(needed_bytes: int, free_bytes: int, where: Path) -> None:
    """Refuse up front rather than fail at 90% of a 140 GB download; keeps 1% + 100 MB of slack."""
    margin = needed_bytes // 100 + 100_000_000
    if needed_bytes + margin > free_bytes:
        raise ToolError(
            f"not enough disk space in {where}: the download needs {format_bytes(needed_bytes)},"
            f" {format_bytes(free_bytes)} free; free space or point HF_HOME / --local-dir at a larger disk"
        )


def free_disk_bytes(path: Path) -> int:
    existing = path
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    return shutil.disk_usage(existing).free


@dataclass
class HubSnapshot:
    """One download: where it goes and what the hub said about the repository."""

    repo_id: str
    revision: str
    local_dir: Path | None
    token: str | None
    force: bool
    commit: str
    sizes: dict[str, int]
    repo_type: str = "model"
    checksums: dict[str, str] = field(default_factory=dict)  # the listing's: an LFS file's SHA-256, else its blob id
    fetched: list[str] = field(default_factory=list)  # what this run downloaded (complete files are skipped)

    def to_fetch(self, files: list[str]) -> list[str]:
        return [name for name in files if self.force or not self.is_present(name)]

    def fetch(self, files: list[str]) -> Path:
        """Download these files (skipping complete ones) and return the folder holding them."""
        from huggingface_hub import snapshot_download

        new = self.to_fetch(files)
        fetched: list[str] = []
        interruptible(lambda: fetched.append(snapshot_download(
            self.repo_id,
            repo_type=self.repo_type,
            # a --local-dir is fetched at the commit the listing named: a branch that moves between the two fetches
            # (or between a killed run and its rerun) mixed two commits' files in it; the cache keeps one snapshot
            # folder per commit, and fetching by branch name keeps its refs/ entry, which loading by name reads
            revision=self.commit if self.local_dir is not None else self.revision,
            local_dir=self.local_dir,
            token=self.token,
            allow_patterns=[glob_escape(name) for name in files],
            force_download=self.force,
        )))  # fmt: skip
        folder = fetched[0]
        # huggingface_hub returns the folder as it is when the hub stops answering after the file list (its tree
        # listing timed out): the files it did not fetch are named here, not met later as a missing file.
        if missing := [name for name in files if not self.is_present(name)]:
            raise ToolError(
                f"the hub stopped answering while {self.repo_id} was downloaded: {name_sample(missing)} not fetched; "
                f"rerun to resume (files already complete are kept); {OFFLINE_HINT}. With internet, check HF_ENDPOINT "
                "and proxies"
            )
        self.fetched += new
        return Path(folder)

    def is_present(self, name: str) -> bool:
        if self.local_dir is not None:
            path = self.local_dir / name
            return path.is_file() and path.stat().st_size == self.sizes[name]
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(self.repo_id, name, revision=self.commit, repo_type=self.repo_type)
        return isinstance(cached, str)


def cache_snapshot_folder(repo_id: str, repo_type: str, commit: str) -> Path:
    """Where huggingface_hub puts a commit's files in the HF_HOME cache."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE) / f"{repo_type}s--{repo_id.replace('/', '--')}" / "snapshots" / commit


def mark_incomplete(folder: Path, rerun: str) -> None:
    """Say, before the first file is fetched, that `folder` is being downloaded, with the command that finishes it:
    the trainer and --verify-only refuse it until mark_complete (a weight file cut short by a kill looked like a
    folder without weights, which trained from random weights; a dataset's missing shards went unnoticed)."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"{INCOMPLETE_DOWNLOAD}.tmp"
    tmp.write_text(json.dumps({"command": rerun}) + "\n")
    tmp.replace(folder / INCOMPLETE_DOWNLOAD)


def mark_complete(folder: Path) -> None:
    (folder / INCOMPLETE_DOWNLOAD).unlink(missing_ok=True)


def refuse_unfinished(folder: Path) -> None:
    """--verify-only: a folder whose download was interrupted is not checked as if whole (a mix of two commits' files
    passed, and its new record made it look finished)."""
    if rerun := unfinished_download(folder):
        raise ToolError(f"the download into {folder} did not finish ({INCOMPLETE_DOWNLOAD}); finish it with: {rerun}")


def listed_checksums(siblings: list[Any]) -> dict[str, str]:
    """The hub's checksum of each listed file: an LFS file's SHA-256, else the git blob id of a small file."""
    checksums = {}
    for sibling in siblings:
        lfs = getattr(sibling, "lfs", None)
        checksum = getattr(lfs, "sha256", None) if lfs is not None else getattr(sibling, "blob_id", None)
        if isinstance(checksum, str):
            checksums[sibling.rfilename] = checksum
    return checksums


def check_fetched(snapshot: HubSnapshot, folder: Path) -> None:
    """The files this run downloaded against the hub's checksums: huggingface_hub checks sizes only, so bytes damaged
    on the way (a proxy, a bad disk) at the right size passed verification, and a rerun kept them. Damaged files are
    removed, so that the rerun the message asks for fetches them again. Files already there are not read again."""
    corrupt, unknown = [], []
    for name in snapshot.fetched:
        expected = snapshot.checksums.get(name) or hub_etag(folder, name)
        if expected is None or not HUB_CHECKSUM.fullmatch(expected):
            unknown.append(name)
        elif hub_checksum_of(folder / name, expected) != expected:
            corrupt.append(name)
    if corrupt:
        discard(folder, corrupt)
        raise ToolError(
            f"{name_sample(corrupt)} of {snapshot.repo_id} arrived with bytes that differ from the hub's checksum (a "
            "damaged transfer, a proxy or a bad disk): removed; rerun the same command to fetch them again"
        )
    if snapshot.fetched:
        unlisted = f"; no hub checksum for {name_sample(unknown)}" if unknown else ""
        log(f"checksums: {len(snapshot.fetched) - len(unknown)} fetched file(s) match the hub's{unlisted}")


def download_model(
    repo_id: str, revision: str, local_dir: Path | None, token: str | None, force: bool, rerun: str
) -> tuple[Path, HubSnapshot]:
    """Fetch config, tokenizer and weights; return the folder holding them (cache snapshot or local_dir) and the
    snapshot (its commit, what it fetched). A folder this run fetches into, or one never verified, is marked
    incomplete (mark_incomplete, with `rerun`) until the caller has verified it.

    Files already complete are skipped, so rerunning after an interruption fetches only what is missing;
    a connection dropped mid-file is resumed with an HTTP Range request by huggingface_hub.
    """
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE:
        raise ToolError(offline_mode_message(repo_id))
    bound_hub_requests()
    info = HfApi(token=token).model_info(repo_id, revision=revision, files_metadata=True)
    sizes = {sibling.rfilename: sibling.size or 0 for sibling in info.siblings or []}
    checksums = listed_checksums(info.siblings or [])
    snapshot = HubSnapshot(repo_id, revision, local_dir, token, force, info.sha or revision, sizes, checksums=checksums)
    try:
        plan = plan_download(sizes)
    except ToolError as exc:
        raise ToolError(f"--model-name {repo_id} @ {revision}: {exc}") from exc
    # Before the index is read, every weight file of the chosen format bounds what the shards need.
    weight_bound = plan.weight_files or [name for name in sizes if is_weight_file(name, plan.weight_format)]
    needed = sum(sizes[name] for name in plan.metadata_files + weight_bound if force or not snapshot.is_present(name))
    target = local_dir or Path(constants.HF_HUB_CACHE)
    check_free_space(needed, free_disk_bytes(target), target)
    wanted = plan.metadata_files + weight_bound
    if local_dir is not None and (cut := [name for name in wanted if _cut_short(local_dir, name, sizes[name])]):
        # damage, not an edit: huggingface_hub's note says the file is complete, so it was skipped, and every rerun
        # said the hub had stopped answering (or that the user had changed it)
        discard(local_dir, cut)
        log(f"{name_sample(cut)}: shorter than the hub's copy (cut short); fetched again")
    if local_dir is not None and not force and (edited := edited_since_download(local_dir, wanted)):
        raise ToolError(
            f"--local-dir {local_dir}: {name_sample(edited)} changed since downloaded (their bytes differ from the "
            "hub's): a rerun would replace them with the hub's copies. Keep your version elsewhere first, or check "
            f"the folder as it is with --verify-only --local-dir {local_dir}; --force-download replaces them"
        )

    if local_dir is not None:
        write_download_source(local_dir, {"model_name": repo_id, "revision": revision, "commit": snapshot.commit})
    hashed = re.fullmatch(r"[0-9a-f]{40}", snapshot.commit)
    expected = local_dir or (cache_snapshot_folder(repo_id, "model", snapshot.commit) if hashed else None)
    # a rerun of a finished, verified download fetches nothing: interrupted, it must not leave the folder refused
    incomplete = bool(snapshot.to_fetch(wanted)) or expected is None or read_verification_record(expected) is None
    if incomplete and expected is not None:
        mark_incomplete(expected, rerun)
    log(f"{repo_id} @ {revision} (commit {info.sha}): fetching {len(plan.metadata_files)} config/tokenizer files")
    folder = snapshot.fetch(plan.metadata_files)
    if incomplete:  # (again: the listing named no commit, or the cache put it elsewhere)
        mark_incomplete(folder, rerun)
    remove_verification_record(folder)  # from here until verification passes, the folder is not complete
    weights = plan.weight_files
    if plan.index_file:
        try:
            weights = shards_from_index(json.loads((folder / plan.index_file).read_text()), plan.index_file)
        except ValueError as exc:  # json's decode error is a ValueError too
            raise ToolError(f"{plan.index_file} of {repo_id} is not a valid index ({exc})") from exc
        absent = [name for name in weights if name not in sizes]
        if absent:
            raise ToolError(f"{plan.index_file} of {repo_id} lists shards the repository lacks: {name_sample(absent)}")
    weight_bytes = format_bytes(sum(sizes[name] for name in weights))
    log(f"fetching {len(weights)} weight file(s), {weight_bytes} ({plan.weight_format})")
    if snapshot.fetch(weights) != folder:
        raise ToolError(f"{repo_id} @ {revision} moved to a new commit during the download; rerun")
    note_partial_files(folder)
    return folder, snapshot


def _cut_short(local_dir: Path, name: str, size: int) -> bool:
    """A file shorter than the hub's copy that nobody changed since its download (a weight file is never edited;
    another file only if modified after huggingface_hub's note of it): an interrupted copy, not the user's edit."""
    try:
        if (local_dir / name).stat().st_size >= size:
            return False
    except OSError:
        return False
    since = _since_download(local_dir, name)
    return name.endswith((".safetensors", ".bin")) or (since is not None and not since[1])


def _since_download(local_dir: Path, name: str) -> tuple[str, bool] | None:
    """(the checksum huggingface_hub noted for local_dir/name, whether the file was modified after that note), or
    None without the file or a note with a time; huggingface_hub's own 1 s tolerance for imprecise mtimes."""
    note = download_note(local_dir, name)
    try:
        modified_at = (local_dir / name).stat().st_mtime
    except OSError:
        return None
    if note is None or note[1] is None:
        return None
    etag, downloaded_at = note
    return etag, modified_at - 1 > downloaded_at


def edited_since_download(local_dir: Path, names: list[str]) -> list[str]:
    """The files of an earlier download into local_dir that changed since, which a rerun would fetch again over
    them: modified after huggingface_hub noted their download (checksums.download_note) and with bytes that differ
    from the hub's checksum it noted (a copied folder has new times and the same bytes)."""
    edited = []
    for name in names:
        since = _since_download(local_dir, name)
        if since is not None and since[1] and hub_checksum_of(local_dir / name, since[0]) != since[0]:
            edited.append(name)
    return edited


def note_partial_files(folder: Path) -> None:
    """huggingface_hub 2.x names partial files uniquely per attempt: one a killed run left is never reused."""
    in_cache = folder.parent.name == "snapshots"
    where = folder.parent.parent / "blobs" if in_cache else folder / ".cache" / "huggingface"
    stale = [path for path in where.rglob("*.incomplete") if path.is_file()] if where.is_dir() else []
    if stale:
        total = format_bytes(sum(path.stat().st_size for path in stale))
        log(f"note: {len(stale)} partial file(s), {total}, left by interrupted runs in {where}")
        log("      safe to delete when no other download is running")


def cached_model_folder(model_name: str, revision: str) -> Path:
    """The cache snapshot of a model downloaded before, found as the trainer finds it (offline.cached_snapshot);
    never touches the network."""
    from huggingface_hub import constants

    try:
        return cached_snapshot(model_name, revision=revision, needs="config.json")
    except Exception as exc:  # noqa: BLE001 - LocalEntryNotFoundError and friends
        raise ToolError(
            f"{model_name} @ {revision} is not in the cache {constants.HF_HUB_CACHE}: run"
            f" `python model_download.py --model-name {model_name}` where there is internet; {OFFLINE_HINT}"
        ) from exc


def refuse_inside_another_tools_folder(local_dir: Path) -> None:
    """A model folder (download or --init) may not live inside a folder another tool owns whole."""
    if inside := enclosing_folder(local_dir, WHOLE_FOLDER_KINDS):
        raise ToolError(
            f"--local-dir {local_dir} is {inside}, whose tool would delete or misread a model "
            "in it; give the model a folder of its own, e.g. models/NAME"
        )


def check_download_target(local_dir: Path, repo_id: str) -> None:
    """--local-dir must be new, empty, or an earlier download of this same model: a download writes model files into
    it, which would corrupt another tool's folder or mix two models' files."""
    if blocker := file_above(local_dir):
        raise ToolError(f"--local-dir {local_dir} is under {blocker}, which is a file; choose a folder path")
    refuse_inside_another_tools_folder(local_dir)
    if not local_dir.exists():
        return
    if not local_dir.is_dir():
        raise ToolError(f"--local-dir {local_dir} is a file; choose a folder path for --local-dir")
    if all(entry.name == ".cache" for entry in local_dir.iterdir()):  # empty, or a first download that fetched nothing
        return
    kind = folder_kind(local_dir)
    if kind is not None and kind.kind != "model":
        raise ToolError(f"--local-dir {kind.describe(local_dir)}; a download writes into it: choose a new --local-dir")
    earlier = folder_source(local_dir)
    if earlier and earlier.get("model_name") != repo_id:
        what = earlier.get("model_name") or f"a model made with --init {earlier.get('init')}"
        said = VERIFICATION_RECORD if (local_dir / VERIFICATION_RECORD).is_file() else DOWNLOAD_SOURCE
        raise ToolError(
            f"--local-dir {local_dir} holds {what} ({said}); downloading {repo_id} into it would mix"
            " two models' files: choose a new --local-dir"
        )
    if not earlier and not (local_dir / ".cache" / "huggingface").is_dir():
        raise ToolError(
            f"--local-dir {local_dir} is not empty and holds no earlier download by model_download.py (no"
            " .cache/huggingface); choose a new or empty --local-dir"
        )
