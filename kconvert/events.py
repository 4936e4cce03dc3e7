"""Run events: what a conversion has just done, for observers (progress, benchmarks, tests).

The engine and the run emit an event at each step that leaves something on disk, in order:
`shard-done` (a shard renamed into place), `file-copied` (a non-weight file), `index-written`,
`config-written`, `file-written` (a generated file such as the pruning plan),
`manifest-staged` (the manifest written under its temporary name), `manifest-written` (renamed
into place), `output-committed` (a replaced output swapped in) and `run-finished` (run state
removed). An observer that raises stops the run like any other failure, so tests can stop a
run at an exact step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Listener = Callable[[str, dict[str, Any]], None]

_listeners: list[Listener] = []


def subscribe(listener: Listener) -> Callable[[], None]:
    """Call `listener(event, info)` on every event from now on; returns the unsubscribe."""
    _listeners.append(listener)
    return lambda: _listeners.remove(listener)


def emit(event: str, **info: Any) -> None:
    for listener in list(_listeners):
        listener(event, info)
