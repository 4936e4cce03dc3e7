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
  precision  (not by default) for Gaussian inputs and inputs with outlier channels, one
          gate+up and one down batch (--kernel-experts each, --tokens fitted and one in eight
          more held out): prepare_inverse in fp32 and TF32 against obs_quantize's loop in
          fp32, TF32 and bf16, the seconds of each, the held-out output error against fp32's
          and RTN's, the block codes differing from fp32's (benchmarks/obs_precision.py;
          docs/obs.md, "TF32"; `--tokens 5461` is a full-size expert's share of 128 x 2048
          tokens).
  e2e     `kconvert int4-to-nvfp4 --method rtn`, `--method gptq --data` and `kconvert sparsify
          --method sparsegpt --data` on synthetic.kimi_set's full-size one-MoE-layer INT4
          checkpoint (--seqs x --seq random tokens, 16 x 2048 by default), each audited
          (`kconvert audit --source`); wall seconds, GPU peak memory (nvidia-smi) and mean
          utilisation; a failed run is recorded (its exit code and last line), not fatal.
--tiny: a few small experts on the CPU, and e2e on the tiny k2-int4-kimi fixture.
Matrix products in fp32 except obs.output_error's, which runs on TF32 by design, and part
precision's (the process keeps torch.backends.cuda.matmul.allow_tf32 off; prepare_inverse and
obs_quantize set it as their `precision` says).
"""

from __future__ import annotations

import json
import os
import resource

import torch

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
)
from benchmarks.obs_e2e import e2e_part
from benchmarks.obs_pieces import encode_part, inverse_part
from benchmarks.obs_precision import precision_part
from benchmarks.obs_stage import kernel_part, stage_part, warm
from benchmarks.synthetic import add_dims
from kconvert.formats import nvfp4
from kconvert.methods import triangular


def main(argv: list[str]) -> None:
    ap = arguments("obs", __doc__, root="/tmp/kbench", results=True)
    ap.add_argument("--tiny", action="store_true", help="small sizes, CPU (a check)")
    ap.add_argument("--json", help="where to write the results (default: in --out-dir)")
    ap.add_argument("--parts", type=comma_list, default=["stage", "kernel", "e2e"],
                    help="of stage, kernel, inverse, encode, precision, e2e "
                         "(default: stage,kernel,e2e)")
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
    if "precision" in parts:
        with torch.no_grad():
            res["precision"] = precision_part(dev, dims, tokens, extra_experts)
        print("precision", res["precision"], flush=True)
    if "e2e" in parts:
        res["e2e"] = e2e_part(root, args.tiny, dev.type, args.dims, args.seqs, args.seq)
    res["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    save({"record": rec, **res}, result_path(rec, args.json, out_dir=args.out_dir))
    print(json.dumps(res))
