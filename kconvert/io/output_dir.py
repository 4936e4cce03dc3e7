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

This module checks DST and prepares the workspace; what an output already in DST accounts for is
kconvert.io.existing_output, the workspace and the final swap kconvert.io.workspace.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kconvert.errors import KconvertError
from kconvert.io.directories import overlaps
from kconvert.io.existing_output import (
    RUN_FILE,
    accounted_files,
    check_replaceable,
    dir_entries,
)
from kconvert.io.files import human_bytes, write_json
from kconvert.io.hashing import TensorHashes
from kconvert.io.lock import LOCK_FILE, STATE_DIR, holder_of, in_use, unwritable
from kconvert.io.shards import plan_header, read_header
from kconvert.io.workspace import Workspace, remove_leftovers, staging_dir
from kconvert.records.manifest import MANIFEST

# Under the state folder: where REAP's compensation spills re-fitted matrices during its
# calibration (kconvert.stages.prune_data), removed when the run ends.
REFIT_DIR = "refit"
# Room kept free beyond the planned bytes (file system metadata, rounding to blocks): this
# much plus a thousandth of the output.
SPACE_MARGIN = 1 << 20
VERIFY_CHUNK = 16 << 20

ShardEntries = dict[str, list[tuple[str, str, tuple[int, ...]]]]


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
    if dir_entries(dst) and not (resume or overwrite):
        raise KconvertError("DST is not empty; pass --resume to continue an interrupted run "
                            "or --overwrite to replace it", file=str(dst))
    if overwrite and dir_entries(dst):
        check_replaceable(dst)


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
    remove_leftovers(dst, echo)
    ws, done = Workspace(dst, dst), {}
    if resume:
        ws, done = _resumed(dst, fingerprint, planned, trust_complete, shard_entries, echo)
    elif overwrite and dir_entries(dst) != [STATE_DIR]:
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
    staging = staging_dir(dst)
    if (staging / STATE_DIR / RUN_FILE).is_file():
        ws = Workspace(dst, staging, replaces=True)
        echo(f"resuming the replacement of {dst} in {staging}")
    elif (dst / STATE_DIR / RUN_FILE).is_file():
        ws = Workspace(dst, dst)
    elif (dst / MANIFEST).is_file():
        raise KconvertError("DST is already a complete output (it has a manifest); use "
                            "--overwrite to redo it", file=str(dst))
    elif [n for n in dir_entries(dst) if n != STATE_DIR]:
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
    staging = staging_dir(dst)
    if staging.exists():
        if accounted_files(staging) is None:
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
