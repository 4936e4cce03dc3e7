"""What a streamed run's downloads need besides the stream's own bookkeeping
(kconvert.io.stream): the files the Hub lists for a commit with the hashes their content must
have (`remote_files`), and a handle on one download worker process (kconvert.io.download_worker)
that takes this process's huggingface_hub settings (`DownloadWorker`)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from kconvert.errors import KconvertError

WORKER = str(Path(__file__).with_name("download_worker.py"))


@dataclass(frozen=True)
class RemoteFile:
    """A file as the Hub lists it: size and the hashes its content must have."""

    size: int
    sha256: str | None  # the LFS oid (every shard on the Hub is an LFS file)
    blob_id: str  # git's sha1 of the blob


def remote_files(repo: str, commit: str, token: str | None) -> dict[str, RemoteFile]:
    """Every file of `repo` at `commit`, from the Hub's tree listing."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    try:
        tree = HfApi(token=token).list_repo_tree(repo, recursive=True, revision=commit)
        return {f.path: RemoteFile(f.size, f.lfs.sha256 if f.lfs else None, f.blob_id)
                for f in tree if isinstance(f, RepoFile)}
    except Exception as exc:  # network, auth: the user's to fix
        raise KconvertError(f"could not list the files of {repo}@{commit}: {exc}") from exc


def hub_settings() -> dict:
    """huggingface_hub's settings as this process has them (endpoint, timeouts, chunk size,
    offline mode: from the environment or set in code), for a worker process to take."""
    from huggingface_hub import constants

    return {k: v for k, v in vars(constants).items()
            if k.isupper() and (v is None or isinstance(v, str | int | float))}


class DownloadWorker:
    """A kconvert.io.download_worker process, started on first use: one download at a time."""

    def __init__(self, settings: dict):
        self.settings = settings
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self.closed = False

    def start(self) -> None:
        """Start the process (again, if it ended), unless the worker was closed."""
        with self.lock:
            if self.closed:
                raise OSError("the downloads were stopped")
            if self.proc is None or self.proc.poll() is not None:
                # -P: the worker's folder (kconvert/io) is not put on its import path.
                self.proc = subprocess.Popen([sys.executable, "-P", WORKER],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                             text=True)
                self._send(self.settings)

    def run(self, job: dict) -> dict:
        """The worker's answer to `job` (a dict with `error` if it failed or died)."""
        try:
            self.start()
            self._send(job)
            line = self.proc.stdout.readline()
        except OSError as exc:  # a pipe to a worker that ended
            return {"error": f"the download process failed: {exc}"}
        if not line:
            return {"error": f"the download process ended (exit status {self.proc.wait()})"}
        return json.loads(line)

    def _send(self, message: dict) -> None:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        """End the process now, mid-download or not (what it downloads is not wanted)."""
        with self.lock:
            self.closed = True
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
