"""Errors while a command runs reach the user as one line that says what to do: an OSError
(injected, and real on a full and a read-only tmpfs), Ctrl-C, a KconvertError; an internal error
keeps its traceback and says it is a bug.

Every command goes through the real click entry point (`kconvert.cli.main`): in-process, or in a
process of its own where it must see a tmpfs.
"""

from __future__ import annotations

import errno
import os

import pytest

from conftest import BUNDLED
from helpers import assert_user_error, cli_inproc, write_input_ids
from kconvert.errors import KconvertError
from tmpfs import small_fs

# ------------------------------------------------------------------ errors the environment causes

@pytest.mark.parametrize(("code", "advice"), [
    (errno.ENOSPC, "free space"),
    (errno.EDQUOT, "quota"),
    (errno.EROFS, "writable"),
    (errno.EACCES, "writable"),
    (errno.ENOENT, "check the path"),
])
def test_os_errors_are_one_line_naming_the_file(code, advice, tmp_path, monkeypatch):
    """A full disk, a read-only or unwritable DST, a vanished file: exit 2, one line that
    names the file and what to do. The OSError is injected where the conversion runs, since
    these tests run as root (chmod cannot make a directory unwritable for root) and cannot
    mount a small file system."""
    import kconvert.driver.convert

    dst = tmp_path / "out"
    shard = dst / "model-00002-of-000004.safetensors"

    def fail(*_args, **_kwargs):
        raise OSError(code, os.strerror(code), str(shard))

    monkeypatch.setattr(kconvert.driver.convert, "convert", fail)
    res = cli_inproc("int4-to-nvfp4", BUNDLED, dst, "--quiet")
    assert_user_error(res, str(shard), os.strerror(code), errno.errorcode[code], advice)
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    if code == errno.ENOSPC:
        assert "--resume" in res.output


def test_full_and_read_only_file_systems_are_messages(tmp_path):
    """Real ENOSPC and EROFS: calibrate's statistics on a 16 KiB tmpfs (safetensors reports the
    full disk as a SafetensorError, not an OSError) and on a read-only one, and a conversion
    into a read-only DST; each command in a process of its own that sees the tmpfs."""
    data = write_input_ids(tmp_path / "d.jsonl", [list(range(16))])
    calibrate = ["calibrate", BUNDLED, "--data", data, "--seq-len", 16, "--samples", 1,
                 "--device", "cpu", "--quiet", "-o"]
    with small_fs(tmp_path / "full", "size=16k") as full:
        res = full.kconvert(*calibrate, full.path / "stats")
        assert_user_error(res, str(full.path / "stats"), "ENOSPC", "free space")
    with small_fs(tmp_path / "ro", "ro,size=16k") as ro:
        res = ro.kconvert(*calibrate, ro.path / "stats")
        assert_user_error(res, str(ro.path / "stats"), "read-only")
        res = ro.kconvert("int4-to-nvfp4", BUNDLED, ro.path / "out", "--quiet")
        assert_user_error(res, str(ro.path / "out"))


def test_os_error_without_a_file_name_names_the_output(tmp_path, monkeypatch):
    """write() on a full disk raises ENOSPC with no file name: the message names DST."""
    import kconvert.driver.convert

    def fail(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(kconvert.driver.convert, "convert", fail)
    res = cli_inproc("int4-to-nvfp4", BUNDLED, tmp_path / "out", "--quiet")
    assert_user_error(res, str(tmp_path / "out"), "free space")


def test_dst_below_a_regular_file_is_a_message(tmp_path):
    """A real OSError (ENOTDIR) from the file system, not an injected one."""
    (tmp_path / "file").write_text("x")
    res = cli_inproc("int4-to-nvfp4", BUNDLED, tmp_path / "file" / "out", "--quiet")
    assert_user_error(res, str(tmp_path / "file"))


def test_ctrl_c_says_how_to_continue(tmp_path, monkeypatch):
    """Ctrl-C used to print click's "Aborted!" alone: a conversion says --resume keeps its
    finished shards, and exits 130 as a shell reports SIGINT."""
    import kconvert.driver.convert

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(kconvert.driver.convert, "convert", interrupted)
    res = cli_inproc("int4-to-nvfp4", BUNDLED, tmp_path / "out", "--quiet")
    assert res.exit_code == 130 and isinstance(res.exception, SystemExit), res.output
    assert "kconvert: interrupted" in res.stderr and "--resume" in res.stderr
    assert "Aborted!" not in res.output and "Traceback" not in res.output


def test_internal_error_keeps_traceback_and_says_it_is_a_bug(tmp_path, monkeypatch):
    import kconvert.driver.convert

    def fail(*_args, **_kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(kconvert.driver.convert, "convert", fail)
    res = cli_inproc("int4-to-nvfp4", BUNDLED, tmp_path / "out", "--quiet")
    assert res.exit_code == 3 and isinstance(res.exception, SystemExit), res.output
    assert "Traceback" in res.stderr and "ZeroDivisionError" in res.stderr
    assert "bug in kconvert" in res.stderr and "report" in res.stderr


def test_kconvert_error_is_one_line_on_stderr(tmp_path, monkeypatch):
    import kconvert.audit.auditor

    def fail(*_args, **_kwargs):
        raise KconvertError("something the user can fix", file="x.json")

    monkeypatch.setattr(kconvert.audit.auditor, "run_audit", fail)
    res = cli_inproc("audit", tmp_path)
    assert_user_error(res)
    assert res.stderr == "kconvert: error: something the user can fix (file x.json)\n"
