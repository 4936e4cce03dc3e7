"""What a run does to DST: a DST that overlaps the source, is not empty, or was started with other
options is refused untouched. SIGKILL mid-run, then --resume: byte-identical to a clean run; no
partial shard ever under its final name; --overwrite replaces; --resume of a finished output
refuses. --dry-run writes nothing and prints the per-role table.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from robustness_support import assert_no_result
from safetensors import safe_open

from helpers import (
    CLI,
    INDEX,
    S2,
    S4,
    cli_subprocess,
    data_bytes,
    edit_tensor,
    file_tensors,
    run_inproc,
    set_at,
    snapshot,
    source_copy,
)
from kconvert.errors import KconvertError
from kconvert.testing.fixture_weights import FixtureDims
from kconvert.testing.fixtures import make_fixture

# ----------------------------------------------------------------- a DST refused untouched


def _src_copy(tmp_path: Path) -> tuple[Path, dict]:
    src = source_copy(tmp_path)
    return src, snapshot(src)


@pytest.mark.parametrize("where", ["same", "same-via-dotdot", "inside-src", "contains-src",
                                   "symlink-to-src"])
def test_dst_overlapping_src_refused(where, tmp_path):
    src, before = _src_copy(tmp_path)
    if where == "same":
        dst = src
    elif where == "same-via-dotdot":
        dst = src / ".." / "src"
    elif where == "inside-src":
        dst = src / "out"
    elif where == "contains-src":
        dst = tmp_path  # --overwrite here would delete the source
    else:
        dst = tmp_path / "link"
        dst.symlink_to(src, target_is_directory=True)
    whole = snapshot(tmp_path)
    with pytest.raises(KconvertError, match=r"DST") as err:
        run_inproc("int4-to-nvfp4", src, dst, overwrite=True)
    assert str(dst) in str(err.value)
    assert snapshot(src) == before
    assert snapshot(tmp_path) == whole, "something was written"


def test_non_empty_dst_refused_without_resume_or_overwrite(tmp_path):
    src, before = _src_copy(tmp_path)
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    with pytest.raises(KconvertError, match=r"not empty.*--resume.*--overwrite") as err:
        run_inproc("int4-to-nvfp4", src, dst)
    assert str(dst) in str(err.value)
    assert snapshot(dst) == {"notes.txt": hashlib.sha256(b"mine").hexdigest()}
    assert snapshot(src) == before


def test_resume_refuses_a_dst_started_with_other_options(tmp_path):
    """An interrupted --block-scale amax run, resumed with mse: refused, DST untouched. The
    same options resume it, and the result equals a clean amax run."""
    src, _ = _src_copy(tmp_path)
    norm = "model.norm.weight"
    good = file_tensors(src / S4)[norm]
    edit_tensor(src / S4, norm, set_at((0,), math.nan))  # fails on the last shard
    dst = tmp_path / "out"
    with pytest.raises(KconvertError, match="NaN"):
        run_inproc("int4-to-nvfp4", src, dst, block_scale="amax")
    assert (dst / ".kconvert" / "run.json").is_file()
    assert (dst / ".kconvert" / "done" / f"{S2}.json").is_file()
    assert_no_result(dst)
    state = snapshot(dst)
    before = snapshot(src)

    proc = cli_subprocess("int4-to-nvfp4", src, dst, "--quiet", "--resume", "--block-scale", "mse")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert re.search(r"different (command|option)", proc.stderr), proc.stderr
    assert str(dst) in proc.stderr
    assert snapshot(dst) == state, "a refused --resume modified DST"
    assert snapshot(src) == before
    with pytest.raises(KconvertError, match="different"):
        run_inproc("dequant", src, dst, resume=True)
    assert snapshot(dst) == state

    edit_tensor(src / S4, norm, lambda t: good)
    run_inproc("int4-to-nvfp4", src, dst, block_scale="amax", resume=True)
    clean = tmp_path / "clean"
    run_inproc("int4-to-nvfp4", src, clean, block_scale="amax")
    assert snapshot(dst) == snapshot(clean)


# --------------------------------------------------------------- SIGKILL, resume, overwrite

# ~1.6M INT4 elements per MoE shard: a few tenths of a second each to convert, so the kill
# reliably lands after the 2nd of 8 shards and long before the last.
KILL_DIMS = {"hidden": 256, "moe_intermediate": 128, "experts": 16, "moe_layers": 6}


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
    """(source with 6 MoE shards, its clean `int4-to-nvfp4 --block-scale amax` output)."""
    root = tmp_path_factory.mktemp("multi")
    src = make_fixture(root / "src", "k2-int4-kimi", FixtureDims(**KILL_DIMS))
    clean = root / "clean"
    run_inproc("int4-to-nvfp4", src, clean, block_scale="amax")
    return src, clean


def _done_records(dst: Path) -> set[str]:
    done = dst / ".kconvert" / "done"
    try:
        return {p.name.removesuffix(".json") for p in done.iterdir() if p.name.endswith(".json")}
    except FileNotFoundError:
        return set()


def _partials(dst: Path) -> list[str]:
    return sorted(p.name for p in (dst / ".kconvert" / "partial").glob("*"))


def test_sigkill_mid_run_then_resume_is_byte_identical(multi, tmp_path):
    src, clean = multi
    shards = sorted(p.name for p in clean.glob("*.safetensors"))
    before = snapshot(src)
    dst = tmp_path / "out"
    args = ("int4-to-nvfp4", src, dst, "--quiet", "--block-scale", "amax")
    proc = subprocess.Popen([*CLI, *map(str, args)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    try:
        # Layer 0 and at least one MoE shard finished, and the next shard half written (its
        # .partial exists); should that moment be missed, any point with 4 of 8 done will do.
        while not ((len(_done_records(dst)) >= 2 and _partials(dst))
                   or len(_done_records(dst)) >= 4):
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "no shard finished in time"
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL

    done = _done_records(dst)
    partial = _partials(dst)
    print(f"\nkilled with {len(done)}/{len(shards)} shards done, partial: {partial}")
    assert 2 <= len(done) < len(shards), f"kill not mid-run: {len(done)}/{len(shards)} done"
    assert_no_result(dst)
    assert not (dst / INDEX).exists()
    # Nothing under a final name is partial: every final-named shard is the clean run's shard.
    finals = sorted(p.name for p in dst.glob("*.safetensors"))
    assert set(done) <= set(finals) and len(finals) < len(shards)
    for name in finals:
        with safe_open(str(dst / name), "pt") as fh, safe_open(str(clean / name), "pt") as ref:
            assert set(fh.keys()) == set(ref.keys()), name
        assert (dst / name).read_bytes() == (clean / name).read_bytes(), name
    kept = {n: (os.stat(dst / n).st_ino, os.stat(dst / n).st_mtime_ns) for n in done}

    proc2 = cli_subprocess(*args, "--resume")
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    assert snapshot(dst) == snapshot(clean)  # every file incl. manifest, config, index
    assert not (dst / ".kconvert").exists()
    assert {n: (os.stat(dst / n).st_ino, os.stat(dst / n).st_mtime_ns) for n in done} == kept, \
        "--resume rewrote shards that were already complete"
    assert snapshot(src) == before


def test_overwrite_replaces_a_previous_output(tmp_path):
    src, before = _src_copy(tmp_path)
    clean = tmp_path / "clean"
    run_inproc("int4-to-nvfp4", src, clean, block_scale="amax")
    dst = tmp_path / "out"
    run_inproc("dequant", src, dst)  # a previous, different output ...
    (dst / "stray.bin").write_bytes(b"old")  # ... with extra files and stale run state
    (dst / ".kconvert" / "done").mkdir(parents=True)
    (dst / ".kconvert" / "run.json").write_text('{"fingerprint": "stale"}')
    with pytest.raises(KconvertError, match="not empty"):
        run_inproc("int4-to-nvfp4", src, dst, block_scale="amax")
    # A file the old output does not account for is the user's: never deleted, named instead.
    with pytest.raises(KconvertError, match=r"stray\.bin"):
        run_inproc("int4-to-nvfp4", src, dst, block_scale="amax", overwrite=True)
    (dst / "stray.bin").unlink()
    run_inproc("int4-to-nvfp4", src, dst, block_scale="amax", overwrite=True)
    assert snapshot(dst) == snapshot(clean)
    assert snapshot(src) == before


def test_resume_of_a_finished_output_refuses(tmp_path):
    src, _ = _src_copy(tmp_path)
    dst = tmp_path / "out"
    run_inproc("int4-to-nvfp4", src, dst, block_scale="amax")
    state = snapshot(dst)
    with pytest.raises(KconvertError) as err:
        run_inproc("int4-to-nvfp4", src, dst, block_scale="amax", resume=True)
    msg = str(err.value)
    assert re.search(r"complete", msg) and "--overwrite" in msg, msg
    assert str(dst) in msg
    assert snapshot(dst) == state


# ---------------------------------------------------------------------------- dry run



def test_dry_run_writes_nothing_and_prints_the_role_table(multi, tmp_path):
    src, clean = multi
    before = snapshot(src)
    dst = tmp_path / "out"
    proc = cli_subprocess("int4-to-nvfp4", src, dst, "--dry-run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not dst.exists()
    assert snapshot(src) == before
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["role", "source", "output", "tensors_in", "tensors_out",
                                "MB_in", "MB_out"]
    rows = {}
    for line in lines[1:]:
        parts = line.split()
        if len(parts) == 7 and not line.startswith(("total", "output format")):
            rows[tuple(parts[:3])] = (int(parts[3]), int(parts[4]), float(parts[5]),
                                      float(parts[6]))
    linears = KILL_DIMS["moe_layers"] * KILL_DIMS["experts"] * 3
    n, n_out, _, _ = rows[("routed_expert", "int4-pack-quantized", "nvfp4-compressed-tensors")]
    assert n == 3 * linears  # weight_packed, weight_scale, weight_shape each
    assert n_out == 3 * linears  # weight_packed, weight_scale, weight_global_scale each
    assert rows[("attention", "BF16", "copy")][0] > 0
    assert rows[("norm", "BF16", "copy")][0] > 0
    assert not [k for k in rows if k[1] == "bf16" or k[2] == "bf16"]  # one spelling: BF16
    total = next(line.split() for line in lines if line.startswith("total"))
    source_tensors = len(json.loads((src / INDEX).read_text())["weight_map"])
    assert int(total[1]) == source_tensors == sum(r[0] for r in rows.values())
    output_tensors = sum(len(safe_open(str(p), "pt").keys()) for p in clean.glob("*.safetensors"))
    assert int(total[2]) == output_tensors == sum(r[1] for r in rows.values())
    assert f"{output_tensors} tensors" in proc.stdout
    out_bytes = sum(data_bytes(p) for p in clean.glob("*.safetensors"))
    in_bytes = sum(data_bytes(p) for p in src.glob("*.safetensors"))
    assert abs(float(total[-1]) - out_bytes / 1e6) <= 0.051, (total, out_bytes)
    assert abs(float(total[-2]) - in_bytes / 1e6) <= 0.051, (total, in_bytes)
    n_shards = len(list(clean.glob("*.safetensors")))
    assert f"{n_shards} shards" in proc.stdout


