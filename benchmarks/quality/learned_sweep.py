"""The learned method's steps and learning rates on the trained tiny MoE (how its defaults were
chosen, docs/learned.md "Steps and tokens"): each configuration converted in this process
through the Python API with the method's class settings overridden, all compared with the source
by one `kconvert eval` on held-out text (fp32, CPU). Calibration and held-out text as
`learned_quality`'s.

    python -m benchmarks learned_sweep --out benchmarks/results/learned_sweep_tiny_moe \\
        sparsify:learned:steps=25:lr=4e-2:mask_lr=2e-2 quantize:gptq ...

A configuration is COMMAND:METHOD[:KEY=VALUE...]; keys steps and tokens are the method's
options, lr and mask_lr its class settings (kconvert.methods.learned). Writes the table and
the numbers at OUT with the suffixes .md and .json.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import kconvert
from benchmarks.harness import REPO, arguments, record
from benchmarks.quality.reap_quality import CALIB, FIXTURES, HELD, SEQ, write_data
from kconvert.methods import learned

CLASS_SETTINGS = ("lr", "mask_lr")


def run(spec: str, src: Path, calib: Path, out: Path) -> dict:
    command, method, *pairs = spec.split(":")
    options, overrides = {}, {}
    for pair in pairs:
        key, value = pair.split("=")
        if key in CLASS_SETTINGS:
            overrides[key] = float(value)
        else:
            options[key] = int(value)
    saved = {c: {k: getattr(c, k) for k in CLASS_SETTINGS}
             for c in (learned.LearnedP48, learned.LearnedNvfp4)}
    for cls in saved:
        for key, value in overrides.items():
            setattr(cls, key, value)
    try:
        start = time.perf_counter()
        getattr(kconvert, command)(str(src), str(out), method=method, data=str(calib),
                                   samples=CALIB, seq_len=SEQ, device="cpu", **options)
        seconds = time.perf_counter() - start
    finally:
        for cls, values in saved.items():
            for key, value in values.items():
                setattr(cls, key, value)
    return {"config": spec, "seconds": round(seconds, 1), "dir": str(out)}


def main(argv: list[str]) -> None:
    ap = arguments("learned_sweep", __doc__)
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--fixture", default="trained", choices=list(FIXTURES))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" /
                                         "learned_sweep_tiny_moe"))
    a = ap.parse_args(argv)
    rec = record("learned_sweep", gpu=False)
    src = FIXTURES[a.fixture]
    with tempfile.TemporaryDirectory() as tmp:
        calib, held = write_data(Path(tmp))
        made = [run(spec, src, calib, Path(tmp) / f"c{i}") for i, spec in enumerate(a.configs)]
        report = kconvert.eval(str(src), [m["dir"] for m in made], str(held), samples=HELD,
                               seq_len=SEQ, device="cpu", dtype="float32", quiet=True,
                               echo=lambda _line: None)
    lines = ["| configuration | KL | top-1 | s |", "|---|---|---|---|"]
    for m, c in zip(made, report.candidates, strict=True):
        m.update(kl=c.logits.kl_mean, top1=c.logits.top1_agreement)
        lines.append(f"| {m['config']} | {m['kl']:.5f} | {m['top1']:.4f} | {m['seconds']} |")
    out = Path(a.out)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"record": rec, "fixture": a.fixture,
                                                    "results": made}, indent=1) + "\n")
    print("\n".join(lines))
