"""Reading ahead: a pool of threads reads the next units while the caller works on one."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

U = TypeVar("U")


R = TypeVar("R")


def read_ahead(pool: ThreadPoolExecutor, units: Iterable[U], read: Callable[[U], R], depth: int
               ) -> Iterator[tuple[U, R]]:
    """(unit, read(unit)) in order, with `depth` more units being read by `pool` while the
    consumer waits for one and works on it."""
    pending: deque[tuple[U, Future]] = deque()
    todo = iter(units)

    def refill() -> None:
        while len(pending) < depth and (unit := next(todo, None)) is not None:
            pending.append((unit, pool.submit(read, unit)))

    refill()
    while pending:
        unit, fut = pending.popleft()
        refill()
        try:
            data = fut.result()
        except BaseException:
            for _, f in pending:
                f.cancel()
            raise
        yield unit, data
