"""Run one command as a child process and report its peak resident memory.

    python scripts/rss_probe.py [--quiet] -- CMD [ARG ...]

The child is the only process this probe ever waits for, so
`getrusage(RUSAGE_CHILDREN).ru_maxrss` is exactly the child's high-water mark (VmHWM): the
figure is not polluted by anything the caller ran before (a pytest process that has run
other subprocesses would report the largest of all of them).

Prints one JSON line: {"rc": exit status, "maxrss_mb": peak RSS in MiB, "wall_s": seconds}.
The child's stdout/stderr are passed through unless --quiet is given.

`baseline` is a shortcut for the process floor of a conversion (python + torch + kconvert
imported, nothing converted):

    python scripts/rss_probe.py -- baseline
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

BASELINE = [sys.executable, "-c", "import torch, kconvert.cli, kconvert.engine  # noqa"]


def probe(cmd: list[str], quiet: bool = False) -> dict:
    if cmd == ["baseline"]:
        cmd = BASELINE
    out = subprocess.DEVNULL if quiet else None
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, stdout=out, stderr=out).returncode
    wall = time.perf_counter() - t0
    kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux
    return {"rc": rc, "maxrss_mb": kb / 1024, "wall_s": round(wall, 3)}


def main(argv: list[str]) -> int:
    quiet = "--quiet" in argv
    if "--" not in argv:
        print(__doc__, file=sys.stderr)
        return 2
    cmd = argv[argv.index("--") + 1:]
    if not cmd:
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps(probe(cmd, quiet)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
