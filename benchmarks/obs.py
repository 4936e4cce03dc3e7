"""The OBS engine (kconvert.methods.obs) on one full-size Kimi MoE layer: RTN, GPTQ
and SparseGPT side by side, the fused Triton in-block loop against the torch loop.

    python3 -m benchmarks obs --json /tmp/kbench-out/bench_obs.json       # H100, ~5 min
    python3 -m benchmarks obs --tiny --json /tmp/bench_obs_tiny.json      # CPU check, ~1 min

    python3 -m benchmarks obs --parts inverse,encode --json /tmp/kbench-out/inv.json  # ~1 min

Parts (--parts, stage,kernel,e2e by default; a JSON line each on stdout, all in --json):
  stage   384 synthetic experts (gate+up as one [4096, 7168] matrix sharing a 7168^2 Hessian,
          down [7168, 2048] with a 2048^2 one), --tokens (2800) random routed tokens per expert,
          in batches sized as the commands size them (obs_memory.experts_per_batch of the OBS share
          of their GPU memory plan at the default budget, `obs_share`):
          rtn       the NVFP4 encode alone (mse block scales)
          gptq      Hessians X^T X + U = chol(H^-1) + the OBS loop without a mask + the
                    comparison with RTN on the same H + the encode
          sparsegpt the same with the p48 mask
          with the Triton scale-block kernel (--kernel, default auto: Triton on CUDA: mask,
          block scale and column loop in one launch per scale block) and, on CUDA, the Triton
          block-scale choice in the RTN comparison and the RTN encode, and the encoder's chunk
          as the engine sizes it (engine.execute.CHUNK_ELEMS); OBS stage seconds,
          per phase (hessian, inverse, loop, rtn_compare, encode), peak GPU memory.
  kernel  one gate+up batch (--kernel-experts, 16) through the loop with the torch path and
          with the Triton kernel, for gptq and sparsegpt: loop seconds of each, and how many
          block codes and W-hat values differ (0 expected: docs/obs.md); and the batch's RTN
          block-scale codes (mse) by torch and by Triton (kconvert.formats.nvfp4_triton):
          seconds of each and codes differing (0 expected).
  inverse one gate+up batch and one down batch (--kernel-experts each): seconds (the smaller
          of two calls) of
          solve_s           prepare_inverse with one leaf (leaf = K): torch's Cholesky and
                            solve_triangular(L, I), the inverse before the GEMM recursion,
                            bit for bit (the damping and flips included)
          gemm_leaf<L>_s    prepare_inverse as it is now (triangular.inverse_cholesky_factor_)
                            with leaf L of --leaves (default_leaf: the default)
          cholesky_s, cholesky_looped_s, invert_lower_s   the alternative: torch's Cholesky
                            of the damped H (batched as torch runs it, and looped per expert),
                            then only the inverse from GEMMs (triangular.invert_lower_)
          U's relative difference to solve_s's (Frobenius, worst expert) for the default and
          for the alternative, and GPTQ and SparseGPT under the old and the default U: block
          codes and W-hat values differing, output error tr(dW H dW^T) of each (fp32 products,
          TF32 off), on the gate+up batch.
  encode  one gate+up batch: the encode of given codes (stage's `encode`) by torch's
          elementwise ops at 1<<22 elements a chunk (this bench's stage before), by torch at
          the engine's chunk, and by the Triton encoder (nvfp4_triton.encode, the default on
          CUDA): seconds of each, bytes (and errors) equal; and the RTN comparison's pieces
          (stage's `rtn_compare`): block-scale choice, fake_quantize, one output error, the
          whole comparison.
  e2e     `kconvert int4-to-nvfp4 --method rtn`, `--method gptq --data` and `kconvert sparsify
          --method sparsegpt --data` on synthetic.kimi_set's full-size one-MoE-layer INT4
          checkpoint (--seqs x --seq random tokens, 16 x 2048 by default), each audited
          (`kconvert audit --source`); wall seconds, GPU peak memory (nvidia-smi) and mean
          utilisation; a failed run is recorded (its exit code and last line), not fatal.
--tiny: a few small experts on the CPU, and e2e on the tiny k2-int4-kimi fixture.
Matrix products in fp32 except obs.output_error's, which runs on TF32 by design (the process
keeps torch.backends.cuda.matmul.allow_tf32 off; prepare_inverse forces it off).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
from pathlib import Path

import torch

from benchmarks.child_process import child_env, run_child
from benchmarks.gpu_sampler import GpuSampler
from benchmarks.harness import (
    Timer,
    arguments,
    comma_ints,
    comma_list,
    parse,
    record,
    result_path,
    save,
    sync,
)
from benchmarks.synthetic import Dims, add_dims, kimi_set, random_ids, write_ids
from kconvert.engine.execute import CHUNK_ELEMS, gpu_encode
from kconvert.formats import nvfp4
from kconvert.methods import obs, obs_memory, sparsegpt, triangular

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


def run_batch(ph: Timer, method: str, w: torch.Tensor, x: torch.Tensor, kernel: str
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch through Hessian, inverse, loop, RTN comparison (gptq) and encode."""
    e, rows, _ = w.shape
    amax = w.abs().amax((1, 2))
    gs = nvfp4.tensor_scale(amax).repeat_interleave(rows).reshape(e, rows)
    if method == "rtn":
        ph("encode", nvfp4.quantize, w, amax, "mse", encode_chunk(w.device), group_size=16)
        return w, torch.empty(0)
    h = ph("hessian", lambda x: torch.stack([xi.float().T @ xi.float() for xi in x]), x)
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


