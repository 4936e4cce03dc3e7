"""The children of `convert` that time a computation in memory or the anchor: each runs in
its own process (child_process.run_child) and prints one RESULT line."""

from __future__ import annotations

import os
import resource
import statistics
from pathlib import Path

from benchmarks.child_process import report
from benchmarks.encode import as_engine
from benchmarks.harness import Timer
from benchmarks.synthetic import random_int4

H, I_MOE = 7168, 2048  # Kimi-K2 hidden size and expert intermediate size
# The anchor's scheme, as anchor_convert.py gives it: NVFP4 weights of the routed experts.
EXPERTS_ONLY = [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"]


def anchor(argv: list[str]) -> None:
    """`_anchor SRC DST WORKERS`: the anchor's model_free_ptq as anchor_convert.py runs it
    (same snippet; its stub packages on PYTHONPATH), to os.sync()."""
    src, dst, workers = argv
    import torch
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
        CompressedTensorsDequantizer,
    )
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from llmcompressor.entrypoints.model_free import model_free_ptq

    scheme = preset_name_to_scheme("NVFP4A16", EXPERTS_ONLY)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    timer = Timer()
    model_free_ptq(src, dst, scheme=scheme, converter=CompressedTensorsDequantizer(src),
                   device=dev, max_workers=int(workers))
    os.sync()
    report({"wall_main_s": round(timer.elapsed(), 3), "device": dev,
            "threads": torch.get_num_threads(),
            "maxrss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 3)})


def anchor_compute(argv: list[str]) -> None:
    """`_anchor_compute SRC REPS`: the anchor's compute alone (dequantizer + model_free
    converter) on tensors in memory."""
    src, reps = argv[0], int(argv[1])
    import torch
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
        CompressedTensorsDequantizer,
    )
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from llmcompressor.entrypoints.model_free.converter import ModelFreePtqConverter
    from llmcompressor.entrypoints.model_free.validate import validate_config
    from safetensors.torch import load_file

    config = validate_config(None, preset_name_to_scheme("NVFP4A16", EXPERTS_ONLY), ())
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    base = {}
    for f in sorted(Path(src).glob("*.safetensors")):
        base.update(load_file(f, device=dev))
    n_mat = sum(k.endswith(".weight_packed") for k in base)

    def once() -> None:
        tensors = CompressedTensorsDequantizer(src).process(dict(base))
        ModelFreePtqConverter(config).process(tensors)

    times, _ = Timer(dev).each(reps, once)
    report({"device": dev, "threads": torch.get_num_threads(), "matrices": n_mat,
            "times_s": [round(x, 3) for x in times],
            "per_matrix_ms": round(min(times) / n_mat * 1e3, 2)})


def kc_compute(argv: list[str]) -> None:
    """`_kc_compute DEVICE BATCH REPS`: kconvert's INT4 -> NVFP4 per expert matrix, in
    memory, as the engine does it on this device (CPU: the fused kernel; CUDA: decode, then
    quantize)."""
    dev_name, batch, reps = argv[0], int(argv[1]), int(argv[2])
    import torch

    dev = torch.device(dev_name)
    chunk = 1 << 27 if dev.type == "cuda" else 1 << 22  # as kconvert.engine.execute picks
    gen = torch.Generator(device=dev).manual_seed(0)
    out: dict = {"device": dev_name, "threads": torch.get_num_threads(), "batch": batch}
    for shape in ((I_MOE, H), (H, I_MOE)):
        m, k = shape
        packed, scale = random_int4(batch, m, k, gen, dev)
        for bs in ("amax", "mse"):
            times, _ = Timer(dev).each(reps, as_engine, packed, scale, bs, chunk)
            out[f"{bs}_{m}x{k}_ms_per_matrix"] = round(statistics.median(times[1:] or times)
                                                       / batch * 1e3, 3)
    report(out)
