"""A Hugging Face Hub endpoint on 127.0.0.1 that serves local directories as model repos.

It speaks the parts of the Hub's HTTP API that huggingface_hub's own client code uses to find
and download files (docs/hub.md), so that `hf_hub_download`, `snapshot_download`,
`list_repo_tree` and `parse_safetensors_file_metadata` run unmodified against it (point
HF_ENDPOINT, or huggingface_hub.constants.ENDPOINT and HUGGINGFACE_CO_URL_TEMPLATE, at
`LocalHub.url`):

  GET  /api/models/{repo}[/revision/{rev}]   repo info: `sha`, `siblings` (`?blobs=1`: sizes,
                                              blob ids and LFS sha256 too)
  GET  /api/models/{repo}/tree/{rev}[/{dir}]  the tree listing (`?recursive=1`)
  HEAD /{repo}/resolve/{rev}/{path}           X-Repo-Commit, ETag, and for LFS files
  GET  /{repo}/resolve/{rev}/{path}           X-Linked-Etag (sha256) and X-Linked-Size; GET
                                              honours one `Range: bytes=a-[b]` (206)

Every repo is at one commit, `COMMIT`; `main` resolves to it. `*.safetensors` files are LFS
files, as on the Hub: their ETag is the sha256 of their bytes; other files' is their git blob
id. Unknown repos, revisions and files get the Hub's 404s with its `X-Error-Code`.

Faults, for tests (`LocalHub.fault(path, ...)`): a download of the file (a GET, but not a range
read from byte 0 such as a header read) drops its connection after some bytes, serves one
byte wrong, or stalls before its first byte, each for a given number of requests. `rate`
throttles the response bodies, all of them together (one link), to that many bytes per
second: a body goes out in blocks of about 10 ms of the link, each sent when the link has
carried the blocks before it and itself, so that even a small file takes its time. Every
request is recorded (`requests`), with the byte range asked for.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

COMMIT = "c0ffee00" * 5
CHUNK = 4 << 20
LFS_PATTERNS = (".safetensors",)
RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


@dataclass
class Fault:
    """What the next `times` GETs of one file do wrong."""

    times: int = 1
    drop_after: int | None = None  # bytes of the body sent before the connection is cut
    wrong_byte: int | None = None  # file offset whose byte is served wrong
    stall: float = 0.0  # seconds before the first byte of the body


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # the file's path in its repo, or the API path
    start: int | None = None  # first byte asked for (a Range request)


@dataclass(frozen=True)
class RepoFile:
    path: str
    size: int
    blob_id: str  # git's sha1 of the blob
    sha256: str | None  # LFS files only

    def entry(self) -> dict:
        """As the tree listing gives it."""
        out = {"type": "file", "oid": self.blob_id, "size": self.size, "path": self.path}
        if self.sha256 is not None:
            out["lfs"] = {"oid": self.sha256, "size": self.size, "pointerSize": 134}
        return out

    @property
    def etag(self) -> str:
        return self.sha256 or self.blob_id


def describe_file(root: Path, rel: str) -> RepoFile:
    """Size, git blob id and (LFS files) sha256 of `root/rel`, read once. An LFS file's blob
    in git is its pointer file, so its blob id is the pointer's, as on the Hub."""
    path = root / rel
    size = path.stat().st_size
    lfs = rel.endswith(LFS_PATTERNS)
    digest = hashlib.sha256() if lfs else hashlib.sha1(b"blob %d\0" % size)
    with path.open("rb") as fh:
        while block := fh.read(CHUNK):
            digest.update(block)
    if not lfs:
        return RepoFile(rel, size, digest.hexdigest(), None)
    sha256 = digest.hexdigest()
    pointer = (f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\n"
               f"size {size}\n").encode()
    blob_id = hashlib.sha1(b"blob %d\0" % len(pointer) + pointer).hexdigest()
    return RepoFile(rel, size, blob_id, sha256)