def timed(dev: torch.device, fn, *args, **kw) -> tuple[float, object]:
    """(seconds, result) of one call, the device synchronised before and after."""
    (seconds,), out = Timer(dev).each(1, fn, *args, **kw)
    return round(seconds, 3), out


def best_of_two(dev: torch.device, fn, *args, **kw) -> tuple[float, object]:
    """(the smaller seconds of two calls, the second's result): the first pays for the
    allocator's growth and any one-time set-up."""
    times, out = Timer(dev).each(2, fn, *args, **kw)
    return round(min(times), 3), out


def hessians(x: torch.Tensor) -> torch.Tensor:
    return torch.stack([xi.float().T @ xi.float() for xi in x])


def fp32_error(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor) -> float:
    """tr(dW H dW^T) summed over the batch, fp32 products (TF32 off)."""
    d = w_hat - w
    return float((torch.bmm(d, h) * d).sum(dtype=torch.float64))


def inverse_part(dev: torch.device, dims, tokens: int, e: int, leaves: list[int]) -> dict:
    """The blocked triangular inverse against one solve_triangular, same run, same batches."""
    hidden, inter = dims
    out: dict = {"experts": e, "default_leaf": triangular.LEAF,
                 "product_leaf": triangular.PRODUCT_LEAF}
    obs.prepare_inverse(torch.eye(256, device=dev)[None].repeat(2, 1, 1) * 2)  # handles
    for name, rows, k in (("gate_up", 2 * inter, hidden), ("down", hidden, inter)):
        w, x = problem(dev, e, rows, k, tokens, torch.Generator(device=dev).manual_seed(2))
        h = hessians(x)
        del x
        got: dict = {"k": k}
        damped = h.clone()
        diag = damped.diagonal(dim1=-2, dim2=-1)
        diag.masked_fill_(diag == 0, 1.0)
        diag += obs.PERCDAMP * diag.mean(-1, keepdim=True)
        damped = damped.flip(-2, -1)
        got["cholesky_s"], lower = best_of_two(dev, lambda d: torch.linalg.cholesky_ex(d)[0],
                                               damped)
        got["cholesky_looped_s"] = best_of_two(
            dev, lambda d: [torch.linalg.cholesky_ex(di)[0] for di in d], damped)[0]
        del damped
        triangular.invert_lower_(lower.clone())  # in place: the warm-up call on a copy
        got["invert_lower_s"], lower = timed(dev, triangular.invert_lower_, lower)
        u_split = lower.flip(-2, -1)
        del lower
        got["solve_s"], u_old = best_of_two(dev, obs.prepare_inverse, h, leaf=k)
        for leaf in leaves:
            got[f"gemm_leaf{leaf}_s"], u = best_of_two(dev, obs.prepare_inverse, h, leaf=leaf)
            if leaf == triangular.LEAF:
                u_new = u
            del u
        got["cholesky_then_invert_lower_u_rel_diff"] = float(
            ((u_split - u_old).norm(dim=(1, 2)) / u_old.norm(dim=(1, 2))).max())
        del u_split
        got["u_rel_diff"] = float(((u_new - u_old).norm(dim=(1, 2))
                                   / u_old.norm(dim=(1, 2))).max())
        got["u_new_upper"] = bool(torch.equal(u_new, u_new.triu())
                                  and (u_new.diagonal(dim1=-2, dim2=-1) > 0).all())
        if name == "gate_up":
            amax = w.abs().amax((1, 2))
            gs = nvfp4.tensor_scale(amax).repeat_interleave(rows).reshape(e, rows)
            for method, mask in METHODS.items():
                old = obs.obs_quantize(w, u_old, gs, 16, "mse", mask=mask)
                new = obs.obs_quantize(w, u_new, gs, 16, "mse", mask=mask)
                got[method] = {"codes_differing": int((old[1] != new[1]).sum()),
                               "codes": old[1].numel(),
                               "values_differing": int((old[0] != new[0]).sum()),
                               "error_solve": fp32_error(w, old[0], h),
                               "error_blocked": fp32_error(w, new[0], h)}
                del old, new
        out[name] = got
        del w, h, u_old, u_new
    return out


