"""The output directory: --overwrite replaces only what is kconvert's, one run at a time, resume
after a kill at every step audits clean, resume re-checks what it keeps, disk full and read-only
DST end in a message, --dry-run needs no empty DST."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import BUNDLED
from helpers import (
    CLI,
    S2,
    assert_audit_passes,
    cli_inproc,
    edit_tensor,
    run_inproc,
    set_at,
    snapshot,
    source_copy,
)
from kconvert.errors import KconvertError
from kconvert.io import lock, output_dir
from tmpfs import small_fs

MANIFEST = "kconvert-manifest.json"
# Runs the CLI and SIGKILLs itself at the Nth occurrence of a run event (kconvert.common.events).
KILLER = """
import os, signal, sys
from kconvert.common import events
from kconvert.cli import main
event, nth = sys.argv[1], int(sys.argv[2])
seen = []
def stop(name, info):
    if name == event:
        seen.append(info)
        if len(seen) == nth:
            os.kill(os.getpid(), signal.SIGKILL)
events.subscribe(stop)
sys.argv = ["kconvert", *sys.argv[3:]]
main()
"""


def killed_at(event: str, *args, nth: int = 1) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-c", KILLER, event, str(nth), *map(str, args)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, (event, proc.returncode, proc.stderr[-2000:])
    return proc


def plan_file(tmp_path: Path) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"layers": {str(layer): {"keep": [0, 2, 3, 5, 8, 9, 12, 15]}
                                           for layer in (1, 2)}}))
    return path


# ------------------------------------------------------------------------------ --overwrite


def test_overwrite_refuses_a_directory_that_is_not_a_kconvert_output(tmp_path):
    src = source_copy(tmp_path)
    mine = tmp_path / "mydir"
    (mine / "sub").mkdir(parents=True)
    (mine / "precious.txt").write_text("keep")
    before = snapshot(mine)
    res = cli_inproc("int4-to-nvfp4", src, mine, "--overwrite", "--quiet")
    assert res.exit_code == 1, res.stderr
    assert "precious.txt" in res.stderr and "sub" in res.stderr
    assert "Traceback" not in res.stderr
    assert snapshot(mine) == before


def test_overwrite_refuses_files_named_as_recorded_but_not_the_recorded_files(tmp_path):
    """A copied manifest beside a user's file that has a recorded name: --overwrite compares
    sizes (shards) and hashes (other files) with the manifest and refuses, naming the file."""
    src = source_copy(tmp_path)
    made = tmp_path / "made"
    assert cli_inproc("int4-to-nvfp4", src, made, "--quiet").exit_code == 0
    for name, content in (("model-00001-of-000004.safetensors", b"my data!!"),
                          ("tokenizer_config.json", b"{}")):
        mine = tmp_path / f"mine-{name}"
        mine.mkdir()
        shutil.copy(made / "kconvert-manifest.json", mine)
        (mine / name).write_bytes(content)
        before = snapshot(mine)
        res = cli_inproc("int4-to-nvfp4", src, mine, "--overwrite", "--quiet")
        assert res.exit_code == 1, res.stderr
        assert "not what the kconvert output in DST recorded" in res.stderr
        assert name in res.stderr and "Traceback" not in res.stderr
        assert snapshot(mine) == before
    # the real output is still replaced
    assert cli_inproc("int4-to-nvfp4", src, made, "--overwrite", "--quiet").exit_code == 0


def test_overwrite_that_fails_leaves_the_old_output_as_it_was(tmp_path):
    src = source_copy(tmp_path)
    dst = tmp_path / "out"
    run_inproc("dequant", src, dst)
    old = snapshot(dst)
    # A bad option fails before anything is touched ...
    with pytest.raises(KconvertError, match="targets"):
        run_inproc("int4-to-nvfp4", src, dst, targets="everything", overwrite=True)
    assert snapshot(dst) == old
    # ... and a NaN found mid-run, after the new output was begun beside the old one.
    edit_tensor(src / S2, "model.layers.1.mlp.experts.3.up_proj.weight_scale",
                set_at((0, 0), float("nan")))
    with pytest.raises(KconvertError, match="NaN"):
        run_inproc("int4-to-nvfp4", src, dst, overwrite=True)
    assert snapshot(dst) == old
    assert_audit_passes(dst, "--source", source_copy(tmp_path / "again"))


def test_overwrite_swaps_when_there_is_room_and_deletes_first_when_not(tmp_path, monkeypatch):
    src = source_copy(tmp_path)
    clean = tmp_path / "clean"
    run_inproc("int4-to-nvfp4", src, clean, block_scale="amax")
    dst = tmp_path / "out"
    run_inproc("dequant", src, dst)
    said = []
    real = shutil.disk_usage

    def free_for_one(path):
        """A 4 MB disk holding DST and nothing else: room for the new output only once the
        old one (2.4 MB) is gone."""
        used = sum(f.stat().st_size for d in (dst, *tmp_path.glob(".out.kconvert*"))
                   for f in d.rglob("*") if f.is_file())
        return real(path)._replace(free=4_000_000 - used)

    monkeypatch.setattr(output_dir.shutil, "disk_usage", free_for_one)
    from kconvert.driver.convert import RunControl, convert
    from kconvert.driver.recipes import load_recipe

    convert(str(src), str(dst), load_recipe("int4-to-nvfp4"),
            {"format": None, "block_scale": "amax", "targets": None, "act_stats": None},
            RunControl(quiet=True, device="cpu", overwrite=True), echo=said.append)
    assert any("deleting the old output first" in s for s in said), said
    assert snapshot(dst) == snapshot(clean)
    monkeypatch.setattr(output_dir.shutil, "disk_usage", real)
    said.clear()
    convert(str(src), str(dst), load_recipe("dequant"), {}, RunControl(quiet=True, overwrite=True),
            echo=said.append)
    assert any("beside the old one" in s for s in said), said
    assert not [p for p in tmp_path.iterdir() if "kconvert" in p.name]  # no staging left
    assert_audit_passes(dst, "--source", src)


def test_overwrite_through_a_symlink_and_a_dangling_one(tmp_path):
    src = source_copy(tmp_path)
    real_dir = tmp_path / "real"
    run_inproc("dequant", src, real_dir)
    link = tmp_path / "link"
    link.symlink_to(real_dir, target_is_directory=True)
    run_inproc("int4-to-nvfp4", src, link, overwrite=True)
    assert link.is_symlink() and json.loads((link / MANIFEST).read_text())["command"] == \
        "int4-to-nvfp4"
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    res = cli_inproc("int4-to-nvfp4", src, dangling, "--overwrite", "--quiet")
    assert res.exit_code == 1 and "does not exist" in res.stderr, res.stderr


# ------------------------------------------------------------------------------ the lock


def test_a_second_run_into_a_dst_in_use_is_refused_naming_the_holder(tmp_path):
    src = source_copy(tmp_path)
    dst = tmp_path / "out"
    with lock.locked(dst, print):
        res = cli_inproc("dequant", src, dst, "--quiet")
    assert res.exit_code == 1, res.stderr
    assert f"pid {os.getpid()}" in res.stderr and "another kconvert run" in res.stderr
    assert not (dst / MANIFEST).exists()
    assert not dst.exists()  # the holder created DST and left nothing behind


def test_concurrent_runs_one_is_refused_and_the_other_audits_clean(tmp_path):
    src = source_copy(tmp_path)
    dst = tmp_path / "out"
    first = subprocess.Popen([*CLI, "int4-to-nvfp4", str(src), str(dst), "--quiet"],
                             stderr=subprocess.PIPE, text=True)
    procs = [first]
    while not (dst / ".kconvert" / "lock").exists() and first.poll() is None:
        time.sleep(0.01)
    procs.append(subprocess.Popen([*CLI, "dequant", str(src), str(dst), "--quiet"],
                                  stderr=subprocess.PIPE, text=True))
    (rc1, err1), (rc2, err2) = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert rc1 == 0, err1
    # Refused at once while the first runs (or, had it finished, because DST is now complete).
    assert rc2 == 1 and ("another kconvert run" in err2 or "not empty" in err2), err2
    assert "Traceback" not in err2
    assert json.loads((dst / MANIFEST).read_text())["command"] == "int4-to-nvfp4"
    assert_audit_passes(dst, "--source", src)


def test_the_lock_of_a_killed_run_is_released(tmp_path):
    src = source_copy(tmp_path)
    dst = tmp_path / "out"
    killed_at("shard-done", "dequant", src, dst, "--quiet")
    assert (dst / ".kconvert" / "lock").exists()
    run_inproc("dequant", src, dst, resume=True)
    assert_audit_passes(dst, "--source", src)


# ------------------------------------------------------------------------------ kill + resume

PHASES = ["shard-done", "file-copied", "index-written", "config-written", "file-written",
          "manifest-staged", "manifest-written"]
COMMANDS = {
    "int4-to-nvfp4": lambda tmp: ["int4-to-nvfp4", "--block-scale", "amax"],
    "dequant": lambda tmp: ["dequant"],
    "reap": lambda tmp: ["reap", "--plan", plan_file(tmp)],
}


@pytest.fixture(scope="module")
def clean_outputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("clean")
    outs = {}
    for name, args in COMMANDS.items():
        a = args(root)
        outs[name] = root / name
        assert cli_inproc(a[0], BUNDLED, outs[name], *a[1:], "--quiet").exit_code == 0
    return outs


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("phase", PHASES)
def test_kill_at_every_phase_then_resume_is_identical_and_audits(command, phase, tmp_path,
                                                               clean_outputs):
    if phase == "file-written" and command != "reap":
        pytest.skip("only a pruning run writes a stage file (reap-plan.json)")
    src = BUNDLED  # the same source path as the clean outputs: their manifests name it
    dst = tmp_path / "out"
    args = COMMANDS[command](tmp_path)
    killed_at(phase, args[0], src, dst, *args[1:], "--quiet")
    assert (dst / ".kconvert").is_dir()
    if phase != "manifest-written":
        assert not (dst / MANIFEST).exists()
    res = cli_inproc(args[0], src, dst, *args[1:], "--quiet", "--resume")
    assert res.exit_code == 0, res.stderr
    assert snapshot(dst) == snapshot(clean_outputs[command])
    assert_audit_passes(dst, "--source", src)


def test_disk_full_at_the_manifest_then_resume(tmp_path, monkeypatch, clean_outputs):
    src, dst = BUNDLED, tmp_path / "out"
    from kconvert.driver import finish_output

    real = finish_output.write_text

    def write_text(path, text, tmp=None, **kw):
        if path.name == MANIFEST:
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp))
        return real(path, text, tmp, **kw)

    monkeypatch.setattr(finish_output, "write_text", write_text)
    with pytest.raises(KconvertError) as err:
        run_inproc("dequant", src, dst)
    msg = str(err.value)
    assert "bytes" in msg and "free" in msg and "--resume" in msg, msg
    assert not (dst / MANIFEST).exists()
    monkeypatch.setattr(finish_output, "write_text", real)
    run_inproc("dequant", src, dst, resume=True)
    assert snapshot(dst) == snapshot(clean_outputs["dequant"])
    assert_audit_passes(dst, "--source", src)


def test_resume_rewrites_a_finished_shard_whose_bytes_changed(tmp_path, clean_outputs):
    src, dst = BUNDLED, tmp_path / "out"
    killed_at("shard-done", "dequant", src, dst, "--quiet", nth=2)
    done = sorted(p.stem for p in (dst / ".kconvert" / "done").glob("*.json"))
    victim = dst / done[0]
    with open(victim, "r+b") as fh:  # flip one byte of tensor data
        fh.seek(victim.stat().st_size - 10)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))
    flipped = victim.read_bytes()
    res = cli_inproc("dequant", src, dst, "--quiet", "--resume", "--trust-complete")
    assert res.exit_code == 0, res.stderr
    assert victim.read_bytes() == flipped  # trusted: kept as it is, as documented
    shutil.rmtree(dst)
    killed_at("shard-done", "dequant", src, dst, "--quiet", nth=2)
    victim.write_bytes(flipped)
    res = cli_inproc("dequant", src, dst, "--resume")
    assert res.exit_code == 0, res.stderr
    assert f"{victim.name}: tensor" in res.stdout and "writing the shard again" in res.stdout
    assert snapshot(dst) == snapshot(clean_outputs["dequant"])
    assert_audit_passes(dst, "--source", src)


# ------------------------------------------------------------------------------ disk space


def test_a_disk_too_small_is_refused_before_writing(tmp_path):
    src = source_copy(tmp_path)
    with small_fs(tmp_path / "fs", "size=2m") as fs:
        proc = fs.kconvert("dequant", src, fs.path / "out", "--quiet")
        assert proc.returncode == 1, proc.stderr
        assert "not enough disk space" in proc.stderr and "bytes) free" in proc.stderr
        assert "including a margin of 1 MiB + 0.1%" in proc.stderr  # the figure says so
        assert "Traceback" not in proc.stderr
        assert not fs.exists(fs.path / "out")


def test_disk_full_mid_run_says_what_is_needed_then_resume_completes(tmp_path, monkeypatch,
                                                                    clean_outputs):
    src, dst = BUNDLED, tmp_path / "out"
    from kconvert.io import shards as safetensors_io

    real, written = os.pwrite, []

    def pwrite(fd, data, pos):
        written.append(len(data))
        if sum(written) > 600_000:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, pos)

    monkeypatch.setattr(safetensors_io.os, "pwrite", pwrite)
    with pytest.raises(KconvertError) as err:
        run_inproc("dequant", src, dst)
    assert "needs about" in str(err.value) and "--resume" in str(err.value)
    assert not (dst / MANIFEST).exists()
    monkeypatch.setattr(safetensors_io.os, "pwrite", real)
    run_inproc("dequant", src, dst, resume=True)
    assert snapshot(dst) == snapshot(clean_outputs["dequant"])


def test_read_only_dst_is_a_message(tmp_path, monkeypatch):
    src = source_copy(tmp_path)
    with small_fs(tmp_path / "ro", "size=1m,ro") as fs:
        proc = fs.kconvert("dequant", src, fs.path / "out", "--quiet")
        assert proc.returncode == 1, proc.stderr
        assert "read-only file system" in proc.stderr and "Traceback" not in proc.stderr


def test_unwritable_dst_injected_is_a_message(tmp_path, monkeypatch):
    """Where no read-only file system can be mounted: the same error, injected."""
    src = source_copy(tmp_path)
    real = Path.mkdir

    def mkdir(self, *a, **kw):
        if self.name == ".kconvert":
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real(self, *a, **kw)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(KconvertError, match="read-only file system"):
        run_inproc("dequant", src, tmp_path / "out")


# ------------------------------------------------------------------------------ --dry-run


def test_dry_run_on_a_non_empty_dst_writes_nothing(tmp_path):
    src = source_copy(tmp_path)
    dst = tmp_path / "out"
    run_inproc("dequant", src, dst)
    before = snapshot(dst)
    res = cli_inproc("int4-to-nvfp4", src, dst, "--dry-run")
    assert res.exit_code == 0, res.stderr
    assert "output format" in res.stdout
    assert snapshot(dst) == before
