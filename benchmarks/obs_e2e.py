"""Part e2e of `python -m benchmarks obs`: the kconvert commands that run the OBS engine (RTN,
GPTQ, SparseGPT) on a full-size one-MoE-layer checkpoint, each audited, with the GPU sampled."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from benchmarks.child_process import child_env, run_child
from benchmarks.gpu_sampler import GpuSampler
from benchmarks.harness import Timer
from benchmarks.synthetic import Dims, kimi_set, random_ids, write_ids


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