class LocalHub:
    """The server: `with LocalHub({"kimi/tiny": path}) as hub:` ... `hub.url`."""

    def __init__(self, repos: dict[str, Path], rate: float | None = None):
        self.repos = {repo: Path(root) for repo, root in repos.items()}
        self.rate = rate
        self.files: dict[str, dict[str, RepoFile]] = {}
        for repo, root in self.repos.items():
            rels = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
            self.files[repo] = {rel: describe_file(root, rel) for rel in rels}
        self.faults: dict[str, Fault] = {}
        self.link_free = 0.0  # when the throttled link has sent everything asked of it
        self.requests: list[Request] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="local-hub",
                                       daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def fault(self, path: str, **kwargs) -> None:
        """The next GETs of file `path` (any repo) go wrong as `Fault(**kwargs)` says."""
        with self.lock:
            self.faults[path] = Fault(**kwargs)

    def gets(self, path: str) -> list[Request]:
        """The GETs of file `path` so far."""
        with self.lock:
            return [r for r in self.requests if r.method == "GET" and r.path == path]

    def take_fault(self, path: str) -> Fault | None:
        with self.lock:
            fault = self.faults.get(path)
            if fault is None:
                return None
            fault.times -= 1
            if fault.times <= 0:
                del self.faults[path]
            return fault

    def throttle(self, nbytes: int) -> None:
        """Wait until the link (all responses together, `rate` bytes/s) has carried `nbytes`
        more bytes."""
        if not self.rate:
            return
        with self.lock:
            start = max(time.perf_counter(), self.link_free)
            self.link_free = start + nbytes / self.rate
            until = self.link_free
        time.sleep(max(0.0, until - time.perf_counter()))

    def record(self, request: Request) -> None:
        with self.lock:
            self.requests.append(request)

    def __enter__(self) -> LocalHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _handler(hub: LocalHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_args) -> None:
            """Quiet: tests read `hub.requests` instead."""

        def do_HEAD(self) -> None:
            self.respond(head=True)

        def do_GET(self) -> None:
            self.respond(head=False)

        def respond(self, head: bool) -> None:
            url = urlsplit(self.path)
            path, query = unquote(url.path), parse_qs(url.query)
            if path.startswith("/api/models/"):
                hub.record(Request(self.command, path))
                self.api(path.removeprefix("/api/models/"), query)
                return
            match = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if match is None:
                self.error(404, "RepoNotFound")
                return
            repo, rev, rel = match.groups()
            self.resolve(repo, rev, rel, head)

        # ------------------------------------------------------------------ API
        def api(self, rest: str, query: dict) -> None:
            match = re.fullmatch(r"([^/]+/[^/]+)(?:/(revision|tree)/([^/]+)(?:/(.*))?)?", rest)
            if match is None or match.group(1) not in hub.repos:
                self.error(404, "RepoNotFound")
                return
            repo, what, rev, sub = match.groups()
            what, rev = what or "revision", rev or "main"
            if rev not in ("main", COMMIT):
                self.error(404, "RevisionNotFound")
                return
            files = hub.files[repo].values()
            if what == "revision":
                blobs = query.get("blobs", ["false"])[0].lower() in ("1", "true")
                siblings = []
                for f in files:
                    sib: dict = {"rfilename": f.path}
                    if blobs:
                        sib.update(size=f.size, blobId=f.blob_id)
                        if f.sha256 is not None:
                            sib["lfs"] = {"sha256": f.sha256, "size": f.size,
                                          "pointerSize": 134}
                    siblings.append(sib)
                body = {"_id": repo, "id": repo, "modelId": repo, "sha": COMMIT,
                        "private": False, "disabled": False, "gated": False, "tags": [],
                        "siblings": siblings}
            else:
                prefix = f"{sub.rstrip('/')}/" if sub else ""
                recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
                body, dirs = [], set()
                for f in files:
                    if not f.path.startswith(prefix):
                        continue
                    tail = f.path[len(prefix):]
                    if "/" in tail and not recursive:
                        dirs.add(prefix + tail.split("/")[0])
                        continue
                    if recursive:
                        parts = f.path.split("/")[:-1]
                        dirs.update("/".join(parts[:i + 1]) for i in range(len(parts))
                                    if "/".join(parts[:i + 1]).startswith(prefix))
                    body.append(f.entry())
                body += [{"type": "directory", "oid": "0" * 40, "size": 0, "path": d}
                         for d in sorted(dirs)]
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        # ------------------------------------------------------------------ files
        def resolve(self, repo: str, rev: str, rel: str, head: bool) -> None:
            if repo not in hub.repos:
                self.error(404, "RepoNotFound")
                return
            if rev not in ("main", COMMIT):
                self.error(404, "RevisionNotFound")
                return
            info = hub.files[repo].get(rel)
            if info is None:
                self.error(404, "EntryNotFound", commit=True)
                return
            start, end = 0, info.size
            asked = self.headers.get("Range")
            if asked is not None:
                got = RANGE.fullmatch(asked.strip())
                if got is None or int(got.group(1)) > max(info.size - 1, 0):
                    self.error(416, "RangeNotSatisfiable", commit=True)
                    return
                start = int(got.group(1))
                end = min(int(got.group(2)) + 1, info.size) if got.group(2) else info.size
            hub.record(Request(self.command, rel, start if asked is not None else None))
            self.send_response(206 if asked is not None else 200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{info.etag}"')
            if info.sha256 is not None:
                self.send_header("X-Linked-Etag", f'"{info.sha256}"')
                self.send_header("X-Linked-Size", str(info.size))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(end - start))
            if asked is not None:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{info.size}")
            self.end_headers()
            if head:
                return
            # Faults hit downloads, not the range reads of a safetensors header from byte 0.
            download = asked is None or start > 0
            self.body(hub.repos[repo] / rel, start, end,
                      hub.take_fault(rel) if download else None)

        def body(self, path: Path, start: int, end: int, fault: Fault | None) -> None:
            sent = 0
            if fault is not None and fault.stall:
                time.sleep(fault.stall)
            limit = end - start
            if fault is not None and fault.drop_after is not None:
                limit = min(limit, fault.drop_after)
            step = CHUNK if not hub.rate else int(min(CHUNK, max(64 << 10, hub.rate / 100)))
            buf = bytearray(step)
            with path.open("rb") as fh:
                fh.seek(start)
                while sent < limit:
                    n = fh.readinto(memoryview(buf)[:min(step, limit - sent)])
                    if not n:
                        break
                    block = memoryview(buf)[:n]
                    if fault is not None and fault.wrong_byte is not None and \
                            start + sent <= fault.wrong_byte < start + sent + n:
                        block = bytearray(block)
                        block[fault.wrong_byte - start - sent] ^= 0xFF
                    hub.throttle(n)
                    try:
                        self.wfile.write(block)
                    except OSError:  # the client went away
                        self.close_connection = True
                        return
                    sent += n
            if sent < end - start:  # a dropped connection: cut it, the body incomplete
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True

        def error(self, status: int, code: str, commit: bool = False) -> None:
            data = json.dumps({"error": code}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", code)
            if commit:
                self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

    return Handler
