"""One conversion run, start to finish: checks, plan, execute, then the files that say "done".

Every input check and the whole plan (kconvert.driver.run_plan) come before anything in DST is
touched (kconvert.io.output_dir says what may be replaced and how). Order of writes, so that an
interrupted run is never mistaken for a complete one: shards (each renamed into place when
complete) -> non-weight files -> index -> config.json (+ hf_quant_config.json, stage files) ->
kconvert-manifest.json (kconvert.driver.finish_output). `.kconvert/` holds the lock and the resume
state until the manifest is written.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kconvert.calibrate.startup import start_device
from kconvert.common import distributed, events
from kconvert.common.options import STREAM_WINDOW
from kconvert.driver.dry_run import print_dry_run
from kconvert.driver.finish_output import finish_output
from kconvert.driver.recipes import Recipe
from kconvert.driver.run_plan import plan_run
from kconvert.driver.run_summary import learned_warning
from kconvert.engine.execute import execute
from kconvert.engine.sink import finish_parts
from kconvert.engine.source_order import hub_disk, start_stream
from kconvert.engine.stage import Stage
from kconvert.engine.work import Share, WorkPlan, shard_file_bytes, share_work
from kconvert.errors import KconvertError, UsageError
from kconvert.formats import Int4Codec, warm_cpu_kernels
from kconvert.gpu.budget import GpuContext, GpuRequest
from kconvert.gpu.devices import pick_device
from kconvert.gpu.plan import gib
from kconvert.io import lock, output_dir, workspace
from kconvert.io.checkpoint import GENERATED_FILES, Checkpoint, is_repo_id, open_checkpoint
from kconvert.io.files import hash_file
from kconvert.io.output_dir import Planned
from kconvert.io.remote import open_headers
from kconvert.io.stream import SOURCE_DIR, ShardStream, StreamedShard, open_streamed
from kconvert.io.workspace import Workspace
from kconvert.model.arch import arch_of
from kconvert.records.manifest import Manifest
from kconvert.stages.records import RunRecord
from kconvert.version import __version__

# What the OS says when a write runs out of room, and when it refuses to write at all.
NO_SPACE = {errno.ENOSPC, errno.EDQUOT}
log = logging.getLogger(__name__)
NOT_WRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM}


@dataclass(frozen=True)
class RunControl:
    """Options that change how a run goes, never what it writes. `device` is resolved here
    (`--device auto | cpu | cuda | cuda:N` -> the torch device, or a clear error); everything
    past this boundary gets a torch.device. `gpu_memory` is --gpu-memory in bytes, read where
    the command takes it (kconvert.gpu.budget.size_option); with `device` it is the run's
    GpuRequest, resolved once per run."""

    device: torch.device | str = "auto"
    resume: bool = False
    overwrite: bool = False
    dry_run: bool = False
    quiet: bool = False
    readers: int = 4
    trust_complete: bool = False  # --resume keeps finished shards without re-hashing them
    token: str | None = None  # Hugging Face token when SRC is a repo id
    cache_dir: str | None = None  # Hugging Face cache [default: huggingface_hub's]
    stream: bool = False  # a repo id's shards fetched during the run (kconvert.io.stream)
    stream_window: int = STREAM_WINDOW  # with `stream`: shards on disk at once
    gpu_memory: int | None = None  # GPU memory budget [default: the card's free less a margin]

    def __post_init__(self) -> None:
        if not isinstance(self.device, torch.device):
            object.__setattr__(self, "device", pick_device(self.device))


def _fingerprint(ckpt: Checkpoint, command: str, options: dict) -> tuple[str, dict]:
    """Identifies what a run writes: same source layout + same command/options -> same bytes.
    Returns the digest and what it is made of (a resume that does not match says which part
    differs)."""
    layout = sorted((n, i.dtype, list(i.shape), i.file.name) for n, i in ckpt.tensors.items())
    blob = json.dumps([__version__, command, options, ckpt.identity, layout], sort_keys=True)
    parts = {"kconvert": __version__, "command": command, "options": options,
             "source": ckpt.identity, "source tensor layout": hashlib.sha256(
                 json.dumps(layout).encode()).hexdigest()}
    return hashlib.sha256(blob.encode()).hexdigest(), parts


def _stats_hash(stages: list[Stage]) -> str | None:
    paths = [p for s in stages for p in s.input_files()]
    return hash_file(Path(paths[0])) if paths else None


def convert(src: str, dst: str, recipe: Recipe, settings: Mapping[str, object],
            run: RunControl, revision: str | None = None, echo=print,
            prepare: Callable[[Checkpoint], Mapping[str, object]] | None = None,
            gpu: GpuRequest | None = None, forward: bool = False) -> Manifest | None:
    """Run `recipe` on SRC into DST; non-None `settings` (by name) override its stages'.

    `prepare(ckpt)` returns, by stage kind, the inputs that need the opened source (see
    StageKind.input_type), e.g. {"prune": the Prune stage of a plan checked against it}.
    `gpu`: the run's GpuRequest, which `prepare` shares (commands.run_conversion); default:
    `run`'s device and --gpu-memory. `forward`: the run streams calibration data through
    the model's layers (--data), which the source's family must support.
    """
    request = gpu if gpu is not None else GpuRequest(run.device, run.gpu_memory)
    if not run.dry_run:
        start_device(request.device)  # CUDA starts while SRC opens and the stages prepare
    with events.span("phase", name="open_source"):
        ckpt = open_source(src, revision, run)
    log.info("opened %s: %d shard(s), %d tensors, recipe %s", ckpt.root, len(ckpt.shards),
             len(ckpt.weight_map), recipe.name)
    if "repo" in ckpt.identity and distributed.is_main():
        echo(f"{src}@{ckpt.identity['revision']}: files in {ckpt.root}")
    main = distributed.is_main()
    try:
        # What the source's family cannot do is refused before DST is touched.
        unsupported = arch_of(ckpt.text_config).unsupported_forward() if forward else None
        if unsupported is not None:
            raise KconvertError(unsupported, file=str(ckpt.root / "config.json"))
        # DST is checked, and its lock taken, before any work: a calibration never runs for a
        # DST that would be refused, nor beside another run into it.
        distributed.from_main(lambda: output_dir.check_dst(ckpt.root, Path(dst), run.resume,
                                                           run.overwrite, run.dry_run))
        target = output_dir.resolve_dst(Path(dst))
        with contextlib.ExitStack() as held:
            if main and not run.dry_run:
                held.enter_context(lock.locked(target, echo))
            # What a stage prepares on the GPU (REAP's calibration) resolves the run's budget
            # once its data and imports are loaded (calibrate.plan), and plans and caps itself
            # within it; the conversion after it takes the same GpuContext. A prepared stage
            # (REAP's, with its spill under DST's state folder) is closed however the run ends.
            with events.span("phase", name="prepare"):
                inputs = prepare(ckpt) if prepare is not None else {}
            for made in inputs.values():
                if isinstance(made, Stage):
                    held.callback(made.close)
            context = request.context
            # a stage that prepared calibration inputs runs forward batches beside the
            # conversion
            with context.enforced(recipe.name, "--batch-size --samples" if inputs else ""):
                return _convert(ckpt, target, recipe, settings, inputs, run, context, echo)
    finally:
        ckpt.close()


def open_source(src: str, revision: str | None, run: RunControl) -> Checkpoint:
    """SRC as a conversion opens it; a dry run on a Hub repo id fetches config.json, the index
    and each shard's header only, a streamed run the non-weight files too."""
    if run.stream and not is_repo_id(src):
        raise UsageError(f"--stream fetches the shards of a Hub repo id during the run, and "
                         f"{src} is not one (a local directory is read where it is)")
    if run.stream and run.stream_window < 1:
        raise UsageError(f"--stream-window {run.stream_window}: give 1 or more shards")
    if run.stream and distributed.world() > 1:
        raise UsageError("--stream does not run across ranks: run it without torchrun")
    if run.dry_run and is_repo_id(src):
        return open_headers(src, revision, token=run.token, cache_dir=run.cache_dir)
    if run.stream:
        return open_streamed(src, revision, token=run.token, cache_dir=run.cache_dir)
    return open_checkpoint(src, revision, token=run.token, cache_dir=run.cache_dir)


