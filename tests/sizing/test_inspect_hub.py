"""`kconvert inspect` on a Hub repo id, against huggingface_hub's cache layout on local files
(HF_HUB_OFFLINE: no network): cached shards are read there, missing ones fail at once, and a
mistyped local path is reported as a missing directory."""

from __future__ import annotations

import re

import pytest
from huggingface_hub import constants

import kconvert
from helpers import COMMIT, hub_cache
from kconvert.errors import KconvertError


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_repo_id_from_the_cache_offline(fixture_dir, tmp_path, offline):
    src = fixture_dir("k2-int4-kimi")
    files = ["config.json", "model.safetensors.index.json",
             *sorted(p.name for p in src.glob("*.safetensors"))]
    cache = hub_cache(tmp_path, src, files)
    remote = kconvert.inspect("kimi/tiny", as_format="nvfp4", cache_dir=cache).to_json()
    local = kconvert.inspect(str(src), as_format="nvfp4").to_json()
    assert remote["source"] == {"repo": "kimi/tiny", "revision": "main", "commit": COMMIT}
    remote.pop("source"), local.pop("source")
    # Every shard is cached: a streamed run downloads nothing, a cached run nothing more.
    disk = remote.pop("disk_from_hub")
    assert local.pop("disk_from_hub") is None
    cached = sum((src / f).stat().st_size for f in files if f.endswith(".safetensors"))
    assert disk["cached_source_bytes"] == cached and disk["remote_source_bytes"] == 0
    assert disk["streamed_peak_bytes"] == disk["cached_peak_bytes"] == \
        cached + disk["output_bytes"]
    assert remote == local


def test_offline_without_the_shards_fails_at_once(fixture_dir, tmp_path, offline):
    src = fixture_dir("k2-int4-kimi")
    cache = hub_cache(tmp_path, src, ["config.json", "model.safetensors.index.json"])
    with pytest.raises(KconvertError, match="HF_HUB_OFFLINE is set and shard model-00001"):
        kconvert.inspect("kimi/tiny", cache_dir=cache)
    with pytest.raises(KconvertError, match=re.escape(
            "config.json of kimi/other@main is not in the Hugging Face cache while "
            "HF_HUB_OFFLINE is set")):
        kconvert.inspect("kimi/other", cache_dir=cache)


def test_mistyped_local_path_is_a_missing_directory(tmp_path, offline):
    for path in (tmp_path / "no-such-dir", "./no-such-dir", "no/such/dir"):
        with pytest.raises(KconvertError, match="source directory does not exist"):
            kconvert.inspect(str(path))
    with pytest.raises(KconvertError, match="'models/kimi' is no local directory"):
        kconvert.inspect("models/kimi", cache_dir=str(tmp_path))
