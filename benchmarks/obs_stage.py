"""Parts stage and kernel of `python -m benchmarks obs`: random experts and their routed
tokens; one batch of them through the OBS stage's phases (Hessian, inverse, loop, RTN
comparison, encode); a layer's experts in batches sized as the commands size them; and the
torch column loop against the Triton kernel."""

from __future__ import annotations

import torch

from benchmarks.harness import Timer, sync
from kconvert.engine.execute import CHUNK_ELEMS, gpu_encode
from kconvert.formats import nvfp4
from kconvert.methods import obs, obs_memory, sparsegpt
from kconvert.methods.hessians import gram

METHODS = {"gptq": None, "sparsegpt": sparsegpt.p48_mask}


def encode_chunk(dev: torch.device) -> int:
    """The encoder's chunk as the engine sizes it (kconvert.engine.execute)."""
    return CHUNK_ELEMS.get(dev.type, CHUNK_ELEMS["cpu"])


def problem(dev: torch.device, e: int, rows: int, k: int, tokens: int, gen: torch.Generator
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """e random experts [rows, k] and their routed inputs [tokens, k] (bf16, as captured)."""
    w = torch.randn(e, rows, k, generator=gen, device=dev) * k ** -0.5
    x = torch.randn(e, tokens, k, generator=gen, device=dev).to(torch.bfloat16)
    return w, x


def hessians(x: torch.Tensor) -> torch.Tensor:
    """Each expert's X^T X of its routed inputs, in fp32, as the commands compute it."""
    return torch.stack([gram(xi) for xi in x])


def run_batch(ph: Timer, method: str, w: torch.Tensor, x: torch.Tensor, kernel: str
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch through Hessian, inverse, loop, RTN comparison (gptq) and encode."""
    e, rows, _ = w.shape
    amax = w.abs().amax((1, 2))
    gs = nvfp4.tensor_scale(amax).repeat_interleave(rows).reshape(e, rows)
    if method == "rtn":
        ph("encode", nvfp4.quantize, w, amax, "mse", encode_chunk(w.device), group_size=16)
        return w, torch.empty(0)
    h = ph("hessian", hessians, x)
    u = ph("inverse", obs.prepare_inverse, h)
    w_hat, codes = ph("loop", obs.obs_quantize, w, u, gs, 16, "mse", mask=METHODS[method],
                      kernel=kernel)
    del u
    if method == "gptq":
        w_hat, codes = ph("rtn_compare", obs.keep_better_than_rtn, w, w_hat, codes, h, gs, 1,
                          16, "mse", torch.float32, "compressed-tensors", list(range(e)),
                          [None] * e)
    del h
    ph("encode", nvfp4.quantize, w_hat, amax, "mse", encode_chunk(w.device), group_size=16,
       block_codes=codes)
    return w_hat, codes


def warm(dev: torch.device, kernels: list[str]) -> None:
    """Compile the Triton kernels (each mask variant, the block-scale choice) outside the timed
    parts."""
    w = torch.randn(1, 8, 64, device=dev)
    u = torch.eye(64, device=dev)[None]
    gs = torch.ones(1, 8, device=dev)
    for mask in METHODS.values():
        for k in kernels:
            obs.obs_quantize(w, u, gs, 16, "mse", mask=mask, kernel=k)
    nvfp4.quantize(w, w.abs().amax((1, 2)), "mse", group_size=16)
    sync(dev)


def obs_share(dev: torch.device, method: str) -> int | None:
    """The OBS batches' share of the GPU memory plan that `kconvert sparsify --method sparsegpt`
    (or `quantize --method gptq`) makes at its defaults for a full-size Kimi-K2 layer on this
    card (kconvert.gpu.plan), so that the stage's batches are the command's; None on a CPU."""
    if dev.type != "cuda":
        return None
    from kconvert.calibrate.plan import forward
    from kconvert.common.options import BATCH_SIZE, SEQ_LEN, SPARSEGPT_SAMPLES
    from kconvert.gpu.budget import GpuRequest
    from kconvert.gpu.plan import plan_conversion
    from kconvert.gpu.shapes import Shapes
    from kconvert.testing.fixture_config import k2_config
    from kconvert.testing.header_only import KIMI_K2_THINKING

    s = Shapes.from_config(k2_config(KIMI_K2_THINKING, quantized=True))
    work = obs_memory.gpu_work(s, forward(s, SPARSEGPT_SAMPLES, SEQ_LEN, BATCH_SIZE, capture=True),
                        shared=False, against_rtn=method == "gptq")
    return plan_conversion(s, GpuRequest(dev).context.budget, method, s.expert_set(), work,
                           encode=gpu_encode()).obs_bytes


def stage_part(dev: torch.device, method: str, experts: int, dims, tokens: int, kernel: str
               ) -> dict:
    """All `experts` of a layer, gate+up then down, in batches; seconds per phase."""
    gen = torch.Generator(device=dev).manual_seed(0)
    ph = Timer(dev)
    hidden, inter = dims
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    batches = {}
    stage = Timer(dev)
    share = obs_share(dev, method)
    for name, rows, k in (("gate_up", 2 * inter, hidden), ("down", hidden, inter)):
        step = obs_memory.experts_per_batch(rows, k, share, against_rtn=method == "gptq")
        batches[name] = step
        for start in range(0, experts, step):
            w, x = problem(dev, min(step, experts - start), rows, k, tokens, gen)
            with stage.span("stage"):  # the making of the problem is not timed
                run_batch(ph, method, w, x, kernel)
            del w, x
    out = {"experts": experts, "batch_experts": batches, "kernel": kernel,
           "stage_s": round(stage.seconds.get("stage", 0.0), 2), "phases_s": ph.rounded(2)}
    if dev.type == "cuda":
        out["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    return out


def kernel_part(dev: torch.device, dims, tokens: int, e: int) -> dict:
    """Torch column loop vs Triton kernel on one gate+up batch: seconds and differences."""
    hidden, inter = dims
    out = {}
    for method in METHODS:
        got = {}
        for kernel in ("torch", "triton"):
            ph = Timer(dev)
            w, x = problem(dev, e, 2 * inter, hidden, tokens,
                           torch.Generator(device=dev).manual_seed(1))
            got[kernel] = run_batch(ph, method, w, x, kernel)
            got[kernel + "_s"] = round(ph.seconds["loop"], 2)
            del w, x
        out[method] = {
            "torch_loop_s": got["torch_s"], "triton_loop_s": got["triton_s"],
            "codes_differing": int((got["torch"][1] != got["triton"][1]).sum()),
            "codes": got["torch"][1].numel(),
            "values_differing": int((got["torch"][0] != got["triton"][0]).sum())}
    w, _ = problem(dev, e, 2 * inter, hidden, 1, torch.Generator(device=dev).manual_seed(1))
    blocks = w.reshape(-1, hidden // 16, 16)
    gs = nvfp4.tensor_scale(w.abs().amax((1, 2))).repeat_interleave(2 * inter)[:, None]
    ph = Timer(dev)
    codes = {k: ph(k, nvfp4.choose_block_codes, blocks, gs, "mse", kernel=k)
             for k in ("torch", "triton")}
    out["rtn_block_codes"] = {"torch_s": round(ph.seconds["torch"], 3),
                              "triton_s": round(ph.seconds["triton"], 3),
                              "codes_differing": int((codes["torch"] != codes["triton"]).sum()),
                              "codes": codes["torch"].numel()}
    return {"experts": e, **out}