def encode_part(dev: torch.device, dims, tokens: int, e: int) -> dict:
    """Where stage's encode and rtn_compare go, on one gate+up batch."""
    hidden, inter = dims
    rows = 2 * inter
    w, x = problem(dev, e, rows, hidden, tokens, torch.Generator(device=dev).manual_seed(3))
    h = hessians(x)
    del x
    amax = w.abs().amax((1, 2))
    gs = nvfp4.tensor_scale(amax).repeat_interleave(rows).reshape(e, rows)
    blocks = w.reshape(e * rows, -1, 16)
    out: dict = {"experts": e}
    out["choose_codes_s"], codes = timed(dev, nvfp4.choose_block_codes, blocks,
                                         gs.reshape(-1, 1), "mse")
    codes = codes.reshape(e, rows, -1)
    got = {}
    runs = {"torch_chunk4M": ("torch", 1 << 22), "torch": ("torch", encode_chunk(dev)),
            "triton": ("triton", encode_chunk(dev))}
    for name, (kernel, chunk) in runs.items():
        if kernel == "triton" and not (dev.type == "cuda"
                                       or os.environ.get("TRITON_INTERPRET") == "1"):
            continue
        out[f"encode_{name}_s"], got[name] = timed(
            dev, nvfp4.quantize, w, amax, "mse", chunk, group_size=16, block_codes=codes,
            kernel=kernel)
    first, *rest = got.values()
    out["encode_bytes_equal"] = all(
        torch.equal(first.packed, q.packed) and torch.equal(first.err_sq, q.err_sq)
        and torch.equal(first.ref_sq, q.ref_sq) for q in rest)
    del got, first, rest
    out["fake_quantize_s"], rtn = timed(dev, nvfp4.fake_quantize, blocks,
                                        codes.reshape(e * rows, -1), gs.reshape(-1, 1))
    out["output_error_s"] = timed(dev, obs.output_error, w, rtn.reshape(w.shape), h)[0]
    out["rtn_compare_s"] = timed(dev, obs.keep_better_than_rtn, w, w.clone(), codes, h, gs, 1,
                                 16, "mse", torch.float32, "compressed-tensors",
                                 list(range(e)), [None] * e)[0]
    return out


def cli(*args: str) -> tuple[float, int, str, int]:
    """(wall seconds, exit code, last line of output, peak RSS bytes) of one kconvert
    command."""
    c = run_child([sys.executable, "-m", "kconvert.cli", *args], env=child_env())
    lines = c.output.strip().splitlines()
    return round(c.wall_s, 2), c.rc, lines[-1] if lines else "", c.peak_rss_bytes or 0


def e2e_part(root: Path, tiny: bool, dev: str, dims: Dims, seqs: int, seq: int) -> dict:
    if tiny:
        from kconvert.testing.fixture_weights import FixtureDims
        from kconvert.testing.fixtures import make_fixture

        src = make_fixture(root / "fixture", "k2-int4-kimi", FixtureDims())
        seqs, seq, vocab = 16, 64, FixtureDims().vocab
        make_s = 0.0
    else:
        made = Timer()
        src = kimi_set(root, dims)
        make_s = round(made.elapsed(), 1)
        vocab = dims.vocab
    data = write_ids(root / "calib.jsonl", random_ids(seqs, seq, vocab))
    calib = ["--data", str(data), "--samples", str(seqs), "--seq-len", str(seq)]
    runs = {"rtn": ["int4-to-nvfp4", "--method", "rtn"],
            "gptq": ["int4-to-nvfp4", "--method", "gptq", *calib],
            "sparsegpt": ["sparsify", "--pattern", "p48", "--method", "sparsegpt", *calib]}
    out: dict = {"make_s": make_s, "seqs": seqs, "seq_len": seq}
    peaks = [0]
    for name, args in runs.items():
        dst = root / f"out-{name}"
        shutil.rmtree(dst, ignore_errors=True)
        with GpuSampler() as gpu:
            wall, code, last, peak = cli(args[0], str(src), str(dst), *args[1:], "--device",
                                         dev, "--quiet")
        peaks.append(peak)
        got = {"wall_s": wall, "exit": code, **gpu.summary()}
        if code:
            got["error"] = last
        else:
            audit_s, audit_code, audit_last, peak = cli("audit", str(dst), "--source",
                                                        str(src))
            peaks.append(peak)
            manifest = json.loads((dst / "kconvert-manifest.json").read_text())
            choices = [c["method"] for c in manifest.get("obs", {}).values()]
            got.update(audit_s=audit_s, audit="passed" if audit_code == 0 else audit_last,
                       rel_mse_mean=manifest["summary"]["rel_mse_mean"],
                       gptq_kept=choices.count("gptq"), rtn_kept=choices.count("rtn"))
        shutil.rmtree(dst, ignore_errors=True)
        out[name] = got
        print("e2e", name, got, flush=True)
    out["children_peak_rss_gib"] = round(max(peaks) / 2**30, 2)
    return out


