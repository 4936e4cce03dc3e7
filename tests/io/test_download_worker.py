"""The download worker's hash of a shard (kconvert.io.download_worker.download): the digest of
the bytes it followed as they landed is trusted only for that very file. A download that
ends with another file in place (same size, another inode: a retry that wrote a new file) is
hashed again from disk, so the digest checked against the Hub's is that of the bytes a run
will read. huggingface_hub's download is stood in for by one that writes its temporary file
as the real one does (`*.incomplete` named with the etag), then puts a file in place."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import huggingface_hub
import pytest

from kconvert.io import download_worker

ETAG = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"
SIZE = 3 * (1 << 20)


def _fake_download(replace: bool):
    """An hf_hub_download that lands SIZE bytes of one content in its temporary file, waits
    for the follower to hash them, then renames that file into place, or (`replace`) puts
    another file of the same size there (made while the first still exists: another inode)."""

    def download(repo, name, revision, token, local_dir) -> str:
        folder = Path(local_dir) / ".cache" / "huggingface" / "download"
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f"{name}.{ETAG}.incomplete"
        partial.write_bytes(b"a" * SIZE)
        time.sleep(0.3)  # the follower polls every few ms
        final = Path(local_dir) / name
        if replace:
            final.write_bytes(b"b" * SIZE)
            partial.unlink()
        else:
            partial.rename(final)
        return str(final)

    return download


@pytest.mark.parametrize("replace", [False, True])
def test_the_followed_digest_is_trusted_only_for_the_same_file(tmp_path, monkeypatch, replace):
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", _fake_download(replace))
    answer = download_worker.download(
        {"where": str(tmp_path), "repo": "kimi/tiny", "commit": "c" * 40, "token": None},
        {"name": "model.safetensors", "size": SIZE, "kind": "sha256", "etag": ETAG})
    on_disk = Path(answer["path"]).read_bytes()
    assert on_disk == (b"b" if replace else b"a") * SIZE
    assert answer["digest"] == hashlib.sha256(on_disk).hexdigest()
    # the same file as followed: its digest came from following it, no second read
    assert answer["followed"] is not replace
