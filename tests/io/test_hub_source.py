"""A Hub repo id as a conversion's source, with no network: huggingface_hub's download
functions stand in for the Hub over a local "remote" directory (selecting files with
huggingface_hub's own pattern filter), or the real ones read huggingface_hub's cache layout
offline. A conversion fetches the index's shards and every non-weight file (what a local run
carries over) and no other weight file; a dry run fetches config, index and shard headers."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.errors import EntryNotFoundError
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import SafetensorsFileMetadata, TensorInfo, filter_repo_objects

import kconvert
from helpers import COMMIT, INDEX, MANIFEST, cli_subprocess, hub_cache, snapshot, st_header
from kconvert.errors import KconvertError

CARRIED = {"tokenizer_config.json": "{}", "chat_template.jinja": "{{ messages }}",
           "modeling_kimi.py": "# code\n", "notes/howto.txt": "notes\n"}
OTHER_WEIGHTS = {"original/model.pth": "pth", "stray.safetensors": "not in the index"}


@pytest.fixture(scope="module")
def remote(fixture_dir, tmp_path_factory) -> Path:
    """The repo's files: a fixture, non-weight files, and weights the index does not name."""
    root = tmp_path_factory.mktemp("remote") / "kimi-tiny"
    shutil.copytree(fixture_dir("k2-int4-kimi"), root)
    for name, text in {**CARRIED, **OTHER_WEIGHTS}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def files_of(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


class FakeHub:
    """huggingface_hub's download functions over `remote`, recording what is fetched."""

    def __init__(self, remote: Path, monkeypatch):
        self.remote, self.fetched, self.headers, self.tokens = remote, [], [], []
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", self.snapshot_download)
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", self.hf_hub_download)
        monkeypatch.setattr(huggingface_hub.HfApi, "parse_safetensors_file_metadata",
                            lambda api, repo, name, **kw: self.header(name))
        monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_tree",
                            lambda api, repo, **kw: self.tree())

    def cache(self, cache_dir: str | None, names: list[str]) -> Path:
        assert cache_dir is not None, "the --cache-dir given must reach huggingface_hub"
        self.fetched += names
        hub_cache(Path(cache_dir), self.remote, names)
        return Path(cache_dir) / "models--kimi--tiny" / "snapshots" / COMMIT

    def snapshot_download(self, repo_id, *, revision=None, token=None, cache_dir=None,
                          allow_patterns=None, ignore_patterns=None, **_):
        self.tokens.append(token)
        names = list(filter_repo_objects(files_of(self.remote), allow_patterns=allow_patterns,
                                         ignore_patterns=ignore_patterns))
        return str(self.cache(cache_dir, names))

    def hf_hub_download(self, repo_id, filename, *, revision=None, token=None, cache_dir=None,
                        **_):
        if not (self.remote / filename).is_file():
            raise EntryNotFoundError(filename)
        return str(self.cache(cache_dir, [filename]) / filename)

    def tree(self) -> list[RepoFile]:
        return [RepoFile(path=n, size=(self.remote / n).stat().st_size, oid="0" * 40)
                for n in files_of(self.remote)]

    def header(self, name: str) -> SafetensorsFileMetadata:
        self.headers.append(name)
        header = st_header(self.remote / name)[0]
        metadata = header.pop("__metadata__", {})
        return SafetensorsFileMetadata(metadata, {
            n: TensorInfo(t["dtype"], t["shape"], tuple(t["data_offsets"]))
            for n, t in header.items()})


def test_conversion_fetches_the_shards_and_what_it_carries_over(remote, tmp_path, monkeypatch):
    hub = FakeHub(remote, monkeypatch)
    cache = tmp_path / "cache"
    messages = []
    kconvert.dequant("kimi/tiny", str(tmp_path / "hub-out"), device="cpu", token="hf_secret",
                     cache_dir=str(cache), echo=messages.append)
    assert sorted(hub.fetched) == sorted(set(files_of(remote)) - set(OTHER_WEIGHTS))
    assert hub.tokens and set(hub.tokens) == {"hf_secret"}
    where = cache / "models--kimi--tiny" / "snapshots" / COMMIT
    assert f"kimi/tiny@main: files in {where}" in messages

    local_src = tmp_path / "local-src"
    shutil.copytree(remote, local_src, ignore=shutil.ignore_patterns(*OTHER_WEIGHTS, "original"))
    kconvert.dequant(str(local_src), str(tmp_path / "local-out"), device="cpu")
    hub_out, local_out = snapshot(tmp_path / "hub-out"), snapshot(tmp_path / "local-out")
    for name in CARRIED:
        assert hub_out[name] == local_out[name]
    # Same files, same shard bytes; the manifest names its source, so it differs.
    assert set(hub_out) == set(local_out)
    assert {k: v for k, v in hub_out.items() if k != MANIFEST} == \
        {k: v for k, v in local_out.items() if k != MANIFEST}
    assert json.loads((tmp_path / "hub-out" / MANIFEST).read_text())["source"]["commit"] == COMMIT


def test_dry_run_fetches_config_index_and_headers_only(remote, tmp_path, monkeypatch):
    hub = FakeHub(remote, monkeypatch)
    shards = sorted(set(json.loads((remote / INDEX).read_text())["weight_map"].values()))
    remote_lines, local_lines = [], []
    kconvert.int4_to_nvfp4("kimi/tiny", str(tmp_path / "out"), dry_run=True, device="cpu",
                           cache_dir=str(tmp_path / "cache"), echo=remote_lines.append)
    assert sorted(hub.fetched) == ["config.json", INDEX]
    assert hub.headers == shards
    kconvert.int4_to_nvfp4(str(remote), str(tmp_path / "out"), dry_run=True, device="cpu",
                           echo=local_lines.append)
    assert remote_lines[0].startswith("kimi/tiny@main: files in ")
    # A repo id's dry run also says the disk of a streamed and of a cached run.
    assert remote_lines[1:-2] == local_lines
    assert remote_lines[-2].startswith("disk, streamed")
    assert remote_lines[-1].startswith("disk, cached")
    assert not (tmp_path / "out").exists()


def test_conversion_from_the_cache_offline(remote, tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    names = [n for n in files_of(remote) if n not in OTHER_WEIGHTS]
    cache = hub_cache(tmp_path / "cache", remote, names)
    result = kconvert.dequant("kimi/tiny", str(tmp_path / "out"), device="cpu", cache_dir=cache)
    assert result.manifest is not None
    assert (tmp_path / "out" / "chat_template.jinja").read_text() == CARRIED["chat_template.jinja"]


def test_missing_source_says_what_was_tried(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(KconvertError, match="source directory does not exist: 'kimi/none' is "
                       "no local directory, and as a Hub repo id the snapshot of kimi/none@main "
                       "is not in the Hugging Face cache while HF_HUB_OFFLINE is set"):
        kconvert.dequant("kimi/none", str(tmp_path / "out"), cache_dir=str(tmp_path))
    for path in ("no/such/dir", "./nodir", str(tmp_path / "nodir")):
        with pytest.raises(KconvertError, match=r"^source directory does not exist \(file "):
            kconvert.dequant(path, str(tmp_path / "out"))


def test_cli_takes_token_and_cache_dir(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_TOKEN": "hf_env"}
    done = cli_subprocess("dequant", "kimi/none", tmp_path / "out", "--cache-dir", tmp_path,
                          env=env, timeout=120)
    assert done.returncode != 0
    assert "source directory does not exist: 'kimi/none' is no local directory" in done.stderr
    assert "Traceback" not in done.stderr
