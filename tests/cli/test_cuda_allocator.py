"""The program's CUDA allocator setting (`kconvert.cli.CUDA_ALLOCATOR`): growable segments
unless the user's environment names another setting, set before any command runs."""

from __future__ import annotations

import os
import subprocess
import sys

from kconvert.cli import CUDA_ALLOCATOR

# The program with one more command that prints what a command sees.
PROGRAM = """
import os, sys, click
from kconvert.cli import main, run
name = sys.argv.pop()
main.add_command(click.Command("show", callback=lambda: print(os.environ.get(name))))
run()
"""


def _seen(env: dict[str, str]) -> str:
    name = CUDA_ALLOCATOR[0]
    res = subprocess.run([sys.executable, "-c", PROGRAM, "show", name], capture_output=True,
                         text=True, timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def test_commands_run_with_growable_segments_unless_the_user_chose():
    name, value = CUDA_ALLOCATOR
    env = {k: v for k, v in os.environ.items() if k != name}
    assert _seen(env) == value
    assert _seen({**env, name: "max_split_size_mb:512"}) == "max_split_size_mb:512"
