"""A command's process imports what the command uses, no more: seconds of every process go to
imports (benchmarks/overhead.py). A conversion writes compressed-tensors' config block from its
presets (kconvert.formats.ct_config) without importing compressed-tensors, so neither it nor
transformers (and what they pull in: torch._dynamo, sympy) is imported; `kconvert --help`
imports no torch."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import BUNDLED

# The modules looked for at the end of a process (its first exit handler runs last).
PROBED = ("torch", "numba", "compressed_tensors", "transformers", "torch._dynamo", "sympy",
          "matplotlib")
PROGRAM = f"""
import atexit, json, sys
atexit.register(lambda: print("LOADED " + json.dumps([m for m in {PROBED!r}
                                                      if m in sys.modules])))
from kconvert.cli import run
sys.argv = ["kconvert", *sys.argv[1:]]
run()
"""


def loaded(*args: str) -> set[str]:
    """The PROBED modules imported by the program `kconvert ARGS` by its end."""
    res = subprocess.run([sys.executable, "-c", PROGRAM, *args], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("LOADED "))
    return set(json.loads(line[len("LOADED "):]))


def test_a_conversion_imports_neither_compressed_tensors_nor_transformers(tmp_path):
    got = loaded("int4-to-nvfp4", str(BUNDLED), str(tmp_path / "out"), "--device", "cpu",
                 "--quiet")
    assert (tmp_path / "out" / "config.json").is_file()
    assert got == {"torch", "numba"}  # what it runs on: torch, and the CPU kernels


def test_help_imports_no_torch():
    assert loaded("--help") == set()