def _convert(ckpt: Checkpoint, dst: Path, recipe: Recipe, settings: Mapping[str, object],
             inputs: Mapping[str, object], run: RunControl, context: GpuContext, echo
             ) -> Manifest | None:
    main = distributed.is_main()
    say = echo if main else (lambda _message: None)
    stages, plan, gpu, part = distributed.agree(lambda: plan_run(
        ckpt, recipe, settings, inputs, run.dry_run, context, say))
    device = context.device
    if run.dry_run:
        if main:
            print_dry_run(plan, echo)
            for line in gpu.lines(recipe.name) if gpu is not None else ():
                echo(line)
            if device.type != "cuda" and gpu is not None:
                echo(f"(planned for a {gib(gpu.budget)} budget: --gpu-memory, else an 80 GB "
                     "H100's default; this run's device has no GPU)")
            disk = hub_disk(plan, run.stream_window, run.token)
            for line in disk.lines() if disk is not None else []:
                echo(line)
        return None

    # The manifest's options: a RunRecord, typed, so the audit can read it.
    recorded = RunRecord(recipe=recipe.name, **{s.name: s.record() for s in stages}).model_dump(
        mode="json", exclude_unset=True)
    fingerprint, started_by = _fingerprint(ckpt, recipe.name,
                                           {**recorded, "act_stats": _stats_hash(stages)})
    planned = _planned(ckpt, plan, run)
    ws: Workspace | None = None
    try:
        # Rank 0 holds DST's lock (taken by `convert`) and prepares DST; every rank then writes
        # its share of shards (all of them in a one-process run) and rank 0 writes the files
        # that say "done".
        ws, done = distributed.from_main(lambda: output_dir.prepare(
            dst, planned, (fingerprint, started_by), run.resume, run.overwrite,
            run.trust_complete, plan.shard_entries, echo))
        share = (share_work(plan, set(done), distributed.world(), part)[distributed.rank()]
                 if distributed.world() > 1 else None)
        stream = start_stream(plan, done, ws.state / SOURCE_DIR, run.stream_window, say)

        def step() -> tuple[dict[str, dict], dict[str, dict]]:
            try:
                return _execute(plan, ws, device, done, run, recipe.name, share, stream)
            finally:  # before the ranks' next collective: a stage's may still run
                for stage in stages:
                    stage.close()

        mine, parts = distributed.agree(step)
        if stream is not None:
            stream.finish()
        records = {s: r for got in distributed.all_gather_object(mine) for s, r in got.items()}
        if share is not None:
            records.update(_finish_shared(ws, share, parts))
        manifest = distributed.agree(lambda: finish_output(
            ckpt, ws, plan, records, recipe.name, recorded) if main else None)
        if main:
            workspace.commit(ws, echo)
            if (warning := learned_warning(manifest, ckpt.text_config)) is not None:
                echo(warning)
            events.emit("run-finished", dst=str(dst))
    except OSError as exc:
        if exc.errno in NO_SPACE:
            left = sum(n for s, n in planned.shard_bytes.items()
                       if ws is None or not (ws.state / "done" / f"{s}.json").is_file())
            raise output_dir.disk_full(ws.root if ws else dst, left + planned.other_bytes,
                                       exc) from exc
        if exc.errno in NOT_WRITABLE:
            raise lock.unwritable(Path(exc.filename or dst), exc) from exc
        raise
    except BaseException:
        if ws is not None and ws.replaces:
            say(f"the previous output in {dst} is unchanged; the unfinished new one is in "
                f"{ws.root} (--resume continues it, --overwrite starts again)")
        raise
    return manifest


