"""-v/--verbose: the steps of a run through the logging module on stderr; without it the
output is what it always was (stdout and stderr alike)."""

from __future__ import annotations

from helpers import cli_subprocess


def test_verbose_logs_the_steps_and_default_output_is_unchanged(fixture_dir, tmp_path):
    src = fixture_dir("k2-int4-kimi")
    quiet = cli_subprocess("int4-to-nvfp4", src, tmp_path / "a", "--dry-run")
    loud = cli_subprocess("int4-to-nvfp4", src, tmp_path / "b", "--dry-run", "-v")
    assert quiet.returncode == loud.returncode == 0, (quiet.stderr, loud.stderr)
    assert quiet.stdout == loud.stdout
    assert "kconvert: INFO" not in quiet.stderr
    assert f"kconvert: INFO: opened {src}: 4 shard(s)" in loud.stderr
    assert "kconvert: INFO: build_work_plan took" in loud.stderr
    assert "kconvert: INFO: planned on " in loud.stderr
    assert "DEBUG" not in loud.stderr
    details = cli_subprocess("int4-to-nvfp4", src, tmp_path / "c", "--dry-run", "-vv")
    assert "kconvert: DEBUG: shard model-00001-of-000004.safetensors: " in details.stderr