def main(argv: list[str]) -> None:
    ap = arguments("obs", __doc__, root="/tmp/kbench", results=True)
    ap.add_argument("--tiny", action="store_true", help="small sizes, CPU (a check)")
    ap.add_argument("--json", help="where to write the results (default: in --out-dir)")
    ap.add_argument("--parts", type=comma_list, default=["stage", "kernel", "e2e"],
                    help="of stage, kernel, inverse, encode, e2e (default: stage,kernel,e2e)")
    ap.add_argument("--tokens", type=int, default=2800,
                    help="routed tokens per expert (default: %(default)s; with --tiny 300)")
    ap.add_argument("--kernel", default="auto",
                    help="the scale-block kernel: auto, torch or triton (default: %(default)s)")
    ap.add_argument("--kernel-experts", type=int, default=16,
                    help="experts of the kernel, inverse and encode batches "
                         "(default: %(default)s; with --tiny 2)")
    ap.add_argument("--leaves", type=comma_ints, default=[64, 128, 256, 512],
                    help="leaf sizes of part inverse (default: 64,128,256,512)")
    add_dims(ap, moe_layers=None)
    ap.add_argument("--seqs", type=int, default=16, help="e2e's sequences (default: %(default)s)")
    ap.add_argument("--seq", type=int, default=2048,
                    help="e2e's tokens each (default: %(default)s)")
    args = parse(ap, argv, tiny={"tokens": 300, "kernel_experts": 2})
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 products (torch's default, stated)
    if dev.type == "cpu":
        torch.set_num_threads(1)  # a check, not a benchmark: no thread contention
        nvfp4.warm_cpu_kernels()  # numba's compile is not the encode's time
    dims = (256, 128) if args.tiny else (7168, 2048)
    experts = 8 if args.tiny else 384
    tokens, kernel, parts, root = args.tokens, args.kernel, args.parts, args.root
    root.mkdir(parents=True, exist_ok=True)
    rec = record("obs", gpu=dev.type == "cuda", scratch=root)
    res: dict = {"device": rec["device"]["name"], "tiny": args.tiny, "tokens_per_expert": tokens}
    triton_ok = dev.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    warmed = Timer()
    warm(dev, ["torch", kernel] + (["triton"] if triton_ok else []))
    res["warm_s"] = round(warmed.elapsed(), 1)
    extra_experts = args.kernel_experts
    if "stage" in parts:
        res["stage"] = {}
        for method in ("rtn", "gptq", "sparsegpt"):
            with torch.no_grad(), GpuSampler() as gpu:
                got = stage_part(dev, method, experts, dims, tokens, kernel)
            res["stage"][method] = {**got, **gpu.summary()}
            print("stage", method, res["stage"][method], flush=True)
    if "kernel" in parts and triton_ok:
        with torch.no_grad():
            res["kernel"] = kernel_part(dev, dims, tokens, extra_experts)
        print("kernel", res["kernel"], flush=True)
    if "inverse" in parts:
        leaves = args.leaves
        with torch.no_grad():
            res["inverse"] = inverse_part(dev, dims, tokens, extra_experts,
                                          sorted(set(leaves) | {triangular.LEAF}))
        print("inverse", res["inverse"], flush=True)
    if "encode" in parts:
        with torch.no_grad():
            res["encode"] = encode_part(dev, dims, tokens, extra_experts)
        print("encode", res["encode"], flush=True)
    if "e2e" in parts:
        res["e2e"] = e2e_part(root, args.tiny, dev.type, args.dims, args.seqs, args.seq)
    res["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    save({"record": rec, **res}, result_path(rec, args.json, out_dir=args.out_dir))
    print(json.dumps(res))
