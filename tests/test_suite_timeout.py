"""The suite's per-test timeout (pytest-timeout, pyproject's `timeout`): a test that hangs fails
with its name and the tests after it still run, as CI's `make test` runs them."""

from __future__ import annotations

import subprocess
import sys


def test_the_suite_sets_a_generous_timeout(pytestconfig):
    assert pytestconfig.pluginmanager.hasplugin("timeout")
    assert 300 <= float(pytestconfig.getini("timeout")) <= 3600


def test_a_hung_test_fails_by_name_and_the_rest_run(tmp_path):
    (tmp_path / "test_hang.py").write_text(
        "import threading\n\n"
        "def test_waits_on_an_event_never_set():\n"
        "    threading.Event().wait()\n\n"
        "def test_after_it():\n"
        "    pass\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-o", "timeout=2", str(tmp_path / "test_hang.py")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED test_hang.py::test_waits_on_an_event_never_set - Failed: Timeout" in done.stdout
    assert "1 failed, 1 passed" in done.stdout
