"""What a kconvert output already in a directory accounts for: the files its manifest or its
interrupted run's state name, and whether they are still what was recorded. `--overwrite`
replaces a directory only when this says every file in it is kconvert's
(kconvert.io.output_dir)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from kconvert.errors import KconvertError
from kconvert.io.files import hash_file
from kconvert.io.lock import STATE_DIR
from kconvert.records.manifest import MANIFEST

RUN_FILE = "run.json"  # under the state folder: what the run writes and what started it


def dir_entries(path: Path) -> list[str]:
    """Names in directory `path` (none if it does not exist)."""
    return sorted(p.name for p in path.iterdir()) if path.is_dir() else []


def accounted_files(root: Path) -> set[str] | None:
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


def check_replaceable(dst: Path) -> None:
    accounted = accounted_files(dst)
    if accounted is None:
        shown = ", ".join(dir_entries(dst)[:5])
        raise KconvertError(f"--overwrite replaces only a kconvert output (a directory with a "
                            f"{MANIFEST} or .kconvert/) or an empty directory; DST holds "
                            f"{shown}{', ...' if len(dir_entries(dst)) > 5 else ''}",
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
