"""MXFP4's two block-scale rules measured (issue 29): the weight error of `mse` against `amax`
on full-size Kimi expert shapes, and `kconvert eval` KL / top-1 on the trained tiny MoE of
MXFP4 amax and mse, each W4A16 and W4A4 (activations quantized at run time, as served: eval
emulates them, kconvert/evaluate/activations.py), AMD's full recipe (routers too) and NVFP4
mse, through the CLI's default path (`convert` with the `quantize` recipe and `--format` /
`--activations` / `--targets`, as `kconvert quantize` runs it). NVFP4's W4A4 row (which needs
calibration) is read from benchmarks/results/eval_tiny_moe_w4a4.json, measured by
eval_pipelines on the same held-out sequences.

Weight error: Kimi-K2-style INT4 experts (gate/up 2048x7168, down 7168x2048; codes by
round-to-nearest of Gaussian weights on a per-32 bf16 scale, as an RTN INT4 release is made)
decoded exactly, and the same Gaussian weights in BF16; the sum of squared error of the
MXFP4 decode against the fp32 source, mse over amax. CPU, a few experts.

    python -m benchmarks mxfp4_quality [--experts 2] [--samples 64] [--seq-len 256]
        [--out benchmarks/results/mxfp4_quality]   # -> .json and .md
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spin-waiting threads on a shared CPU

import torch

from benchmarks.harness import REPO, Timer, arguments, record
from kconvert.driver.convert import RunControl, convert
from kconvert.driver.recipes import load_recipe
from kconvert.evaluate.run import evaluate
from kconvert.formats import mxfp4, nvfp4
from kconvert.io.checkpoint import open_checkpoint
from kconvert.testing.tiny_moe import heldout_ids

SRC = REPO / "tests" / "fixtures" / "tiny-moe-trained"
SHAPES = {"gate/up": (2048, 7168), "down": (7168, 2048)}  # Kimi-K2's routed expert linears
CANDIDATES = {  # name -> quantize settings (the CLI's --format / --block-scale / ...)
    "mxfp4-amax": {"format": "quark-mxfp4", "block_scale": "amax", "activations": "none"},
    "mxfp4-mse": {"format": "quark-mxfp4", "block_scale": "mse", "activations": "none"},
    "mxfp4-amax-w4a4": {"format": "quark-mxfp4", "block_scale": "amax",
                        "activations": "dynamic"},
    "mxfp4-mse-w4a4": {"format": "quark-mxfp4", "block_scale": "mse",
                       "activations": "dynamic"},
    "mxfp4-amax-w4a4-routers": {"format": "quark-mxfp4", "block_scale": "amax",
                                "activations": "dynamic", "targets": "experts,routers"},
    "nvfp4-mse": {"format": "compressed-tensors", "block_scale": "mse"},
}
WHAT = {
    "mxfp4-amax": "MXFP4 W4A16 experts, E8M0 scales by amax",
    "mxfp4-mse": "MXFP4 W4A16 experts, E8M0 scales by mse",
    "mxfp4-amax-w4a4": "MXFP4 W4A4 experts (amax), activations MXFP4 per 32 at run time",
    "mxfp4-mse-w4a4": "MXFP4 W4A4 experts (mse), activations MXFP4 per 32 at run time",
    "mxfp4-amax-w4a4-routers": "AMD's recipe: experts and routers MXFP4 W4A4 (amax)",
    "nvfp4-mse": "NVFP4 W4A16 experts, block scales by mse",
}
# NVFP4 W4A4 (calibrated static input scales): its row of eval_pipelines's run.
NVFP4_W4A4 = REPO / "benchmarks" / "results" / "eval_tiny_moe_w4a4.json"


def int4_rtn(w: torch.Tensor) -> torch.Tensor:
    """w [B, M, K] as an RTN INT4 release stores it (symmetric, one bf16 scale per 32 of
    amax / 7, so codes -7..7), decoded exactly to fp32."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    scale = (groups.abs().amax(-1, keepdim=True) / 7).bfloat16().float()
    codes = (groups / scale).round().clamp(-8, 7)
    return (codes * scale).reshape(w.shape)


def weight_errors(experts: int) -> dict:
    out = {}
    gen = torch.Generator().manual_seed(0)
    for label, (rows, cols) in SHAPES.items():
        w = torch.randn(experts, rows, cols, generator=gen) * 0.02
        for source, x in (("int4", int4_rtn(w)), ("bf16", w.bfloat16().float())):
            made = Timer()
            err = {r: float(mxfp4.quantize(x, r).err_sq.sum()) for r in mxfp4.RULES}
            nv = nvfp4.quantize(x, x.abs().amax(dim=(1, 2)), "mse")
            ref = float(x.double().square().sum())
            out[f"{label} {source}"] = {
                "shape": [experts, rows, cols],
                "rel_err_amax": err["amax"] / ref, "rel_err_mse": err["mse"] / ref,
                "mse_over_amax": err["mse"] / err["amax"],
                "nvfp4_mse_rel_err": float(nv.err_sq.sum()) / ref,
                "seconds": made.elapsed()}
            print(f"{label:8s} {source}: MXFP4 rel err amax {err['amax'] / ref:.5f}, "
                  f"mse {err['mse'] / ref:.5f} (ratio {err['mse'] / err['amax']:.4f}); "
                  f"NVFP4 mse {float(nv.err_sq.sum()) / ref:.5f}", flush=True)
    return out


