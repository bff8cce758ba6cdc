"""A fake Hugging Face Hub on 127.0.0.1 for the download tests: the endpoints huggingface_hub calls, no more.

Read from huggingface_hub 2.4 (hf_api.model_info, list_repo_tree, file_download.get_hf_file_metadata, http_get);
0.3x calls the same routes minus the tree listing.

    GET  /api/models/{repo}[/revision/{rev}]      model info: commit sha and siblings with sizes
    GET  /api/models/{repo}/tree/{rev}            recursive file listing (snapshot_download)
    HEAD /{repo}/resolve/{rev}/{file}             X-Repo-Commit, ETag, Content-Length: the file metadata
    GET  /{repo}/resolve/{rev}/{file}             the bytes; "Range: bytes=N-" answers 206 (resume)

Dataset repositories (`add_dataset`) answer the same routes under /api/datasets/{repo} and /datasets/{repo}.

Errors carry the X-Error-Code header huggingface_hub maps to its exception classes (RepoNotFound,
RevisionNotFound, EntryNotFound, GatedRepo). Faults for resume tests: `drop_after[file] = n` sends n bytes of the
next GET of that file and closes the connection; `hang_after[file] = n` sends n bytes and then stalls until
`release` is set, so a test can kill the downloading process mid-file.
"""

from __future__ import annotations

import hashlib
import json
import socket
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    gated_token: str | None = None
    """When set, every request needs 'Authorization: Bearer <gated_token>' (a gated repo before access)."""

    @property
    def commit(self) -> str:
        digest = hashlib.sha1()
        for name in sorted(self.files):
            digest.update(name.encode() + hashlib.sha256(self.files[name]).digest())
        return digest.hexdigest()


@dataclass
class RequestRecord:
    method: str
    path: str
    range: str | None
    completed: bool = False
    """For GETs of files: all the bytes were sent."""


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo] = field(default_factory=dict)
    requests: list[RequestRecord] = field(default_factory=list)
    drop_after: dict[str, int] = field(default_factory=dict)
    hang_after: dict[str, int] = field(default_factory=dict)
    damage_once: set[str] = field(default_factory=set)  # sent once with its last byte changed (size and ETag right)
    stall_api: str = ""  # an API path holding this (e.g. "/tree/") is accepted and never answered, until release
    hanging: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None

    def add_folder(
        self, repo_id: str, folder: Path, extra: dict[str, bytes] | None = None, gated_token: str | None = None
    ) -> FakeRepo:
        files = {path.relative_to(folder).as_posix(): path.read_bytes() for path in folder.rglob("*") if path.is_file()}
        self.repos[repo_id] = FakeRepo({**files, **(extra or {})}, gated_token)
        return self.repos[repo_id]

    def add_dataset(self, repo_id: str, files: dict[str, bytes]) -> FakeRepo:
        """A dataset repository: stored as datasets/ORG/NAME, as the hub's URLs name it."""
        self.repos[f"datasets/{repo_id}"] = FakeRepo(files)
        return self.repos[f"datasets/{repo_id}"]

    @property
    def url(self) -> str:
        assert self._server is not None, "start() the hub first"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeHub:
        hub = self

        class Handler(HubRequestHandler):
            pass

        Handler.hub = hub
        self._server = QuietServer(("127.0.0.1", 0), Handler)  # port 0: a free port
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.release.set()  # unblock a hanging handler so shutdown does not wait on it
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def file_gets(self, filename: str) -> list[RequestRecord]:
        with self.lock:
            return [
                r
                for r in self.requests
                if r.method == "GET" and "/resolve/" in r.path and r.path.endswith("/" + filename)
            ]


class QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        """A client the test killed mid-file resets the connection: expected, not worth a traceback."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class HubRequestHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the real hub; every response sets Content-Length
    hub: FakeHub

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's signature
        pass  # keep test output clean

    def do_HEAD(self) -> None:
        self._route(head=True)

    def do_GET(self) -> None:
        self._route(head=False)

    def _route(self, head: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        record = RequestRecord(self.command, path, self.headers.get("Range"))
        with self.hub.lock:
            self.hub.requests.append(record)
        if path.startswith("/api/models/"):
            self._api(path[len("/api/models/") :])
            return
        if path.startswith("/api/datasets/"):
            self._api(path[len("/api/datasets/") :], prefix="datasets/")
            return
        parts = path.lstrip("/").split("/")
        prefix = ""
        if parts[0] == "datasets":
            prefix, parts = "datasets/", parts[1:]
        if len(parts) >= 5 and parts[2] == "resolve":
            self._resolve(prefix + "/".join(parts[:2]), parts[3], "/".join(parts[4:]), head, record)
            return
        self._error(404, "NotFound", "no such route")

    def _repo(self, repo_id: str, revision: str) -> FakeRepo | None:
        """The repo if it exists, the revision resolves and the caller may see it; otherwise answers the error."""
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        if repo.gated_token is not None and self.headers.get("Authorization") != f"Bearer {repo.gated_token}":
            self._error(
                401,
                "GatedRepo",
                f"Access to model {repo_id} is restricted. You must have access to it and be authenticated to access it. Please log in.",
            )
            return None
        if revision not in ("main", repo.commit):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return repo

    def _api(self, rest: str, prefix: str = "") -> None:
        if self.hub.stall_api and self.hub.stall_api in rest:
            self.hub.release.wait()
            return
        if "/tree/" in rest:
            repo_id, _, revision = rest.partition("/tree/")
        elif "/revision/" in rest:
            repo_id, _, revision = rest.partition("/revision/")
        else:
            repo_id, revision = rest, "main"
        repo = self._repo(prefix + repo_id, revision.split("/")[0])
        if repo is None:
            return
        if "/tree/" in rest:
            body = [
                {"type": "file", "path": name, "size": len(data), "oid": _git_oid(data)}
                for name, data in sorted(repo.files.items())
            ]
        else:
            siblings = [  # as the hub: a weight file (LFS) has its SHA-256 and the blob id of its pointer file
                {"rfilename": name, "size": len(data), "blobId": _git_oid(data)}
                | ({"lfs": {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}}
                   if name.endswith((".safetensors", ".bin", ".pt")) else {})
                for name, data in sorted(repo.files.items())
            ]  # fmt: skip
            body = {"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": False, "siblings": siblings}
        self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})

    def _resolve(self, repo_id: str, revision: str, filename: str, head: bool, record: RequestRecord) -> None:
        repo = self._repo(repo_id, revision)
        if repo is None:
            return
        data = repo.files.get(filename)
        if data is None:
            self._error(404, "EntryNotFound", f"{filename} does not exist", {"X-Repo-Commit": repo.commit})
            return
        # as the hub: a weight file (stored with LFS) is named by its SHA-256, a small file by its git blob SHA-1
        lfs = filename.endswith((".safetensors", ".bin", ".pt"))
        headers = {
            "X-Repo-Commit": repo.commit,
            "ETag": f'"{hashlib.sha256(data).hexdigest() if lfs else _git_oid(data)}"',
            "Accept-Ranges": "bytes",
        }
        start = _range_start(self.headers.get("Range"))
        status, body = (206, data[start:]) if start else (200, data)
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        if head:
            self._send(status, b"", {**headers, "Content-Length": str(len(body))})
            return
        self._send_file(filename, status, body, headers, record)

    def _send_file(
        self, filename: str, status: int, body: bytes, headers: dict[str, str], record: RequestRecord
    ) -> None:
        with self.hub.lock:
            cut = self.hub.drop_after.pop(filename, None)
            stall = self.hub.hang_after.pop(filename, None)
            if filename in self.hub.damage_once and body:  # a proxy or a bad disk: the bytes, not the size, are wrong
                self.hub.damage_once.discard(filename)
                body = body[:-1] + bytes([body[-1] ^ 0xFF])
        if cut is None and stall is None:
            self._send(status, body, headers)
            record.completed = True
            return
        self._write_head(status, {**headers, "Content-Length": str(len(body))})
        self.wfile.write(body[: cut if cut is not None else stall])
        self.wfile.flush()
        if stall is not None:
            self.hub.hanging.set()
            self.hub.release.wait(timeout=60)
        # A FIN after a short body: the client sees a connection closed mid-file, as on a network drop.
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # the client may already be gone (killed)

    def _error(self, status: int, code: str, message: str, extra: dict[str, str] | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        self._send(
            status,
            body,
            {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json", **(extra or {})},
        )

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self._write_head(status, {"Content-Length": str(len(body)), **headers})
        if self.command != "HEAD":
            self.wfile.write(body)

    def _write_head(self, status: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()


def _range_start(header: str | None) -> int:
    if not header or not header.startswith("bytes="):
        return 0
    return int(header[len("bytes=") :].split("-")[0] or 0)


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def closed_port() -> int:
    """A port nothing listens on: bound once to get a free number, then released."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
