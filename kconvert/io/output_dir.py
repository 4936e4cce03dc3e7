"""The output directory DST: what may be replaced, the lock, resume state, and the final swap.

Rules, so that no run ever loses data or passes off a half-written output as complete:
- DST must not overlap SRC. A non-empty DST needs `--resume` (continue the interrupted run in
  it) or `--overwrite` (replace it), and `--overwrite` replaces only a kconvert output (it has a
  manifest or run state) whose every file the output accounts for, or an empty directory.
- One run at a time: `DST/.kconvert/lock` is held with flock for the whole run; the OS releases
  it if the holder dies, and a second run is refused naming the holder.
- Nothing is deleted before every input check and the plan have passed (the caller prepares the
  workspace only then). `--overwrite` writes the new output in a staging directory beside DST
  and swaps it in at the end when the file system has room for both, so a failed run leaves the
  old output as it was; without room for both, the old output is deleted first (and said so).
- Run state lives in `<workspace>/.kconvert/`: `run.json` (what the run writes), `done/` (a record
  per finished shard: its tensors' content hashes), `partial/` (shards being written) and `tmp/`
  (temporary names of whole-file writes); `DST/.kconvert/refit/` holds REAP compensation's
  spill during the run. kconvert's temporary files never sit among the outputs.
- `--resume` keeps a finished shard only if its header, size and every tensor's content hash
  still match its record (`--trust-complete` skips the hashing).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kconvert import events
from kconvert.errors import KconvertError
from kconvert.io.directories import overlaps
from kconvert.io.files import hash_file, human_bytes, write_json
from kconvert.io.hashing import TensorHashes
from kconvert.io.lock import LOCK_FILE, STATE_DIR, acquire, holder_of, in_use, unwritable
from kconvert.io.shards import plan_header, read_header
from kconvert.manifest import MANIFEST

RUN_FILE = "run.json"
# Under the state folder: where REAP's compensation spills re-fitted matrices during its
# calibration (kconvert.stages.prune_data), removed when the run ends.
REFIT_DIR = "refit"
STAGING_SUFFIX = ".kconvert-new"
# Room kept free beyond the planned bytes (file system metadata, rounding to blocks): this
# much plus a thousandth of the output.
SPACE_MARGIN = 1 << 20
VERIFY_CHUNK = 16 << 20

ShardEntries = dict[str, list[tuple[str, str, tuple[int, ...]]]]


@dataclass
class Workspace:
    """Where a run writes: DST itself, or (`replaces`) a staging directory swapped in for DST."""

    dst: Path
    root: Path
    replaces: bool = False

    @property
    def state(self) -> Path:
        return self.root / STATE_DIR

    def tmp(self, rel: str) -> Path:
        """The temporary name of output file `rel` while it is written."""
        return self.state / "tmp" / rel.replace("/", "%")


def resolve_dst(dst: str | Path) -> Path:
    """DST as the directory that will be written (a symbolic link is followed)."""
    path = Path(dst)
    if path.is_symlink():
        target = path.resolve()
        if not target.exists():
            raise KconvertError(f"DST is a symbolic link to {target}, which does not exist",
                                file=str(path))
        return target
    return path


def check_dst(src_root: Path, dst: Path, resume: bool, overwrite: bool, dry_run: bool) -> None:
    """Refuse a DST that overlaps SRC, is not a directory, or is in use without permission."""
    if overlaps(src_root, dst):
        raise KconvertError("DST must not be SRC, inside it, or contain it (the source is "
                            "never modified)", file=str(dst))
    if resume and overwrite:
        raise KconvertError("give --resume or --overwrite, not both")
    if dst.exists() and not dst.is_dir():
        raise KconvertError("DST exists and is not a directory", file=str(dst))
    if dry_run:
        return
    holder = holder_of(dst / STATE_DIR / LOCK_FILE)
    if holder is not None:
        raise in_use(dst, holder)
    if _entries(dst) and not (resume or overwrite):
        raise KconvertError("DST is not empty; pass --resume to continue an interrupted run "
                            "or --overwrite to replace it", file=str(dst))
    if overwrite and _entries(dst):
        _check_replaceable(dst)


def _entries(path: Path) -> list[str]:
    """Names in directory `path` (none if it does not exist)."""
    return sorted(p.name for p in path.iterdir()) if path.is_dir() else []


def _staging(dst: Path) -> Path:
    return dst.parent / f".{dst.name}{STAGING_SUFFIX}"


def _accounted(root: Path) -> set[str] | None:
    """Relative paths a kconvert output in `root` accounts for, or None if it is none.

    A finished output: its manifest's shards, non-weight and generated files. An interrupted
    run: the files its run state says it writes.
    """
    manifest, run = root / MANIFEST, root / STATE_DIR / RUN_FILE
    names: set[str] = set()
    if manifest.is_file():
        names.add(MANIFEST)
        with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):
            data = json.loads(manifest.read_text())
            for key in ("files", "non_weight_files", "generated_files"):
                names.update(data.get(key) or {})
    if run.is_file():
        with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):
            names.update(json.loads(run.read_text()).get("files") or [])
    elif not manifest.is_file() and not (root / STATE_DIR).is_dir():
        return None
    return names


def _unaccounted(root: Path, accounted: set[str]) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir == STATE_DIR or rel_dir.startswith(STATE_DIR + os.sep):
            dirnames[:] = []
            continue
        for fn in filenames:
            rel = os.path.normpath(os.path.join(rel_dir, fn))
            if rel not in accounted:
                out.append(rel)
    return sorted(out)


def _check_replaceable(dst: Path) -> None:
    accounted = _accounted(dst)
    if accounted is None:
        shown = ", ".join(_entries(dst)[:5])
        raise KconvertError(f"--overwrite replaces only a kconvert output (a directory with a "
                            f"{MANIFEST} or .kconvert/) or an empty directory; DST holds "
                            f"{shown}{', ...' if len(_entries(dst)) > 5 else ''}",
                            file=str(dst))
    unknown = _unaccounted(dst, accounted)
    if unknown:
        raise KconvertError(f"--overwrite would delete files that the kconvert output in DST "
                            f"does not account for: {', '.join(unknown[:5])}"
                            f"{', ...' if len(unknown) > 5 else ''}; move them away first",
                            file=str(dst))
    changed = _not_as_recorded(dst)
    if changed:
        raise KconvertError(f"--overwrite would delete files that are not what the kconvert "
                            f"output in DST recorded: {'; '.join(changed[:5])}"
                            f"{'; ...' if len(changed) > 5 else ''}; move them away first",
                            file=str(dst))


def _not_as_recorded(root: Path) -> list[str]:
    """Files present in `root` whose size (shards) or xxh3-128 (every other file) differs from
    what its manifest records: a file with a recorded name is not necessarily the file. Files
    an interrupted run in `root` writes (its run state names them) may differ."""
    try:
        data = json.loads((root / MANIFEST).read_text())
        run = root / STATE_DIR / RUN_FILE
        rewriting = set(json.loads(run.read_text()).get("files") or []) if run.is_file() \
            else set()
    except (OSError, ValueError, AttributeError, TypeError):
        return []
    out = []
    for name, entry in (data.get("files") or {}).items():
        path = root / name
        if name not in rewriting and path.is_file() and isinstance(entry, dict) and \
                path.stat().st_size != entry.get("bytes"):
            out.append(f"{name} ({path.stat().st_size} bytes, the manifest says "
                       f"{entry.get('bytes')})")
    for key in ("non_weight_files", "generated_files"):
        for name, digest in (data.get(key) or {}).items():
            path = root / name
            if name not in rewriting and path.is_file() and hash_file(path) != digest:
                out.append(f"{name} (its xxh3-128 is not the manifest's)")
    return out


# ------------------------------------------------------------------------------ preparing


@dataclass(frozen=True)
class Planned:
    """What a run will write: relative file names and bytes (shards, copies, generated)."""

    files: tuple[str, ...]
    shard_bytes: dict[str, int]
    other_bytes: int


def prepare(dst: Path, planned: Planned, fingerprint: tuple[str, dict], resume: bool,
            overwrite: bool, trust_complete: bool, shard_entries: ShardEntries,
            echo: Callable[[str], None]) -> tuple[Workspace, dict[str, dict]]:
    """The workspace to write into and the records of shards already complete (resume).
    `fingerprint`: the digest of what the run writes and what it is made of (recorded in the
    run state, so that a --resume of another run says what differs).

    Called with the lock held, after every input check: only here is anything deleted.
    """
    _remove_leftovers(dst, echo)
    ws, done = Workspace(dst, dst), {}
    if resume:
        ws, done = _resumed(dst, fingerprint, planned, trust_complete, shard_entries, echo)
    elif overwrite and _entries(dst) != [STATE_DIR]:
        ws = _replacement(dst, planned, echo)
    needed = sum(n for s, n in planned.shard_bytes.items() if s not in done)
    _check_space(ws.root, needed + planned.other_bytes)
    try:
        ws.root.mkdir(parents=True, exist_ok=True)
        for sub in ("partial", "done", "tmp"):
            (ws.state / sub).mkdir(parents=True, exist_ok=True)
        write_json(ws.state / RUN_FILE, {"fingerprint": fingerprint[0],
                                         "started_by": fingerprint[1], "files": planned.files},
                   ws.tmp(RUN_FILE))
    except OSError as exc:
        raise unwritable(ws.root, exc) from exc
    return ws, done


def _resumed(dst: Path, fingerprint: tuple[str, dict], planned: Planned, trust_complete: bool,
             shard_entries: ShardEntries, echo) -> tuple[Workspace, dict[str, dict]]:
    staging = _staging(dst)
    if (staging / STATE_DIR / RUN_FILE).is_file():
        ws = Workspace(dst, staging, replaces=True)
        echo(f"resuming the replacement of {dst} in {staging}")
    elif (dst / STATE_DIR / RUN_FILE).is_file():
        ws = Workspace(dst, dst)
    elif (dst / MANIFEST).is_file():
        raise KconvertError("DST is already a complete output (it has a manifest); use "
                            "--overwrite to redo it", file=str(dst))
    elif [n for n in _entries(dst) if n != STATE_DIR]:
        raise KconvertError("--resume: DST holds files but no kconvert run state",
                            file=str(dst))
    else:
        return Workspace(dst, dst), {}
    recorded = json.loads((ws.state / RUN_FILE).read_text())
    if recorded.get("fingerprint") != fingerprint[0]:
        differs = _differences(recorded.get("started_by") or {}, fingerprint[1])
        raise KconvertError("--resume: DST was started by a different command, options or "
                            f"source ({differs or 'an earlier kconvert did not record which'}); "
                            "use --overwrite to start again", file=str(ws.root))
    return ws, _complete_shards(ws, shard_entries, trust_complete, echo)


def _differences(then: dict, now: dict, limit: int = 3) -> str:
    """What differs between the run that started DST and this one, as dotted keys with both
    values (`then` empty: nothing recorded)."""
    if not then:
        return ""

    def flat(d: dict, prefix: str = "") -> dict[str, object]:
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
        return out

    a, b = flat(then), flat(now)
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    shown = [f"{k}: {a.get(k, '(none)')} then, {b.get(k, '(none)')} now" for k in keys[:limit]]
    return "; ".join(shown) + (f"; and {len(keys) - limit} more" if len(keys) > limit else "")


def _replacement(dst: Path, planned: Planned, echo) -> Workspace:
    """Where an --overwrite run writes: beside DST when there is room for both, else DST
    itself after deleting the old output."""
    staging = _staging(dst)
    if staging.exists():
        if _accounted(staging) is None:
            raise KconvertError(f"{staging} is in the way of the staging directory and is not "
                                "a kconvert output; move it away", file=str(staging))
        shutil.rmtree(staging)
    need = _with_margin(sum(planned.shard_bytes.values()) + planned.other_bytes)
    free = shutil.disk_usage(dst).free
    same_fs = os.stat(dst).st_dev == os.stat(dst.parent).st_dev
    if same_fs and free >= need:
        echo(f"writing the new output beside the old one ({staging.name}); it replaces DST "
             "when complete")
        return Workspace(dst, staging, replaces=True)
    reclaim = _tree_bytes(dst)
    why = ("DST is a mount point" if not same_fs else
           f"no room for both outputs ({human_bytes(need)} needed, {human_bytes(free)} free)")
    if free + reclaim < need:
        raise _no_space(dst, need, free + reclaim, "even after deleting the old output")
    echo(f"deleting the old output first: {why}; if this run fails, DST holds neither "
         "(continue with --resume)")
    for entry in dst.iterdir():
        if entry.name == STATE_DIR:
            for inner in entry.iterdir():
                if inner.name not in (LOCK_FILE, REFIT_DIR):  # the run's own
                    _remove(inner)
        else:
            _remove(entry)
    return Workspace(dst, dst)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _tree_bytes(root: Path) -> int:
    return sum(os.lstat(os.path.join(d, f)).st_size for d, _, fs in os.walk(root) for f in fs)


def _no_space(where: Path, need: int, free: int, extra: str = "") -> KconvertError:
    return KconvertError(f"not enough disk space: the output needs {human_bytes(need)} "
                         f"({need} bytes, including a margin of 1 MiB + 0.1% for the file "
                         f"system's own use), the file system has {human_bytes(free)} ({free} "
                         f"bytes) free{' ' + extra if extra else ''}; free space and run again "
                         "(--resume continues an interrupted run)", file=str(where))


def _check_space(root: Path, need: int) -> None:
    probe = root
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < _with_margin(need):
        raise _no_space(root, _with_margin(need), free)


def _with_margin(need: int) -> int:
    return need + SPACE_MARGIN + need // 1000


def disk_full(root: Path, need: int, exc: OSError) -> KconvertError:
    """The error for a write that ran out of space during the run."""
    free = shutil.disk_usage(root).free if root.exists() else 0
    return KconvertError(f"the disk filled up while writing ({exc.strerror}); the rest of the "
                         f"output needs about {human_bytes(need)} ({need} bytes), "
                         f"{human_bytes(free)} ({free} bytes) are free; free space, then run the "
                         "same command with --resume to continue", file=exc.filename or str(root))


# ------------------------------------------------------------------------------ resume checks


def _complete_shards(ws: Workspace, shard_entries: ShardEntries, trust: bool, echo
                     ) -> dict[str, dict]:
    """Records of shards that are complete and unchanged since they were written."""
    candidates = {}
    for shard, entries in shard_entries.items():
        rec, final = ws.state / "done" / f"{shard}.json", ws.root / shard
        if not (rec.is_file() and final.is_file()):
            continue
        head, offsets = plan_header(entries)
        size = len(head) + max((e for _, e in offsets.values()), default=0)
        # Complete only if its header is the planned one and its size right.
        if read_header(final) == head and final.stat().st_size == size:
            candidates[shard] = json.loads(rec.read_text())
    if trust or not candidates:
        return candidates
    echo(f"checking the content hashes of {len(candidates)} finished shard(s) "
         "(--trust-complete skips this)")
    with ThreadPoolExecutor(min(4, len(candidates))) as pool:
        bad = dict(zip(candidates, pool.map(
            lambda s: _first_changed(ws.root / s, shard_entries[s], candidates[s]),
            candidates), strict=True))
    for shard, tensor in sorted(bad.items()):
        if tensor is not None:
            echo(f"{shard}: tensor {tensor} no longer matches the hash recorded when it was "
                 "written; writing the shard again")
            del candidates[shard]
            (ws.state / "done" / f"{shard}.json").unlink()
    return candidates


def _first_changed(path: Path, entries, record: dict) -> str | None:
    """The first tensor of a finished shard whose bytes do not hash to its record, or None."""
    head, offsets = plan_header(entries)
    hashes, recorded = TensorHashes(), record.get("tensors", {})
    view = memoryview(bytearray(VERIFY_CHUNK))
    fd = os.open(path, os.O_RDONLY)
    try:
        for name, (start, end) in sorted(offsets.items(), key=lambda kv: kv[1]):
            pos, digest = len(head) + start, None
            while digest is None:
                n = os.preadv(fd, [view[:min(VERIFY_CHUNK, len(head) + end - pos)]], pos)
                if n == 0 and pos < len(head) + end:
                    return name
                digest = hashes.update(name, view[:n], end - start)
                pos += n
            if digest != recorded.get(name):
                return name
    finally:
        os.close(fd)
    return None


# ------------------------------------------------------------------------------ finishing


def commit(ws: Workspace, echo: Callable[[str], None]) -> None:
    """Make the finished workspace DST and remove the run state (the manifest is written)."""
    if not ws.replaces:
        _clear_state(ws)
        return
    # The staging directory's own lock file becomes DST's when the two swap: held from before
    # the swap until the run state is gone, so no other run can start into DST in between.
    fd = acquire(ws.state / LOCK_FILE, echo)
    try:
        old = _exchange(ws.root, ws.dst)
        events.emit("output-committed", dst=str(ws.dst))
        shutil.rmtree(old)
        _clear_state(Workspace(ws.dst, ws.dst))
    finally:
        with contextlib.suppress(OSError):
            (ws.dst / STATE_DIR / LOCK_FILE).unlink()
        os.close(fd)


def _clear_state(ws: Workspace) -> None:
    for sub in ("partial", "done", "tmp"):
        shutil.rmtree(ws.state / sub, ignore_errors=True)
    (ws.state / RUN_FILE).unlink(missing_ok=True)


def _remove_leftovers(dst: Path, echo: Callable[[str], None]) -> None:
    """Delete what an interrupted swap left beside DST: a staging directory without run state
    holds the output that was being replaced (the swap had happened)."""
    for path in (_staging(dst), dst.parent / f".{dst.name}.kconvert-old"):
        if path.is_dir() and not (path / STATE_DIR / RUN_FILE).is_file() \
                and _accounted(path) is not None:
            echo(f"removing {path}, the previous output left by an interrupted replacement")
            shutil.rmtree(path)


def _exchange(new: Path, dst: Path) -> Path:
    """Put directory `new` at `dst`; returns where the old `dst` now is. Atomic where the OS
    can swap two names in one step (Linux renameat2); else two renames."""
    at_cwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE
    if _renameat2 is not None and _renameat2(at_cwd, os.fsencode(new), at_cwd,
                                             os.fsencode(dst), exchange) == 0:
        return new
    old = dst.parent / f".{dst.name}.kconvert-old"
    if old.exists():
        shutil.rmtree(old)
    os.replace(dst, old)
    os.replace(new, dst)
    return old


def _load_renameat2():
    """libc's renameat2 (Linux, glibc >= 2.28), which Python's os module does not expose."""
    if not sys.platform.startswith("linux"):
        return None
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
    return fn


_renameat2 = _load_renameat2()
