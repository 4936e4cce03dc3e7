"""`reap --data`: the plan of REAP's calibration on the source (saliency scores, with router
repair and compensation in the same pass) for the Prune stage, and what a dry run plans in its
place.

The data is read and checked first (token ids within the vocabulary, --samples x --seq-len
filled), so bad data fails before the model is touched, a dry run included. Compensation's
re-fitted matrices are spilled under DST's state folder (`DST/.kconvert/refit/`: kconvert's own,
on the output's file system, never beside or inside SRC); a spill an interrupted run left there
is removed first, and the stage removes its own when the run ends (an error, Ctrl-C or SIGTERM
included). A dry run calibrates nothing and writes nothing: it plans the first N experts of
every layer (the calibration chooses which) and lists what the run would re-fit or repair.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kconvert.common import distributed
from kconvert.common.options import REAP_SAMPLES, calibration_run
from kconvert.gpu.budget import GpuRequest
from kconvert.io.checkpoint import Checkpoint
from kconvert.io.lock import STATE_DIR
from kconvert.io.output_dir import REFIT_DIR, resolve_dst
from kconvert.model.names import Role, parse_name
from kconvert.pruning.kinds import CompensationKind, RepairKind
from kconvert.pruning.plan import PruneLayer, PrunePlan
from kconvert.pruning.reap import moe_layers, mtp_moe_layers, note_mtp_layers


@dataclass
class FromData:
    """What `reap --data` makes of the opened source for its Prune stage
    (kconvert.stages.prune.prune_stage): the plan, with router repair its repaired rows and
    with compensation its re-fitted matrices (spilled to `spill`), and what of the data it used.
    A dry run's plan keeps the first experts, and `placeholders` stand for what the run would
    repair or re-fit."""

    plan: PrunePlan
    data: dict
    rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    matrices: dict[str, torch.Tensor] = field(default_factory=dict)
    spill: Path | None = None
    placeholders: tuple[tuple[str, torch.Tensor], ...] | None = None


def from_data(ckpt: Checkpoint, options: dict, gpu: GpuRequest, keep: int, criterion: str,
              repair: type[RepairKind], compensate: type[CompensationKind],
              echo: Callable[[str], None]) -> FromData:
    """The plan of `reap --data` (module docstring)."""
    from kconvert.calibrate.data import load_calibration_data, real_tokens, shortfall
    from kconvert.calibrate.startup import phase

    samples, seq_len, batch_size, seed = calibration_run(options, REAP_SAMPLES)
    data = options["data"]
    # (CUDA is starting on a thread since the run began: kconvert.driver.convert)
    with phase("data"):
        ids = load_calibration_data(data, ckpt.root, samples, seq_len, seed,
                                    vocab=ckpt.text_config["vocab_size"],
                                    short=shortfall(bool(options.get("allow_short_data")), echo))
    used = {"sha256": hashlib.sha256(Path(data).read_bytes()).hexdigest(), "seed": seed,
            "samples": ids.shape[0], "seq_len": seq_len, "tokens": real_tokens(ids)}
    if options.get("dry_run"):
        return dry_run(ckpt, keep, repair, compensate, used, echo)
    # Made and removed by rank 0 alone: ranks that each emptied and made it raced (EEXIST, or
    # one rank removing the folder another had just made).
    spill = (distributed.from_main(lambda: spill_directory(options["dst"], echo))
             if compensate.refits else None)
    try:
        return _calibrate(ckpt, ids, options, gpu, keep, criterion, repair, compensate,
                          batch_size, spill, used, echo)
    except BaseException:
        if spill is not None and distributed.is_main():
            shutil.rmtree(spill, ignore_errors=True)
        raise


def _calibrate(ckpt: Checkpoint, ids: torch.Tensor, options: dict, gpu: GpuRequest, keep: int,
               criterion: str, repair: type[RepairKind], compensate: type[CompensationKind],
               batch_size: int,
               spill: Path | None, used: dict, echo: Callable[[str], None]) -> FromData:
    from kconvert.calibrate.plan import planned_forward
    from kconvert.calibrate.run import measure_stats
    from kconvert.calibrate.stats import save_stats
    from kconvert.pruning.compensate_learned import learned_bytes
    from kconvert.pruning.reap import plan_from_scores, scores_of
    from kconvert.pruning.repair import (
        REPAIR_TOKENS,
        RepairSettings,
        RouterRepair,
        stream_bytes,
        with_repair,
    )

    refit = repair.fits or compensate.refits
    text = ckpt.text_config
    stream = (stream_bytes(text["hidden_size"], torch.bfloat16.itemsize, ids.numel())
              if refit else 0)
    if compensate.trains:
        stream += learned_bytes(text, min(REPAIR_TOKENS, ids.numel()), keep)
    fixer = None
    with planned_forward(gpu, ckpt, ids.shape, batch_size, torch.bfloat16,
                         "REAP's calibration", repair_bytes=stream) as memory:
        if refit:
            fixer = RouterRepair(
                ckpt, ids, RepairSettings(repair.declaration.name, keep, criterion,
                                          compensate=compensate.declaration.name),
                gpu.device, batch_size=batch_size if memory is None else memory.batch_size,
                spill=spill)
        measured = measure_stats(ckpt, ids, gpu.device, batch_size, on_weights=fixer,
                                 gpu_plan=memory)
        if fixer is not None:
            share_repair(fixer)
    if options.get("save_stats"):
        save_stats(measured, options["save_stats"])
    scores = scores_of(measured)
    made = plan_from_scores(scores, keep, criterion, ckpt.identity,
                            mtp_moe_layers(ckpt))
    note_unrouted(made, scores, echo)
    if fixer is None:
        note_mtp_layers(made, echo)
        return FromData(made, used)
    repaired = with_repair(made, fixer)
    note_mtp_layers(repaired, echo)
    return FromData(repaired, used, fixer.rows, fixer.matrices, spill)


def share_repair(fixer) -> None:
    """Under torchrun, rank 0's repair (the repair stream runs there alone,
    kconvert.calibrate.run.measure_stats) on every rank: its rows and records in a broadcast,
    its re-fitted matrices through rank 0's spill files (in DST's state folder, on a file
    system every rank sees), memory-mapped, or in the broadcast where nothing was spilled."""
    if distributed.world() == 1:
        return
    spilled = fixer.spill is not None
    sent = distributed.broadcast_object(
        (fixer.rows, fixer.kept, fixer.records, fixer.compensations,
         sorted(str(f) for f in fixer.spill.glob("layer-*.pt")) if spilled else fixer.matrices)
        if distributed.is_main() else None)
    if distributed.is_main():
        return
    fixer.rows, fixer.kept, fixer.records, fixer.compensations, matrices = sent
    if not spilled:
        fixer.matrices = matrices
        return
    for path in matrices:
        fixer.matrices.update(torch.load(path, mmap=True, weights_only=True))


def note_unrouted(plan: PrunePlan, scores: dict[int, dict[str, torch.Tensor]],
                  echo: Callable[[str], None]) -> None:
    """Say so when a layer keeps experts no calibration token was routed to: every score of
    theirs is 0, so the lower-id rule chose them, not the data."""
    unrouted = {layer: [e for e in entry.keep if float(scores[int(layer)]["count"][e]) == 0]
                for layer, entry in plan.layers.items() if int(layer) in scores}
    unrouted = {layer: ids for layer, ids in unrouted.items() if ids}
    if not unrouted:
        return
    shown = "; ".join(f"layer {layer}: {', '.join(map(str, ids))}"
                      for layer, ids in list(unrouted.items())[:4])
    more = f"; and {len(unrouted) - 4} more layers" if len(unrouted) > 4 else ""
    echo(f"kconvert: warning: {sum(map(len, unrouted.values()))} kept expert(s) in "
         f"{len(unrouted)} layer(s) were never routed a calibration token, so they were kept "
         f"by the lower-id rule among equal (zero) scores, not by the data ({shown}{more}); "
         "more or broader --data ranks them")


def spill_directory(dst: str, echo: Callable[[str], None]) -> Path:
    """Where compensation spills its re-fitted matrices: DST's state folder (module
    docstring), emptied of what an interrupted run left there."""
    spill = resolve_dst(Path(dst)) / STATE_DIR / REFIT_DIR
    if spill.exists():
        echo(f"removing the re-fitted matrices an interrupted run left in {spill}")
        shutil.rmtree(spill)
    spill.mkdir(parents=True)
    return spill


def dry_run(ckpt: Checkpoint, keep: int, repair: type[RepairKind],
            compensate: type[CompensationKind], used: dict, echo: Callable[[str], None]
            ) -> FromData:
    """What a dry run of `reap --data` plans: the first `keep` experts of every MoE layer (the
    calibration would choose them; the output's sizes are the same), and placeholders of the
    source rows and matrices the run would repair or re-fit, of their shape on the meta device
    (nothing is computed), so the plan lists them as such."""
    layers = moe_layers(ckpt)
    plan = PrunePlan(criterion=None, routing="model", source=ckpt.identity,
                     layers={str(layer): PruneLayer(keep=list(range(keep))) for layer in layers})
    echo(f"dry run: the calibration on --data chooses which {keep} experts each layer keeps; "
         f"the plan below keeps the first {keep} (the sizes are the same)")
    placeholders = []
    for name, info in ckpt.tensors.items():
        tn = parse_name(name)
        if tn.layer not in layers:
            continue
        routed = tn.role is Role.ROUTED_EXPERT and tn.expert is not None and tn.expert < keep
        refit = (routed or tn.role is Role.SHARED_EXPERT) and compensate.rewrites(
            tn.proj, tn.role is Role.SHARED_EXPERT)
        rows = repair.fits and tn.role in (Role.ROUTER_WEIGHT, Role.ROUTER_BIAS)
        if refit or rows:
            shape = (keep, *info.shape[1:]) if rows else info.shape
            placeholders.append((name, torch.empty(shape, dtype=info.torch_dtype,
                                                   device="meta")))
    return FromData(plan, used, placeholders=tuple(sorted(placeholders)))
