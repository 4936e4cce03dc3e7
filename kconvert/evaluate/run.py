"""One eval pass: the source and every candidate streamed layer by layer over the same tokens,
and the `kconvert eval` command behind the CLI."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kconvert.calibrate.data import PAD_ID, load_calibration_data, shortfall
from kconvert.calibrate.forward import (
    embed,
    layer_forward,
    load_head,
    model_config,
    position_embeddings,
)
from kconvert.calibrate.load import nonfinite_hidden_error, read_layer, tensors_by_layer
from kconvert.calibrate.moe import ForwardContext
from kconvert.calibrate.plan import planned_forward
from kconvert.calibrate.prefetch import LayerPrefetcher
from kconvert.calibrate.startup import device_ready, phase, start_device
from kconvert.common import distributed
from kconvert.errors import KconvertError
from kconvert.evaluate import activations
from kconvert.evaluate.generation import render
from kconvert.evaluate.metrics import (
    LOGIT_ELEMS,
    LayerErrors,
    LogitsComparison,
    compare_logits,
    in_batch_order,
)
from kconvert.evaluate.outputs import open_model, refuse_earlier_report
from kconvert.evaluate.probe import Probe, check_probe_fits, run_probe
from kconvert.evaluate.report import (
    ActivationBlocks,
    CandidateResult,
    EvalReport,
    render_table,
    save_report,
)
from kconvert.gpu.budget import GpuRequest
from kconvert.gpu.devices import pick_device
from kconvert.gpu.plan import GpuPlan, gib
from kconvert.io.checkpoint import Checkpoint
from kconvert.version import __version__

# Model dimensions a candidate must share with its source to be compared at all.
SAME_DIMS = ("hidden_size", "vocab_size", "num_hidden_layers")


@dataclass
class Stream:
    """One model under evaluation and its hidden states after the layers run so far."""

    label: str
    ckpt: Checkpoint
    cfg: Any  # transformers' DeepseekV3Config
    layers: dict  # decoder layer -> its tensors
    hidden: torch.Tensor  # [num_seqs, seq_len, hidden]
    rope: tuple  # (positions, (cos, sin))


def evaluate(source: Checkpoint, candidates: list[Checkpoint], input_ids: torch.Tensor,
             device: str | torch.device = "cpu", batch_size: int = 8, *,
             dtype: torch.dtype = torch.bfloat16, labels: list[str] | None = None,
             quiet: bool = True, meta: dict | None = None, gpu_plan: GpuPlan | None = None
             ) -> EvalReport:
    """Compare every candidate with the source on `input_ids` [num_seqs, seq_len] (PAD_ID:
    padding, never measured). One decoder layer of one checkpoint is loaded at a time: the
    source's layer L runs on its stream, then each candidate's layer L runs on the candidate's
    own stream (accumulated error) and on the source's input to L (local error). `device`: a
    torch device or --device's spec (kconvert.gpu.devices.pick_device). Hidden states stay on the
    device where `gpu_plan` (the command's plan, kconvert.calibrate.plan; a GPU needs one)
    puts them, else in pinned host memory, and stream through the device `batch_size`
    sequences at a time (fewer where the plan lowers it).

    Under torchrun the batches are dealt to the ranks (batch b to rank b % world,
    distributed.own_batches), each rank streams its own through every layer with no collective
    on the way, and the metrics, kept per batch, are joined and folded in batch order on every
    rank (kconvert.evaluate.metrics): the report is the one-process run's, bit for bit, but for
    its timings. An error on any rank (a non-finite layer) stops every rank with it."""
    device = device if isinstance(device, torch.device) else pick_device(device)
    if input_ids.dim() != 2 or input_ids.dtype != torch.long or not input_ids.numel():
        raise KconvertError("input_ids must be a non-empty LongTensor [num_seqs, seq_len]")
    if not candidates:
        raise KconvertError("no candidate to evaluate")
    if batch_size < 1:
        raise KconvertError(f"batch size {batch_size} must be positive")
    labels = labels or [str(c.root) for c in candidates]
    valid = input_ids != PAD_ID
    targets = torch.cat([input_ids[:, 1:], torch.full_like(input_ids[:, :1], PAD_ID)], dim=1)
    scored = valid & (targets != PAD_ID)
    if not bool(scored.any()):
        raise KconvertError("the data has no position with a next token to score")
    t0 = time.perf_counter()
    names = ["source", *labels]
    models = [source, *candidates]
    # Dimensions first: a candidate of another vocabulary would otherwise fail in its
    # embedding, on token ids that are not the problem.
    with phase("model code"):
        cfgs = [_config(label, ckpt) for label, ckpt in zip(names, models, strict=True)]
    for label, ckpt, cfg in zip(labels, candidates, cfgs[1:], strict=True):
        for key in SAME_DIMS:
            if getattr(cfg, key) != getattr(cfgs[0], key):
                raise KconvertError(f"candidate {_named(label, ckpt)}: {key} is "
                                    f"{getattr(cfg, key)} but the source's is "
                                    f"{getattr(cfgs[0], key)}; only models of the same "
                                    "architecture can be compared",
                                    file=str(ckpt.root / "config.json"))
    device_ready(device)  # after the imports, which the CUDA start overlaps
    if device.type == "cuda":
        if gpu_plan is None:
            raise KconvertError("an eval on a GPU runs within the command's GPU memory plan: "
                                "give gpu_plan (kconvert.calibrate.plan.forward_plan)")
        # every rank deals the batches alike: the smallest micro-batch any rank's plan allows
        batch_size = min(batch_size, *distributed.all_gather_object(gpu_plan.batch_size))
    mine = distributed.own_batches(input_ids.shape[0], batch_size)
    part = distributed.agree(lambda: _measure(
        list(zip(names, models, cfgs, strict=True)), input_ids[mine], valid[mine],
        targets[mine], scored[mine], _local_batches(input_ids.shape[0], batch_size), device,
        dtype, gpu_plan, quiet))
    parts = distributed.all_gather_object(part)
    errors = [e.merge(other.errors[i] for other in parts[1:])
              for i, e in enumerate(parts[0].errors)]
    results = [r.merge(other.results[i] for other in parts[1:])
               for i, r in enumerate(parts[0].results)]
    nll = {b: v for p in parts for b, v in p.nll_source.items()}
    blocks = [tuple(map(sum, zip(*(p.clamps[i] for p in parts), strict=True)))
              for i in range(len(candidates))]
    n_scored = int(scored.sum())
    nll_source = in_batch_order(nll) / n_scored
    report = EvalReport(
        producer=f"kconvert {__version__}", source=str(source.root),
        source_identity=source.identity, data=None, samples=input_ids.shape[0],
        seq_len=input_ids.shape[1], tokens=int(valid.sum()), scored_tokens=n_scored,
        dtype=str(dtype).removeprefix("torch."), device=str(device),
        seconds=round(time.perf_counter() - t0, 3), layer_seconds=part.layer_seconds,
        timing=part.timing,
        candidates=[CandidateResult(candidate=label, identity=ckpt.identity,
                                    n_routed_experts=cfg.n_routed_experts,
                                    logits=r.result(nll_source, n_scored), layers=e.result(),
                                    activation_blocks=ActivationBlocks.of(
                                        *counted, activations.declared_policy(ckpt)))
                    for label, ckpt, cfg, r, e, counted in zip(
                        labels, candidates, cfgs[1:], results, errors, blocks, strict=True)])
    return report.model_copy(update=meta or {})


@dataclass
class _Part:
    """What one rank measured over its batches (all of them in a one-process run)."""

    errors: list[LayerErrors]  # per candidate
    results: list[LogitsComparison]  # per candidate
    clamps: list[tuple[int, int]]  # per candidate: NVFP4 activation blocks, those clamped
    nll_source: dict[int, list[float]]  # batch -> its chunks' NLL sums of the source
    layer_seconds: list[float]
    timing: dict


def _local_batches(n_seq: int, batch_size: int) -> list[tuple[int, slice]]:
    """(batch index in the whole run, its rows among this rank's sequences) of each batch this
    rank runs (distributed.own_batches' order)."""
    out, start = [], 0
    for b in distributed.own_batch_ids(-(-n_seq // batch_size)):
        rows = min(batch_size, n_seq - b * batch_size)
        out.append((b, slice(start, start + rows)))
        start += rows
    return out


def _measure(models: list[tuple[str, Checkpoint, Any]], input_ids: torch.Tensor,
             valid: torch.Tensor, targets: torch.Tensor, scored: torch.Tensor,
             batches: list[tuple[int, slice]], device: torch.device, dtype: torch.dtype,
             gpu_plan: GpuPlan | None, quiet: bool) -> _Part:
    """`evaluate`'s layer-streamed pass over this rank's sequences (`batches`: each one's
    index in the whole run and its rows here)."""
    from tqdm import tqdm

    n_cands = len(models) - 1
    if not batches:  # more ranks than batches: nothing to run here
        return _Part([LayerErrors() for _ in range(n_cands)],
                     [LogitsComparison() for _ in range(n_cands)], [(0, 0)] * n_cands, {}, [],
                     {})
    where = device if gpu_plan is None or gpu_plan.hidden_on_device else torch.device("cpu")
    with phase("embedding"):
        streams = [_stream(label, ckpt, cfg, input_ids, valid, device, dtype, where)
                   for label, ckpt, cfg in models]
    src, cands = streams[0], streams[1:]
    src_out = torch.empty_like(src.hidden)
    valid_dev = valid.to(device)
    errors = [LayerErrors() for _ in cands]
    # per model (None: the source), its NVFP4 activation blocks on its own stream
    clamps = [None, *(activations.BlockClamps() for _ in cands)]
    ctx = ForwardContext()
    n_layers = src.cfg.num_hidden_layers
    layer_seconds = []
    prefetcher = LayerPrefetcher(
        read=lambda job: _labelled(streams[job[0]], read_layer, streams[job[0]].ckpt,
                                   streams[job[0]].cfg, job[1],
                                   streams[job[0]].layers[job[1]], dtype, device),
        build=lambda job, raw: _labelled(streams[job[0]], _build, streams[job[0]], job[1], raw,
                                         ctx, device, dtype, clamps[job[0]]),
        device=device, device_bytes=None if gpu_plan is None else gpu_plan.prefetch_bytes)
    # Source layer L, then each candidate's layer L: the next one read while one computes.
    jobs = [(i, layer) for layer in range(n_layers) for i in range(len(streams))]
    t_layer = time.perf_counter()
    # The bar is closed however the pass ends: its line is ended before an error is printed.
    with torch.no_grad(), tqdm(total=n_layers + 1, desc="eval", unit="layer",
                               disable=quiet or not distributed.is_main()) as bar:
        for (i, layer), loaded, timing in prefetcher.layers(
                jobs, lambda job: f"{streams[job[0]].label} layer {job[1]}"):
            t_loaded = time.perf_counter()
            finite = torch.ones((), dtype=torch.bool, device=device)
            if i == 0:
                for _, rows in batches:
                    v = valid_dev[rows]
                    out = layer_forward(loaded, ctx, src.hidden[rows].to(device), v, *src.rope)
                    finite &= _finite(out, v)
                    src_out[rows].copy_(out)
            else:
                cand, err, counted = streams[i], errors[i - 1], clamps[i]
                for b, rows in batches:
                    v = valid_dev[rows]
                    counted.counting = False  # the source's input: not the candidate's own
                    local = layer_forward(loaded, ctx, src.hidden[rows].to(device), v,
                                          *cand.rope)
                    counted.counting = True
                    own = layer_forward(loaded, ctx, cand.hidden[rows].to(device), v,
                                        *cand.rope)
                    finite &= _finite(own, v)
                    err.add(layer, b, src_out[rows].to(device)[v], own[v], local[v])
                    cand.hidden[rows].copy_(own)
            if not bool(finite):
                stream = streams[i]
                exc = nonfinite_hidden_error(stream.ckpt, stream.layers[layer], layer)
                raise KconvertError(f"{_model(i, stream.label, stream.ckpt)}: {exc}") from None
            if device.type == "cuda":  # layer L's kernels done before its memory is reused
                torch.cuda.synchronize(device)
            del loaded
            if device.type == "cuda":
                torch.cuda.empty_cache()
            timing.compute_s = time.perf_counter() - t_loaded
            prefetcher.report(timing, n_layers)
            if i == len(streams) - 1:  # layer L done for every model
                src.hidden, src_out = src_out, src.hidden
                done = time.perf_counter()
                layer_seconds.append(round(done - t_layer, 3))
                t_layer = done
                bar.set_postfix_str(", ".join(f"{e.result()[str(layer)].rel_err:.3g}"
                                              for e in errors))
                bar.update()
        results, nll_source = compare_logits(
            [load_head(st.ckpt, st.cfg, device, dtype) for st in streams],
            [st.hidden for st in streams], batches, valid, targets, scored, device,
            src.cfg.vocab_size)
        bar.update()
    # on the CPU, for the other ranks
    return _Part([e.merge(()) for e in errors], results, [c.totals() for c in clamps[1:]],
                 nll_source, layer_seconds,
                 prefetcher.summary(src.cfg.first_k_dense_replace, len(streams)))


def _named(label: str, ckpt: Checkpoint) -> str:
    """A model as messages name it: its label, and its directory when that is not the label."""
    return label if label == str(ckpt.root) else f"{label} {ckpt.root}"


def _model(index: int, label: str, ckpt: Checkpoint) -> str:
    """Model `index` of an eval (0: the source) as messages name it, saying which it is."""
    return _named(label, ckpt) if index == 0 else f"candidate {_named(label, ckpt)}"


def _config(label: str, ckpt: Checkpoint):
    try:
        return model_config(ckpt)
    except KconvertError as exc:
        raise KconvertError(f"{_named(label, ckpt)}: {exc}") from exc


def _stream(label: str, ckpt: Checkpoint, cfg, ids: torch.Tensor, valid: torch.Tensor,
            device: torch.device, dtype: torch.dtype, hidden_device: torch.device) -> Stream:
    try:
        layers = tensors_by_layer(ckpt, cfg.num_hidden_layers)
        hidden = embed(ckpt, torch.where(valid, ids, PAD_ID), dtype, hidden_device)
        if device.type == "cuda" and hidden_device.type == "cpu":
            hidden = hidden.pin_memory()
    except KconvertError as exc:
        raise KconvertError(f"{_named(label, ckpt)}: {exc}") from exc
    return Stream(label, ckpt, cfg, layers, hidden,
                  position_embeddings(cfg, ids.shape[1], device, dtype))


def _labelled(stream: Stream, step, *args, **kwargs):
    """A loading step of one of the models, its errors saying which model."""
    try:
        return step(*args, **kwargs)
    except KconvertError as exc:
        raise KconvertError(f"{_named(stream.label, stream.ckpt)}: {exc}") from exc


def _build(stream: Stream, layer: int, raw, ctx: ForwardContext, device: torch.device,
           dtype: torch.dtype, clamps: activations.BlockClamps | None):
    """Layer `layer` of `stream` built from its bytes, as served (activations.build_served)."""
    return activations.build_served(stream.ckpt, stream.cfg, stream.layers[layer], raw, ctx,
                                    device, dtype, clamps)


def _finite(out: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Whether every real position's output is finite, as a device bool (no host sync)."""
    return (torch.isfinite(out) | ~valid[..., None]).all()


def run_eval(src: str, candidates: list[str], data: str, out: str | None, samples: int,
             seq_len: int, batch_size: int, seed: int, device: str, dtype: str,
             tokenizer: str | None, quiet: bool, echo: Callable[[str], None],
             gpu_memory: int | None = None, allow_short_data: bool = False,
             probe: Probe | None = None, overwrite: bool = False) -> EvalReport:
    """`kconvert eval`: SRC against each candidate on the JSONL `data`; the table goes to
    `echo`, eval.json and eval.png to `out` when it is given. `gpu_memory`: --gpu-memory in
    bytes (kconvert.gpu.budget). Data that cannot fill `samples` sequences of `seq_len`
    tokens is an error, or with `allow_short_data` a warning (the report's `tokens` say what
    was used). `probe` (--generate, one candidate): the degeneration probe after the
    teacher-forced pass, in the report's `generation`, its table after eval's, and each
    model's continuations beside eval.json (kconvert.evaluate.probe). An earlier report in
    `out` is replaced only with `overwrite`, as calibrate's statistics are."""
    from kconvert.io.directories import check_output_dir

    main = distributed.is_main()
    if out is not None:
        refuse_earlier_report(Path(out), overwrite)
    if not Path(data).read_text().strip():
        raise KconvertError("the eval data is empty", file=str(data))
    gpu = GpuRequest(pick_device(device), gpu_memory)
    start_device(gpu.device)  # CUDA starts while the checkpoints, the data and transformers load
    opened: list[Checkpoint] = []
    try:
        with phase("open checkpoint"):
            for i, path in enumerate([src, *candidates]):
                opened.append(open_model(path, candidate=i > 0))
        if out is not None:
            check_output_dir(Path(out), [c.root for c in opened], "the eval directory (-o)")
        with phase("data"):
            ids = load_calibration_data(
                data, tokenizer or opened[0].root, samples, seq_len, seed,
                vocab=opened[0].text_config["vocab_size"],
                short=shortfall(allow_short_data, echo))
        compute = getattr(torch, dtype)
        if probe is not None:
            check_probe_fits([(src, opened[0]), (candidates[0], opened[1])], probe, gpu,
                             compute)
        with planned_forward(gpu, opened[0], ids.shape, batch_size, compute, "eval",
                             models=len(opened), logit_elems=LOGIT_ELEMS["cuda"]) as plan:
            if plan is not None and plan.batch_size < batch_size and not quiet and main:
                echo(f"note: --batch-size {batch_size} lowered to {plan.batch_size} to fit the "
                     f"GPU memory budget of {gib(plan.budget)} (--gpu-memory)")
            report = evaluate(opened[0], opened[1:], ids, gpu.device, batch_size, dtype=compute,
                              labels=list(candidates), quiet=quiet, gpu_plan=plan,
                              meta={"source": src, "data": str(Path(data).resolve())})
            probed = None
            if probe is not None:
                with phase("generate"):
                    probed = run_probe(opened[0], opened[1], (src, candidates[0]), data,
                                       tokenizer, probe, gpu, compute, seed, allow_short_data,
                                       echo)
                report = report.model_copy(update={"generation": probed.report})
    finally:
        for ckpt in opened:
            ckpt.close()
    if not main:  # every rank holds the report; rank 0 shows and writes it
        return report
    echo(render_table(report))
    if report.generation is not None:
        echo(render(report.generation))
    if out is not None:
        with phase("write"):
            save_report(report, Path(out))
            if probed is not None:
                probed.write(Path(out))
        echo(f"wrote {Path(out) / 'eval.json'} and {Path(out) / 'eval.png'}")
    return report
