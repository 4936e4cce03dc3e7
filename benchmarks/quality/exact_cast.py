"""The exact MXFP4 -> NVFP4 cast measured on the trained tiny MoE (issue 37): `kconvert eval`
KL of `mxfp4-to-nvfp4` (both NVFP4 formats) against its MXFP4 source, and of each against the
BF16 model, beside NVFP4 quantized from BF16 directly; each cast's exact blocks as
`audit --source` counts them.

The MXFP4 source is the tiny MoE's routed experts by `quantize --format mxfp4-pack-quantized`
(compressed-tensors' layout, K3's; amax rule) and by `--format quark-mxfp4` (AMD's), both
weight-only (`--activations none`: the cast is W4A16, and Quark's W4A4 default would make the
source's activations 4-bit too); eval in fp32 on the CPU on held-out windows, as
benchmarks/quality/eval_pipelines.py measures.

    python -m benchmarks exact_cast [--samples 64] [--seq-len 256]
        [--out benchmarks/results/exact_cast_tiny_moe]   # -> .json and .md
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spin-waiting threads on a shared CPU

import torch

from benchmarks.harness import REPO, Timer, arguments, record
from kconvert.audit.auditor import run_audit
from kconvert.driver.convert import RunControl, convert
from kconvert.driver.recipes import load_recipe
from kconvert.evaluate.run import evaluate
from kconvert.io.checkpoint import open_checkpoint
from kconvert.testing.tiny_moe import heldout_ids

SRC = REPO / "tests" / "fixtures" / "tiny-moe-trained"
LAYOUTS = ("mxfp4-pack-quantized", "quark-mxfp4")
FORMATS = ("compressed-tensors", "modelopt")


def evaluated(source: Path, candidates: dict[str, Path], held: torch.Tensor, batch: int
              ) -> dict[str, dict]:
    """name -> eval's logits comparison of each candidate against `source`."""
    opened = [open_checkpoint(str(p)) for p in (source, *candidates.values())]
    try:
        report = evaluate(opened[0], opened[1:], held, "cpu", batch, dtype=torch.float32,
                          labels=list(candidates), quiet=True)
    finally:
        for c in opened:
            c.close()
    return {c.candidate: c.logits.model_dump(mode="json") for c in report.candidates}


def main(argv: list[str]) -> None:
    ap = arguments("exact_cast", __doc__)
    ap.add_argument("--samples", type=int, default=64, help="held-out sequences")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" /
                                         "exact_cast_tiny_moe"))
    a = ap.parse_args(argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    timer = Timer()
    held = heldout_ids(a.samples * a.seq_len, seed=0, window=a.seq_len).reshape(-1, a.seq_len)
    quiet = RunControl(quiet=True)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="exact-cast-") as tmp:
        root = Path(tmp)
        convert(str(SRC), str(root / "nvfp4"), load_recipe("quantize"), {}, quiet)
        for layout in LAYOUTS:
            mx = root / layout
            convert(str(SRC), str(mx), load_recipe("quantize"),
                    {"format": layout, "block_scale": "amax", "activations": "none"}, quiet)
            casts = {}
            for fmt in FORMATS:
                casts[f"{layout} -> {fmt}"] = root / f"{layout}-{fmt}"
                convert(str(mx), str(casts[f"{layout} -> {fmt}"]),
                        load_recipe("mxfp4-to-nvfp4"), {"format": fmt}, quiet)
            vs_mx = evaluated(mx, casts, held, a.batch_size)
            vs_bf16 = evaluated(SRC, {layout: mx, **casts}, held, a.batch_size)
            for name, path in casts.items():
                audit = run_audit(path, source=str(mx), device="cpu")
                results[name] = {"kl_vs_mxfp4": vs_mx[name], "kl_vs_bf16": vs_bf16[name],
                                 "audit_passed": audit.passed, "audit_notes": audit.notes}
            results[layout] = {"kl_vs_bf16": vs_bf16[layout]}
        results["nvfp4 (from BF16, mse)"] = {
            "kl_vs_bf16": evaluated(SRC, {"nvfp4": root / "nvfp4"}, held,
                                    a.batch_size)["nvfp4"]}
    rows = ["| candidate | KL vs its MXFP4 source | top-1 vs source | KL vs BF16 | top-1 vs BF16 "
            "| audit --source |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        mx, bf = r.get("kl_vs_mxfp4"), r["kl_vs_bf16"]
        cast = ("-" if "audit_notes" not in r else
                ("pass; " if r["audit_passed"] else "FAIL; ") + " ".join(r["audit_notes"]))
        vs_source = (f"{mx['kl_mean']:.6f} | {mx['top1_agreement']:.4f}" if mx else "- | -")
        rows.append(f"| {name} | {vs_source} | {bf['kl_mean']:.6f} | "
                    f"{bf['top1_agreement']:.4f} | {cast} |")
    md = ["# The exact MXFP4 -> NVFP4 cast on the trained tiny MoE", "",
          f"Source: tests/fixtures/tiny-moe-trained (BF16), routed experts quantized to MXFP4 "
          f"(amax rule) in each layout, then `kconvert mxfp4-to-nvfp4` in each NVFP4 format; "
          f"eval in fp32 on the CPU on {a.samples} held-out sequences of {a.seq_len} bytes. "
          f"Made by `python -m benchmarks exact_cast --samples {a.samples} --seq-len "
          f"{a.seq_len}`: {timer.elapsed():.0f} s.", "", *rows, ""]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(md))
    out.with_suffix(".json").write_text(json.dumps(
        {"record": record("exact_cast", gpu=False), "settings": vars(a) | {"out": None},
         "results": results}, indent=1) + "\n")
    print("\n".join(md))
