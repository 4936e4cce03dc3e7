"""One process of a distributed test job: runs several kconvert commands in a row in one
process group (one start-up of torch per rank for all of them).

    python -m torch.distributed.run --standalone --nproc-per-node N rank_main.py COMMANDS.json

COMMANDS.json is a list of argument lists (`["int4-to-nvfp4", SRC, DST, ...]`). The first
command that fails ends the process with its exit status. With DIE_ON_RANK=R set, rank R kills
itself (SIGKILL, as the OOM killer would) the moment it has finished its first shard, or with
DIE_ON=part-done its first part of a shard other ranks write into too.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from kconvert.cli import main
from kconvert.common import distributed, events


def die_after_first(event: str, _info: dict) -> None:
    if event == os.environ.get("DIE_ON", "shard-done"):
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    if os.environ.get("DIE_ON_RANK") == str(distributed.rank()):
        events.subscribe(die_after_first)
    with open(sys.argv[1]) as f:
        commands = json.load(f)
    code = 0
    for argv in commands:
        code = main.main(args=argv, prog_name="kconvert", standalone_mode=False)
        if code:
            break
    distributed.shutdown()  # on the main thread, every rank together, before interpreter exit
    sys.exit(code)
