"""A `kconvert` process timed from inside, for `python -m benchmarks overhead`. Run as a script
(never imported), so that its clock starts at its first line:

    python benchmarks/process_phases.py process ARGS...    # `kconvert ARGS` as the program runs
    python benchmarks/process_phases.py inprocess ARGS...  # `kconvert ARGS` twice in one process

`process` prints `RESULT {json}` from its first exit handler (which runs last, once the
program's own exit handlers ended) with time.monotonic() marks: `first` (its first line),
`imported` (kconvert.cli imported) and `ended`; `phases`: kconvert.common.events' phase spans;
`events`: when the config, manifest and run-finished events came, and when the serve checks on
the output began and ended (serve-start, serve-end); `imports`: every module's first import on
the main thread, [its top-level package, its start, its seconds less those of the imports
inside it] (so they add up to the main thread's import time); `cuda_thread_s`: what the
conversion's CUDA start-up thread logged; `cpu_s`: the process's CPU seconds (every thread).
Works with any kconvert tree that has kconvert.cli.run and the events module.

`inprocess` prints the wall and CPU seconds of each of two runs of the same command (`runs_s`,
`cpu_s`): the second has every import, kernel and device started, so it is the command's
in-process time.
"""

import time

FIRST = time.monotonic()

import atexit  # noqa: E402  (after the clock starts)
import importlib.machinery  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from collections.abc import Callable  # noqa: E402

# Loaders timed (one instance per module: timing it leaves every other module's alone).
FILE_LOADERS = (importlib.machinery.SourceFileLoader, importlib.machinery.SourcelessFileLoader,
                importlib.machinery.ExtensionFileLoader)
RUN_EVENTS = ("config-written", "manifest-written", "run-finished")


class ImportClock:
    """A meta path finder that times every module's first import on the main thread (its
    loader's exec_module), less the imports inside it: `spans`, [top-level package, start,
    seconds] each, add up to the main thread's import time."""

    def __init__(self, after: dict[str, Callable]) -> None:
        self.spans: list[list] = []
        self.inner: list[float] = []  # per import under way: the seconds of those inside it
        self.after = after  # module name -> called with the module once it is imported

    def find_spec(self, name, path=None, target=None):
        if threading.current_thread() is not threading.main_thread():
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if finder is not self and find else None
            if spec is not None:
                break
        else:
            return None
        if isinstance(spec.loader, FILE_LOADERS):
            spec.loader.exec_module = self.timed(name, spec.loader)
        return spec

    def timed(self, name: str, loader):
        exec_module = loader.exec_module

        def run(module) -> None:
            start = time.monotonic()
            self.inner.append(0.0)
            try:
                exec_module(module)
            finally:
                took = time.monotonic() - start
                self.spans.append([name.partition(".")[0], start, took - self.inner.pop()])
                if self.inner:
                    self.inner[-1] += took
                del loader.exec_module  # the loader as it was (FileLoader compares __dict__)
            if name in self.after:
                self.after[name](module)

        return run


class CudaThreadLog(logging.Handler):
    """The seconds kconvert's CUDA start-up thread logs ("CUDA started on a thread in S s")."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seconds: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("CUDA started on a thread"):
            self.seconds = float(record.args[0])


def timed_serve_check(marks: dict[str, float]) -> Callable:
    """What times the serve checks a conversion runs on its output at its end (kconvert.api's
    serve_warnings, kconvert.audit.serve): `marks` gets serve-start and serve-end."""

    def wrap(api) -> None:
        check = getattr(api, "serve_warnings", None)
        if check is None:
            return

        def timed(*args, **kwargs):
            marks["serve-start"] = time.monotonic()
            try:
                return check(*args, **kwargs)
            finally:
                marks["serve-end"] = time.monotonic()

        api.serve_warnings = timed

    return wrap


def process(args: list[str], clock: ImportClock, seen: dict[str, float]) -> None:
    """`kconvert ARGS` as the program runs it (kconvert.cli.run), timed as the docstring says;
    `seen` gets the events' times."""
    import kconvert.cli

    imported = time.monotonic()
    from kconvert.common import events

    offset = time.monotonic() - time.perf_counter()  # events carry perf_counter seconds
    phases: dict[str, list[float]] = {}

    def listen(event: str, info: dict) -> None:
        if event == "phase":
            phases[info["name"]] = [info["start"] + offset, info["end"] + offset]
        elif event in RUN_EVENTS:
            seen[event] = time.monotonic()

    events.subscribe(listen, timings=True)
    cuda = CudaThreadLog()
    startup_log = logging.getLogger("kconvert.calibrate.startup")
    startup_log.addHandler(cuda)
    startup_log.setLevel(logging.INFO)

    def result() -> None:
        print("RESULT " + json.dumps(
            {"first": FIRST, "imported": imported, "ended": time.monotonic(), "phases": phases,
             "events": seen, "imports": clock.spans, "cuda_thread_s": cuda.seconds,
             "cpu_s": time.process_time()}),
            flush=True)

    atexit.register(result)
    sys.argv = ["kconvert", *args]
    kconvert.cli.run()


def inprocess(args: list[str]) -> None:
    """`kconvert ARGS` twice in this process; the wall seconds of each."""
    import kconvert.cli

    runs, cpu = [], []
    for _ in range(2):
        start, start_cpu = time.monotonic(), time.process_time()
        status = kconvert.cli.main(args, standalone_mode=False)
        runs.append(time.monotonic() - start)
        cpu.append(time.process_time() - start_cpu)
        if status:
            raise SystemExit(f"kconvert {' '.join(args)} exited {status}")
    print("RESULT " + json.dumps({"runs_s": runs, "cpu_s": cpu}), flush=True)


if __name__ == "__main__":
    mode, rest = sys.argv[1], sys.argv[2:]
    if mode == "process":
        marks: dict[str, float] = {}
        timer = ImportClock({"kconvert.api": timed_serve_check(marks)})
        sys.meta_path.insert(0, timer)
        process(rest, timer, marks)
    else:
        inprocess(rest)
