"""One calibration pass over the layers, and the `kconvert calibrate` command behind the CLI."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from kconvert.calibrate.block_amax import BLOCK_AMAX_STAT
from kconvert.calibrate.data import PAD_ID, load_calibration_data, shortfall
from kconvert.calibrate.expert_ranks import model_ranks, note_small_run
from kconvert.calibrate.forward import (
    InputGram,
    embed,
    model_config,
    padding_aware_mask,
    position_embeddings,
)
from kconvert.calibrate.load import (
    build_layer,
    nonfinite_hidden_error,
    read_layer,
    tensors_by_layer,
)
from kconvert.calibrate.moe import ForwardContext, MoEBlock
from kconvert.calibrate.mtp import decoder_tensors, into_mtp_input, mtp_valid
from kconvert.calibrate.plan import planned_forward
from kconvert.calibrate.prefetch import LayerPrefetcher
from kconvert.calibrate.startup import device_ready, phase, start_device
from kconvert.calibrate.stats import (
    GATE_WEIGHT,
    META_FILE,
    ROUTING_CONVENTION,
    CalibrationStats,
    reduce_over_ranks,
    save_stats,
    stats_key,
)
from kconvert.common import distributed
from kconvert.errors import KconvertError
from kconvert.gpu.budget import GpuRequest
from kconvert.gpu.devices import pick_device
from kconvert.gpu.plan import GpuPlan, gib
from kconvert.io.checkpoint import Checkpoint
from kconvert.model.arch import arch_of
from kconvert.model.names import Role, parse_name
from kconvert.version import __version__


def measure_stats(
    ckpt: Checkpoint,
    input_ids: torch.Tensor,
    device: str | torch.device = "cpu",
    batch_size: int = 8,
    *,
    attention_mask: torch.Tensor | None = None,
    dtype: torch.dtype = torch.bfloat16,
    hidden_on_device: bool | None = None,
    meta: dict | None = None,
    on_layer: Callable[[int, torch.Tensor], None] | None = None,
    on_captured: Callable[[int, MoEBlock | None, dict[str, InputGram]], None] | None = None,
    grams: frozenset[Role] = frozenset(),
    held_every: int = 0,
    rerun_moe: bool = False,
    on_weights: Callable[[int, torch.nn.Module], None] | None = None,
    progress: Callable[[str], None] | None = None,
    prefetch: bool = True,
    prefetch_bytes: int | None = None,
    gpu_plan: GpuPlan | None = None,
) -> CalibrationStats:
    """One layer-streamed pass over `input_ids` [num_seqs, seq_len]; see the module docstring.

    `attention_mask` (1 real, 0 padding) is optional: PAD_ID entries of `input_ids` are
    padding too. Positions are 0..seq_len-1 in every sequence. `device`: a torch device or
    --device's spec (kconvert.gpu.devices.pick_device). `batch_size` sequences run through a layer
    at a time, fewer on a GPU where `gpu_plan` (the command's plan, kconvert.calibrate.plan;
    a GPU needs one) lowers the micro-batch; the hidden states of all
    tokens are kept in `dtype` on the device (`hidden_on_device` None: where the plan puts
    them) or else in CPU memory. `on_layer(L, hidden)` sees layer L's output hidden states
    [num_seqs, seq_len, hidden] (for tests and debugging); `on_captured(L, moe, grams)` sees
    layer L after its forward, weights still loaded: its MoE block (None in a dense layer) with
    its inputs captured (`moe.expert_inputs(e)`: the OBS engine's expert Hessians), and the
    input Grams of the linears of the roles in `grams` (attention, dense MLP: fused set ->
    forward.InputGram, every `held_every`-th real row held apart when > 0); it is called for
    every MoE layer and every layer with such linears (under torchrun on every rank, its
    block holding this rank's experts and the rows routed to them,
    kconvert.calibrate.expert_ranks). With `rerun_moe`, each MoE layer then
    runs again on the same inputs with the weights `on_captured` left in it, and that run's
    outputs go on to the next layer (SparseGPT's sequential Hessians; the statistics are the
    first run's); `on_weights(L, module)` sees
    transformers' decoder layer L with its weights loaded after its statistics were taken,
    hooks removed (a second stream may run it: REAP router repair; under torchrun it is called
    on every rank, rank 0's module holding every routed expert, gathered there, and the
    stream runs on rank 0: the other ranks' calls share its learned compensation, if any,
    and return); `meta` is merged into the
    recorded meta. `prefetch` and `prefetch_bytes`: the layer prefetcher's `ahead` and
    `device_bytes` (kconvert.calibrate.prefetch).
    """
    device = device if isinstance(device, torch.device) else pick_device(device)
    if input_ids.dim() != 2 or input_ids.dtype != torch.long or not input_ids.numel():
        raise KconvertError("input_ids must be a non-empty LongTensor [num_seqs, seq_len]")
    if batch_size < 1:
        raise KconvertError(f"batch size {batch_size} must be positive")
    valid = input_ids != PAD_ID
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise KconvertError("attention_mask must have the shape of input_ids")
        valid &= attention_mask.bool()
    tokens_valid = valid  # the decoder layers'; an MTP layer's are fewer (calibrate.mtp)
    if grams and distributed.world() > 1:
        raise KconvertError("the input Hessians of attention and dense MLP linears are built "
                            "from every token in one process; run without torchrun")
    say = progress if progress is not None and distributed.is_main() else (lambda _msg: None)
    with phase("model code"):
        cfg = model_config(ckpt)
    n_layers = cfg.num_hidden_layers
    layer_tensors = tensors_by_layer(ckpt, n_layers)
    # the multi-token-prediction layers run after the decoder layers, on their own inputs
    mtp = [L for L in arch_of(ckpt.text_config).mtp_layers if L in layer_tensors]
    order = [*range(n_layers), *mtp]
    # Under torchrun every MoE layer is expert-parallel (kconvert.calibrate.expert_ranks).
    ranks = (model_ranks(layer_tensors, cfg.n_routed_experts,
                         range(cfg.first_k_dense_replace, n_layers))
             if distributed.world() > 1 else {})

    t0 = time.perf_counter()
    device_ready(device)  # after the imports, which the CUDA start overlaps
    if device.type == "cuda":
        if gpu_plan is None:
            raise KconvertError("a calibration on a GPU runs within the command's GPU memory "
                                "plan: give gpu_plan (kconvert.calibrate.plan.forward_plan)")
        # every rank deals the batches alike: the smallest micro-batch any rank's plan allows
        planned = min(distributed.all_gather_object(gpu_plan.batch_size))
        if planned < batch_size:
            say(f"note: {batch_size} sequences per step lowered to {planned} to fit the GPU "
                f"memory budget of {gib(gpu_plan.budget)} (--gpu-memory)")
            batch_size = planned
    # Data-parallel: this rank runs whole batches of the one-process run (the same batches,
    # so the same arithmetic) through attention, router and shared expert; each MoE layer's
    # routed experts are expert-parallel (kconvert.calibrate.expert_ranks). The statistics are
    # reduced over ranks after each layer.
    mine = distributed.own_batches(input_ids.shape[0], batch_size)
    local_ids, local_valid = input_ids[mine], valid[mine]
    n_seq, seq_len = local_ids.shape
    all_valid = bool(local_valid.all())
    n_real = int(local_valid.sum())
    # batch steps per layer on every rank: an expert-parallel layer's exchange runs once per
    # step on every rank together, with an empty step where a rank's batches ran out
    n_batches = -(-input_ids.shape[0] // batch_size)
    idle_steps = len(range(0, n_batches, distributed.world())) - len(
        distributed.own_batch_ids(n_batches))
    if ranks:
        note_small_run(int(valid.sum()), distributed.world())
    if device.type == "cuda" and hidden_on_device is None:
        hidden_on_device = gpu_plan.hidden_on_device
    on_device = device.type == "cuda" and hidden_on_device
    with phase("embedding"):
        hidden = embed(ckpt, torch.where(local_valid, local_ids, PAD_ID), dtype,
                       device if on_device else "cpu")
        if device.type == "cuda" and not on_device:
            hidden = hidden.pin_memory()
        positions, pos_emb = position_embeddings(cfg, seq_len, device, dtype)
        valid_dev = local_valid.to(device)
    ctx = ForwardContext()
    prefetcher = LayerPrefetcher(
        read=lambda layer: read_layer(ckpt, cfg, layer, decoder_tensors(layer_tensors[layer]),
                                      dtype, device, ranks[layer].mine if layer in ranks else None),
        build=lambda layer, raw: build_layer(raw, cfg, ctx, device, dtype, grams=grams,
                                             held_every=held_every, ranks=ranks.get(layer)),
        device=device, ahead=prefetch,
        device_bytes=(prefetch_bytes if prefetch_bytes is not None or gpu_plan is None
                      else gpu_plan.prefetch_bytes))

    tensors: dict[str, torch.Tensor] = {}
    modules: dict[str, str] = {}
    for layer, loaded, timing in prefetcher.layers(order, lambda L: f"layer {L}"):
        t_loaded = time.perf_counter()
        if layer in mtp:
            step = layer - n_layers + 1
            valid = mtp_valid(tokens_valid, step)
            local_valid = valid[mine]
            valid_dev, all_valid = local_valid.to(device), bool(local_valid.all())
            n_real = int(local_valid.sum())
            into_mtp_input(ckpt, cfg, layer_tensors[layer], step, hidden, local_ids,
                           local_valid, batch_size, device, dtype)
        if loaded.moe is not None:
            loaded.moe.capture = on_captured is not None
            # expert-parallel: the rows routed here from every rank, each token at most once
            loaded.moe.capture_rows = int(valid.sum()) if layer in ranks else n_real
        rerun = rerun_moe and loaded.moe is not None
        layer_input = hidden.clone() if rerun else None

        def forward(loaded=loaded, valid_dev=valid_dev, local_valid=local_valid,
                    all_valid=all_valid) -> torch.Tensor:
            """This rank's batches through the layer, in place; 1 where an output is not
            finite (a flag rather than an error, so that every rank learns of it), checked
            on the device and read once per layer."""
            finite = torch.ones((), dtype=torch.bool, device=device)
            with torch.no_grad():
                for start in range(0, n_seq, batch_size):
                    rows = slice(start, min(start + batch_size, n_seq))
                    x = hidden[rows].to(device, non_blocking=True)
                    v = valid_dev[rows]
                    batch_all = all_valid or bool(local_valid[rows].all())
                    ctx.valid = None if batch_all else v
                    out = loaded.module(x, attention_mask=padding_aware_mask(v, batch_all),
                                        position_ids=positions, position_embeddings=pos_emb)
                    finite &= (torch.isfinite(out) | ~v[..., None]).all()
                    hidden[rows].copy_(out, non_blocking=True)
                if loaded.moe is not None and loaded.moe.ranks is not None:
                    for _ in range(idle_steps):
                        loaded.moe.idle(hidden.shape[-1], dtype, device)
            return (~finite).float()

        nonfinite = forward()
        sums, maxima = loaded.stat_tensors()
        # maxed over ranks with the statistics: every rank fails where one met it
        reduce_over_ranks(sums, [*maxima, nonfinite])
        if nonfinite:
            raise nonfinite_hidden_error(ckpt, layer_tensors[layer], layer)
        for module, acc in loaded.linear_stats.items():
            key = stats_key(module)
            modules[key] = module
            tensors[f"{key}.input_amax"] = acc.amax.cpu()
            tensors[f"{key}.input_sq_sum"] = acc.sq.float().cpu()
            tensors[f"{key}.{BLOCK_AMAX_STAT}"] = acc.block_amax.cpu()
        if on_captured is not None and (loaded.moe is not None or loaded.grams):
            on_captured(layer, loaded.moe, loaded.grams)
        if loaded.moe is not None:
            # (copied when the layer runs again: on a CPU .cpu() returns the same tensors)
            tensors.update({k: v.clone() if rerun else v
                            for k, v in loaded.moe.results(layer).items()})
            for e, names in enumerate(loaded.moe.experts.names):
                for proj, module in names.items():
                    modules[f"layers.{layer}.experts.{e}.{proj}"] = module
        tensors[f"layers.{layer}.tokens"] = torch.tensor(int(valid.sum()))
        for h in loaded.hooks:
            h.remove()
        if rerun:
            hidden.copy_(layer_input)
            loaded.moe.capture = False
            if forward():
                raise nonfinite_hidden_error(ckpt, layer_tensors[layer], layer,
                                             " with its compressed experts")
            del layer_input
        if on_weights is not None and layer not in mtp:  # (a repair stream runs the decoder)
            if loaded.moe is not None and loaded.moe.ranks is not None:
                # every expert on rank 0, where the hook runs, as one process holds them
                experts = ranks[layer].gather(loaded.moe.experts)
                if experts is not None:
                    loaded.moe.experts, loaded.moe.ranks = experts, None
            on_weights(layer, loaded.module)
        if device.type == "cuda":  # layer L's kernels done before its memory can be reused
            torch.cuda.synchronize(device)
        del loaded, forward  # layer L's weights go before the prefetcher starts on L+2
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if on_layer is not None:
            on_layer(layer, hidden)
        timing.compute_s = time.perf_counter() - t_loaded
        prefetcher.report(timing, len(order))
        say(f"layer {layer + 1}/{len(order)}: {timing.wall_s:.1f} s "
            f"({int(valid.sum()) / max(timing.compute_s, 1e-9):,.0f} tokens/s)")

    meta_out = {
        "producer": f"kconvert {__version__}",
        "source": ckpt.identity,
        "samples": input_ids.shape[0],
        "seq_len": seq_len,
        "tokens": int(tokens_valid.sum()),
        "padding_tokens": int((~tokens_valid).sum()),
        "seed": None,
        "num_hidden_layers": n_layers,
        "moe_layers": [*range(cfg.first_k_dense_replace, n_layers), *mtp],
        "mtp_layers": mtp,
        "n_routed_experts": cfg.n_routed_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "routing": ROUTING_CONVENTION,
        "gate_weight": GATE_WEIGHT,
        "saliency": "REAP: mean over routed real tokens of g_j(x) * ||f_j(x)||_2, f_j = expert "
                    "output before gating; 0 for a never-routed expert",
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "seconds": round(time.perf_counter() - t0, 3),
        "timing": prefetcher.summary(cfg.first_k_dense_replace),
        **(meta or {}),
    }
    if len(order) < len(layer_tensors):
        meta_out["skipped_layers"] = sorted(set(layer_tensors) - set(order))
    stats = CalibrationStats(meta_out, tensors, modules)
    unrouted = [m for m, a in stats.input_amax().items()
                if a == 0.0 and parse_name(m + ".weight").role is Role.ROUTED_EXPERT]
    stats.meta["unrouted"] = sorted({m.rsplit(".", 1)[0] for m in unrouted})
    return stats


def run_calibration(src: str, data: str, out: str, samples: int, seq_len: int, batch_size: int,
                    seed: int, device: str, dtype: str, tokenizer: str | None,
                    revision: str | None, overwrite: bool,
                    progress: Callable[[str], None],
                    gpu_memory: int | None = None,
                    allow_short_data: bool = False,
                    warn: Callable[[str], None] | None = None) -> CalibrationStats:
    """`kconvert calibrate`: calibrate SRC on the JSONL `data` and write the statistics to
    `out`; `progress` gets the notes, per-layer lines and the closing summary. `gpu_memory`:
    --gpu-memory in bytes (kconvert.gpu.budget). Data that cannot fill `samples` sequences of
    `seq_len` tokens is an error, or with `allow_short_data` a warning (the statistics'
    `samples` and `tokens` say what was used); warnings go to `warn` (default: `progress`)."""
    from kconvert.io.checkpoint import open_checkpoint
    from kconvert.io.directories import check_output_dir

    if not distributed.is_main():
        progress = _quiet
    out_dir = Path(out)
    if (out_dir / META_FILE).exists() and not overwrite:
        raise KconvertError("the directory already holds statistics; pass --overwrite",
                            file=str(out_dir))
    gpu = GpuRequest(pick_device(device), gpu_memory)
    start_device(gpu.device)  # CUDA starts while the checkpoint, the data and transformers load
    with phase("open checkpoint"):
        ckpt = open_checkpoint(src, revision)
    try:
        check_output_dir(out_dir, [ckpt.root], "the statistics directory (-o)")
        with phase("data"):
            ids = load_calibration_data(
                data, tokenizer or ckpt.root, samples, seq_len, seed,
                vocab=ckpt.text_config["vocab_size"],
                short=shortfall(allow_short_data, warn or progress))
        compute = getattr(torch, dtype)
        with planned_forward(gpu, ckpt, ids.shape, batch_size, compute, "calibrate") as plan:
            stats = measure_stats(
                ckpt, ids, gpu.device, batch_size, dtype=compute,
                meta={"seed": seed, "data": str(Path(data).resolve())}, progress=progress,
                gpu_plan=plan)
    finally:
        ckpt.close()
    with phase("write"):
        save_stats(stats, out_dir)
    progress(f"wrote {out_dir}: {_plural(stats.meta['tokens'], 'token')}, "
             f"{_plural(len(stats.moe_layers), 'MoE layer')}, {stats.meta['seconds']:.1f} s")
    return stats


def _quiet(_message: str) -> None:
    pass


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