def eval_candidates(samples: int, seq_len: int, batch_size: int) -> dict:
    held = heldout_ids(samples * seq_len, seed=0, window=seq_len).reshape(-1, seq_len)
    with tempfile.TemporaryDirectory(prefix="mxfp4-quality-") as tmp:
        dirs = []
        for name, settings in CANDIDATES.items():
            dst = Path(tmp) / name
            convert(str(SRC), str(dst), load_recipe("quantize"), settings,
                    RunControl(device="cpu", quiet=True))
            dirs.append(dst)
        opened = [open_checkpoint(str(p)) for p in (SRC, *dirs)]
        try:
            report = evaluate(opened[0], opened[1:], held, "cpu", batch_size,
                              dtype=torch.float32, labels=list(CANDIDATES), quiet=True)
        finally:
            for ckpt in opened:
                ckpt.close()
    return {c.candidate: {"kl_mean": c.logits.kl_mean, "kl_p99": c.logits.kl_p99,
                          "top1_agreement": c.logits.top1_agreement,
                          "nll_source": c.logits.nll_source,
                          "nll_candidate": c.logits.nll_candidate}
            for c in report.candidates}


def nvfp4_w4a4(samples: int, seq_len: int) -> dict | None:
    """NVFP4 W4A4's figures from NVFP4_W4A4, when it was measured on the same held-out
    sequences; None otherwise."""
    run = json.loads(NVFP4_W4A4.read_text())["eval"]
    if run["data"] != f"heldout_ids({samples * seq_len}, seed=0, window={seq_len})":
        return None
    (row,) = [c for c in run["candidates"] if c["candidate"] == "w4a4"]
    return {k: row["logits"][k] for k in ("kl_mean", "kl_p99", "top1_agreement",
                                          "nll_source", "nll_candidate")}


def main(argv: list[str]) -> None:
    ap = arguments("mxfp4_quality", __doc__)
    ap.add_argument("--experts", type=int, default=2, help="experts per shape")
    ap.add_argument("--samples", type=int, default=64, help="held-out sequences")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "mxfp4_quality"))
    a = ap.parse_args(argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    weights = weight_errors(a.experts)
    kl = eval_candidates(a.samples, a.seq_len, a.batch_size)
    what = dict(WHAT)
    nv = nvfp4_w4a4(a.samples, a.seq_len)
    if nv is not None:
        kl["nvfp4-mse-w4a4"] = nv
        what["nvfp4-mse-w4a4"] = ("NVFP4 W4A4 experts (mse, calibrated input scales), from "
                                  f"{NVFP4_W4A4.relative_to(REPO)}")
    result = {"record": record("mxfp4_quality", gpu=False), "weights": weights, "eval": kl,
              "what": what, "eval_data": {
        "source": "tests/fixtures/tiny-moe-trained", "samples": a.samples,
        "seq_len": a.seq_len, "heldout_seed": 0, "dtype": "float32", "device": "cpu",
        "candidates": CANDIDATES}}
    Path(a.out + ".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# MXFP4 block-scale rules (benchmarks/quality/mxfp4_quality.py)", "",
             "| weights | MXFP4 amax rel err | MXFP4 mse rel err | mse / amax | "
             "NVFP4 mse rel err |",
             "|---|---|---|---|---|"]
    lines += [f"| {k} | {v['rel_err_amax']:.5f} | {v['rel_err_mse']:.5f} | "
              f"{v['mse_over_amax']:.4f} | {v['nvfp4_mse_rel_err']:.5f} |"
              for k, v in weights.items()]
    lines += ["", f"`kconvert eval` on tests/fixtures/tiny-moe-trained, {a.samples} held-out "
              f"sequences of {a.seq_len}, fp32, CPU; W4A4 candidates run as served (their "
              "activations quantized by eval's emulation):", "",
              "| candidate | what | KL mean | KL p99 | top-1 | NLL |", "|---|---|---|---|---|---|"]
    lines += [f"| {k} | {what[k]} | {v['kl_mean']:.5f} | {v['kl_p99']:.4f} | "
              f"{v['top1_agreement']:.4f} | {v['nll_candidate']:.4f} |" for k, v in kl.items()]
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
