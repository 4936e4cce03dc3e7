"""The command line, run with defaults that are not options set in its process (for
benchmarks.quality.defaults_sweep): the learned methods' step size, the GPTQ / learned guard's
held-out split, and the repair's settings (its held-out share, compensation's ridges, learned
compensation's steps, step size and batch).

    python -m benchmarks.quality.process_settings '{"repair": {"heldout": 0.5}}' reap SRC DST ...
"""

from __future__ import annotations

import functools
import json
import math
import sys


def patched_cli(argv: list[str]) -> None:
    """`python -m benchmarks.quality.defaults_sweep SETTINGS ARGS...`: the command line with
    ARGS, after the process settings SETTINGS (JSON: SETTERS keys and values) are set."""
    settings = json.loads(argv[0])
    for key, value in settings.items():
        SETTERS[key](value)
    sys.argv = ["kconvert", *argv[1:]]
    from kconvert.cli import run
    run()


def set_method_lr(lr: float) -> None:
    """The learned methods' weight step; p48's pattern step keeps its ratio to it (as
    learned_sweep moved them)."""
    from kconvert.methods import learned
    learned.LearnedNvfp4.lr = learned.LearnedP48.lr = lr
    learned.LearnedP48.mask_lr = lr * learned.P48_MASK_LR / learned.P48_LR


def set_held_every(every: int) -> None:
    """Every module that reads HELDOUT_EVERY at call time, and the routed-token floor it
    sets (kconvert.methods.learned)."""
    from kconvert.methods import hessians, learned, obs
    for module in (obs, hessians, learned):
        module.HELDOUT_EVERY = every
    learned.MIN_ROUTED_TOKENS = max(obs.HELDOUT_MIN * every,
                                    math.ceil(learned.MIN_FIT_TOKENS * every / (every - 1)))


def set_repair(settings: dict) -> None:
    """RepairSettings as the prune stage builds it (kconvert.stages.prune_data imports it from
    kconvert.pruning.repair when it runs), with `settings` as its defaults."""
    from kconvert.pruning import repair
    from kconvert.pruning.compensate_learned import LearnedSettings
    given = dict(settings)
    if "ridges" in given:
        given["ridges"] = tuple(given["ridges"])
    if "learned" in given:
        given["learned"] = LearnedSettings(**given["learned"])
    repair.RepairSettings = functools.partial(repair.RepairSettings, **given)


SETTERS = {"method_lr": set_method_lr, "held_every": set_held_every, "repair": set_repair,
           "learned_compensation": lambda value: set_repair({"learned": value})}


if __name__ == "__main__":
    patched_cli(sys.argv[1:])
