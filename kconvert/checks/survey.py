"""Opening a checkpoint as `kconvert audit` does: the same files a conversion opens
(kconvert.io.checkpoint), read the same way, but every inconsistency is a "structure" finding
and the audit goes on with what is readable."""

from __future__ import annotations

from pathlib import Path

from kconvert.checks.findings import Checks
from kconvert.errors import KconvertError
from kconvert.io.checkpoint import (
    CONFIG,
    INDEX,
    SINGLE,
    Checkpoint,
    architecture_problem,
    parse_config,
    parse_index,
)
from kconvert.io.shards import ShardReader


def survey_checkpoint(root: Path, checks: Checks) -> Checkpoint | None:
    """Open the checkpoint in directory `root` as `kconvert audit` does: every inconsistency
    (config, index, shard headers, index vs shards) is a "structure" finding, and the
    checkpoint holds the tensors where the shards really have them (the index's word is not
    taken). None when no tensor can be located (no index and no single file, or an index
    that cannot be read)."""
    S = "structure"
    config = {}
    if checks.check(S, (root / CONFIG).is_file(), "config", "no config.json", file=CONFIG):
        config, problem = parse_config(root / CONFIG)
        if problem is None:
            problem = architecture_problem(config)
        if problem is not None:
            checks.add(S, "config", problem, file=CONFIG)
    index = None
    if (root / INDEX).is_file():
        index, problem = parse_index(root / INDEX)
        if problem is not None:
            checks.add(S, "index", problem, file=INDEX)
            return None
        checks.ran(S)
        files = sorted(set(index["weight_map"].values()))
    elif (root / SINGLE).is_file():
        files = [SINGLE]
    else:
        checks.add(S, "index", f"no {INDEX} and no {SINGLE}", file=str(root))
        return None

    ckpt = Checkpoint(root, {"path": str(root)}, config, {}, index is not None, index=index)
    holders: dict[str, list[str]] = {}
    for fn in files:
        if not checks.check(S, (root / fn).is_file(), "index", "the index names a shard that "
                            "does not exist", file=fn):
            continue
        try:
            ckpt.readers[fn] = ShardReader(root / fn)
        except KconvertError as exc:
            checks.add(S, "shard-header", str(exc), file=fn)
            continue
        checks.ran(S)
        for name in ckpt.readers[fn].tensors:
            holders.setdefault(name, []).append(fn)
    for name, fns in holders.items():
        checks.check(S, len(fns) == 1, "duplicate", f"tensor is stored in {len(fns)} shards: "
                     f"{fns}", tensor=name)
    ckpt.weight_map = {name: fns[0] for name, fns in holders.items()}
    if index is not None:
        _survey_index(ckpt, index["weight_map"], holders, checks)
    return ckpt


def _survey_index(ckpt: Checkpoint, weight_map: dict[str, str], holders: dict[str, list[str]],
                  checks: Checks) -> None:
    """The index against what the readable shards hold."""
    S = "structure"
    for name, fn in sorted(weight_map.items()):
        if fn not in ckpt.readers:
            continue  # already reported: shard missing or unreadable
        held = holders.get(name, [])
        if fn in held:
            checks.ran(S)
        elif held:
            checks.add(S, "index", f"stale index entry: the index maps it to {fn} but it is in "
                       f"{held[0]}", tensor=name, file=fn)
        else:
            checks.add(S, "index", f"stale index entry: the index maps it to {fn}, which does "
                       "not hold it (tensor missing from its shard)", tensor=name, file=fn)
    for name, fns in sorted(holders.items()):
        if name not in weight_map:
            checks.add(S, "index", f"shard {fns[0]} holds a tensor the index does not list",
                       tensor=name, file=fns[0])
    total = (ckpt.index.get("metadata") or {}).get("total_size")
    actual = sum(i.nbytes for i in ckpt.tensors.values())
    if total is not None and total != actual:
        checks.warn(S, "index", f"metadata.total_size is {total} but the tensors hold {actual} "
                    "bytes", file=INDEX)
    indexed = set(weight_map.values())
    for path in sorted(ckpt.root.glob("*.safetensors")):
        if path.name not in ckpt.readers and path.name not in indexed:
            checks.warn(S, "index", "shard file not referenced by the index (loaders ignore "
                        "it)", file=path.name)
