"""The early read (io.early_read): a conversion of a local SRC hands the kernel the first bytes
of its shards, in the order the run reads them, before torch is imported; never more than it
was asked for or than a quarter of the available memory; nothing for a Hub id, a dry run, a
stream or a torchrun rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from conftest import BUNDLED
from kconvert.io import early_read


def shards(root, sizes: dict[str, int], index: bool = True):
    """`root` made, with files of `sizes` and, with `index`, an index naming them."""
    root.mkdir(parents=True, exist_ok=True)
    for name, size in sizes.items():
        (root / name).write_bytes(b"\0" * size)
    if index:
        weight_map = {f"t{i}": name for i, name in enumerate(reversed(list(sizes)))}
        (root / early_read.INDEX).write_text(json.dumps({"weight_map": weight_map}))
    return root


def test_shard_files_are_the_index_names_sorted_else_the_single_file(tmp_path):
    assert early_read.shard_files(shards(tmp_path / "a", {}, index=False)) == []
    root = shards(tmp_path / "b", {"m-2.safetensors": 3, "m-1.safetensors": 5})
    assert early_read.shard_files(root) == [root / "m-1.safetensors", root / "m-2.safetensors"]
    (root / early_read.INDEX).write_text("{not json")
    assert early_read.shard_files(root) == []
    root = shards(tmp_path / "c", {early_read.SINGLE: 4}, index=False)
    assert early_read.shard_files(root) == [root / early_read.SINGLE]


def test_early_ranges_take_the_first_bytes_in_order(tmp_path):
    root = shards(tmp_path, {"a": 10, "b": 20, "c": 30})
    files = early_read.shard_files(root)
    assert early_read.early_ranges(files, 25) == [(root / "a", 10), (root / "b", 15)]
    assert early_read.early_ranges(files, 10) == [(root / "a", 10)]
    assert early_read.early_ranges(files, 100) == [(root / "a", 10), (root / "b", 20),
                                                  (root / "c", 30)]


@pytest.fixture
def hinted(monkeypatch):
    got, lock = [], threading.Lock()

    def fadvise(fd, offset, length, advice):
        with lock:
            got.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), offset, length,
                        advice))

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return got


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/fd is Linux's")
def test_the_thread_hints_those_ranges_within_a_quarter_of_the_memory(tmp_path, hinted,
                                                                     monkeypatch):
    root = shards(tmp_path, {"a": 10, "b": 20, "c": 30})
    early_read.start_early_read(str(root), 25).join()
    will = os.POSIX_FADV_WILLNEED
    assert hinted == [("a", 0, 10, will), ("b", 0, 15, will)]
    hinted.clear()
    monkeypatch.setattr(early_read, "available_bytes", lambda: 48)
    early_read.start_early_read(str(root), 1000).join()
    assert hinted == [("a", 0, 10, will), ("b", 0, 2, will)]


def test_nothing_is_hinted_for_what_is_not_a_local_checkpoint(tmp_path, hinted, monkeypatch):
    assert early_read.start_early_read("moonshotai/Kimi-K2-Thinking") is None
    assert early_read.start_early_read(str(tmp_path)) is None  # no shards
    root = shards(tmp_path / "x", {"a": 10})
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert early_read.start_early_read(str(root)) is None
    assert hinted == []


# Records, in the conversion's process, whether torch's import had finished when each shard
# was first hinted (a module being imported is in sys.modules with its spec marked
# `_initializing`), then runs the command.
PROGRAM = """
import json, os, sys
first = {}
real = os.posix_fadvise
def torch_imported():
    torch = sys.modules.get("torch")
    return torch is not None and not getattr(torch.__spec__, "_initializing", False)
def fadvise(fd, offset, length, advice):
    name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
    if name.endswith(".safetensors") and advice == os.POSIX_FADV_WILLNEED:
        first.setdefault(name, torch_imported())
    return real(fd, offset, length, advice)
os.posix_fadvise = fadvise
import atexit
atexit.register(lambda: print("HINTED " + json.dumps(first)))
from kconvert.cli import run
sys.argv = ["kconvert", *sys.argv[1:]]
run()
"""


def hinted_before_torch(*args: str) -> dict[str, bool]:
    res = subprocess.run([sys.executable, "-c", PROGRAM, *args], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("HINTED "))
    return {k: not v for k, v in json.loads(line[len("HINTED "):]).items()}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/fd is Linux's")
def test_a_conversion_hints_its_shards_before_it_imports_torch(tmp_path):
    got = hinted_before_torch("int4-to-nvfp4", str(BUNDLED), str(tmp_path / "out"),
                              "--device", "cpu", "--quiet")
    names = sorted(p.name for p in BUNDLED.glob("*.safetensors"))
    assert sorted(got) == names
    assert all(got.values()), got  # each shard's first hint came before torch was imported
    dry = hinted_before_torch("int4-to-nvfp4", str(BUNDLED), str(tmp_path / "dry"),
                              "--device", "cpu", "--dry-run")
    assert dry == {}
