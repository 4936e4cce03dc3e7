"""Reading ahead: a pool of threads reads the next units while the caller works on one."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

U = TypeVar("U")


R = TypeVar("R")


def read_ahead(pool: ThreadPoolExecutor, units: Iterable[U], read: Callable[[U], R], depth: int,
               size: Callable[[U], int] = lambda _: 1) -> Iterator[tuple[U, R]]:
    """(unit, read(unit)) in order, with more units being read by `pool` while the consumer
    waits for one and works on it: as many as fit in `depth`, each unit counted as `size`
    says (one by default; the bytes it reads, to bound memory whatever the units' sizes), and
    always at least one."""
    pending: deque[tuple[U, Future]] = deque()
    todo = iter(units)
    ahead = 0  # size of the pending units
    nxt = next(todo, None)

    def refill() -> None:
        nonlocal ahead, nxt
        while nxt is not None and (not pending or ahead + size(nxt) <= depth):
            pending.append((nxt, pool.submit(read, nxt)))
            ahead += size(nxt)
            nxt = next(todo, None)

    refill()
    while pending:
        unit, fut = pending.popleft()
        ahead -= size(unit)
        refill()
        try:
            data = fut.result()
        except BaseException:
            for _, f in pending:
                f.cancel()
            raise
        yield unit, data
