"""The program's exit (`kconvert.cli.exit_now`): sys.exit's status and messages, the exit
handlers run and the output flushed, the interpreter's teardown skipped, and the ordinary exit
kept while a thread the interpreter would wait for still runs."""

from __future__ import annotations

import subprocess
import sys

PRELUDE = """
import atexit, sys, threading, time
from kconvert.cli import exit_now

class Teardown:
    def __del__(self):
        print("teardown ran", file=sys.stderr)

kept = Teardown()  # freed only by the interpreter's teardown
atexit.register(lambda: print("exit handler ran", file=sys.stderr))
print("output", end="")
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRELUDE + code], capture_output=True,
                          text=True, timeout=60)


def test_status_output_and_exit_handlers_without_the_teardown():
    res = _run("exit_now(5)")
    assert res.returncode == 5
    assert res.stdout == "output"  # flushed, though stdout is a pipe (block-buffered)
    assert "exit handler ran" in res.stderr
    assert "teardown ran" not in res.stderr
    assert _run("exit_now(None)").returncode == 0
    message = _run("exit_now('kconvert: error: stop')")
    assert message.returncode == 1 and "kconvert: error: stop" in message.stderr
    # the same program without exit_now: the teardown runs (what the quick exit saves)
    assert "teardown ran" in _run("sys.exit(0)").stderr


def test_a_running_thread_keeps_the_ordinary_exit():
    res = _run("""
def late():
    time.sleep(0.5)
    print(" thread done", end="", flush=True)

threading.Thread(target=late).start()
exit_now(0)
""")
    assert res.returncode == 0
    assert res.stdout == "output thread done"
    assert "exit handler ran" in res.stderr