def _finish_shared(ws: Workspace, share: Share, parts: dict[str, dict]) -> dict[str, dict]:
    """Every rank's records of its parts of the shards several ranks wrote into (all written
    and on disk: each rank's engine ended without error); each such shard finished by its
    owner. Returns every finished shard's record, on every rank."""
    gathered = distributed.all_gather_object(parts)

    def finish() -> dict[str, dict]:
        out = {}
        for shard in sorted(share.owned & share.shared):
            have = [got[shard] for got in gathered if shard in got]
            out[shard] = finish_parts(ws.root, shard, have, len(share.writers[shard]))
        return out

    return {s: r for got in distributed.all_gather_object(distributed.agree(finish))
            for s, r in got.items()}


def _planned(ckpt: Checkpoint, plan: WorkPlan, run: RunControl) -> Planned:
    """Names and sizes of everything the run will write (a streamed run: its downloads too)."""
    shard_bytes = shard_file_bytes(plan)
    others = ckpt.other_files()
    files = sorted({*shard_bytes, *others, *GENERATED_FILES,
                    *(n for s in plan.stages for n in s.output_files())})
    other_bytes = sum((ckpt.root / rel).stat().st_size for rel in others) + (1 << 20)
    if any(isinstance(r, StreamedShard) for r in ckpt.readers.values()):
        other_bytes += hub_disk(plan, run.stream_window, run.token).window_bytes
    return Planned(tuple(files), shard_bytes, other_bytes)


def _execute(plan: WorkPlan, ws: Workspace, device: torch.device, done: dict[str, dict],
             run: RunControl, name: str, share: Share | None,
             stream: ShardStream | None) -> tuple[dict[str, dict], dict[str, dict]]:
    """This rank's items (all of them in a one-process run) -> (the records of the shards
    finished here, this rank's records of its parts of shards shared with other ranks); rank
    0 shows the progress of its own share, which balancing keeps near each other rank's."""
    total = sum(item.nbytes for i, item in enumerate(plan.items)
                if share is None or i in share.items)
    if distributed.world() > 1:
        name = f"{name} (rank 0 of {distributed.world()})"
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
              disable=run.quiet or not distributed.is_main(), desc=name, smoothing=0.1) as bar:
        encodes = [m for m in plan.modules
                   if m.out_codec is not None and m.out_codec.quantized and not m.repack]
        if device.type == "cpu" and encodes:
            bar.set_description("loading CPU kernels (the first run after installing compiles "
                                "them: 10-50 s by the cores)")
            # INT4 read as stored (compute's packed path) needs only the INT4 encoder
            int4 = sum(m.transform is None and issubclass(m.codec, Int4Codec)
                       and m.out_codec.reads_packed(m.codec, device) for m in encodes)
            warm_cpu_kernels(float_rows=int4 < len(encodes), int4_rows=int4 > 0)
            bar.set_description(name)
        return execute(plan, ws.root, device, done, bar.update, readers=run.readers,
                       share=share, feed=stream)
