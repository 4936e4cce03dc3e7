"""Benchmark: every GPU command on the full-size one-MoE-layer set, at the default GPU memory
budget and under --gpu-memory 40GiB (issue 26: one budget for every GPU command).

    python3 scripts/bench_gpu_memory.py /tmp/kbench-out/bench_gpu_memory.json   # H100
    python3 scripts/bench_gpu_memory.py --tiny /tmp/gpu_memory_tiny.json        # CPU check

On one H100 the whole bench takes about 8-10 minutes (the set ~1.5 min once, SparseGPT's OBS
stage ~1.5 min at the default budget and longer under 40 GiB, where it solves fewer experts per
batch); to stay within a 6-minute call, run it twice on the same machine, the second reusing
the set: BUDGETS=40GiB, then BUDGETS=default (each writes its own JSON).

Builds (or reuses, in $ROOT/calib-src) bench_calibrate's full-size synthetic Kimi checkpoint
(layer 0 dense, layer 1 MoE with 384 INT4 experts) and SEQS (32) random sequences of SEQ (2048)
tokens, then runs, each in its own process through the command line at its default options:
  calibrate, eval (SRC against itself), reap --data --prune-ratio 0.5,
  sparsify --pattern p48 --method sparsegpt, and quantize --method gptq where this kconvert has
  it; once per budget in BUDGETS ("40GiB,default": the tight one first). Per run: exit code,
  wall seconds, the budget the command resolved, torch.cuda.max_memory_reserved() and
  max_memory_allocated() of the command's process (read at its exit), whether the peak reserved
  is within the budget, nvidia-smi's peak memory.used, and the command's notes and error line.
The JSON is rewritten after every run (an interrupted bench keeps what it measured). Env:
ROOT (/tmp/kbench), SEQS, SEQ, BUDGETS, COMMANDS (comma list of the names above), TIMEOUT
(per run, 400 s).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

ROOT = Path(os.environ.get("ROOT", "/tmp/kbench"))
GIB = 1 << 30


def child(peak_file: str, argv: list[str]) -> None:
    """Run `kconvert ARGV` in this process; at exit, write the budget it resolved and torch's
    peak reserved/allocated GPU memory to `peak_file`."""
    import torch

    from kconvert.gpu_budget import resolve

    info: dict = {}
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        spec = argv[argv.index("--gpu-memory") + 1] if "--gpu-memory" in argv else None
        info["budget"] = resolve(dev, spec)
        info["card_bytes"] = torch.cuda.get_device_properties(dev).total_memory

    def record() -> None:
        if torch.cuda.is_available():
            info["max_memory_reserved"] = torch.cuda.max_memory_reserved()
            info["max_memory_allocated"] = torch.cuda.max_memory_allocated()
        Path(peak_file).write_text(json.dumps(info))

    atexit.register(record)
    from kconvert.cli import main as kconvert

    kconvert(argv, prog_name="kconvert")


def run(name: str, argv: list[str], budget: str, timeout: float) -> dict:
    from bench_sparsegpt import GpuSampler

    peak_file = ROOT / f"peak-{name}.json"
    peak_file.unlink(missing_ok=True)
    if budget != "default":
        argv = [*argv, "--gpu-memory", budget]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE.parent), *filter(None, [os.environ.get("PYTHONPATH")])])}
    t0 = time.perf_counter()
    with GpuSampler() as gpu:
        try:
            res = subprocess.run([sys.executable, __file__, "--child", str(peak_file), "--",
                                  *argv], capture_output=True, text=True, env=env,
                                 timeout=timeout)
            code, out = res.returncode, res.stdout + res.stderr
        except subprocess.TimeoutExpired as exc:
            code, out = "timeout", str(exc.stdout or "") + str(exc.stderr or "")
    wall = round(time.perf_counter() - t0, 1)
    peak = json.loads(peak_file.read_text()) if peak_file.is_file() else {}
    lines = [ln for ln in out.splitlines() if ln.startswith(("kconvert: error", "note:"))
             or "Traceback" in ln or "internal error" in ln]
    got = {"command": name, "budget_option": budget, "exit_code": code, "wall_s": wall,
           **peak, "notes": lines[-6:], **gpu.summary()}
    if "budget" in peak and "max_memory_reserved" in peak:
        got["within_budget"] = peak["max_memory_reserved"] <= peak["budget"]
        got["peak_reserved_gib"] = round(peak["max_memory_reserved"] / GIB, 2)
        got["budget_gib"] = round(peak["budget"] / GIB, 2)
    if code != 0:
        got["output_tail"] = out[-2000:]
    return got


def has_gptq() -> bool:
    res = subprocess.run([sys.executable, "-m", "kconvert.cli", "quantize", "--help"],
                         capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    return "gptq" in res.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="JSON results file")
    ap.add_argument("--tiny", action="store_true", help="the tiny fixture on the CPU (a check)")
    args = ap.parse_args()
    import torch

    ROOT.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.tiny:
        from kconvert.testing.fixture_weights import FixtureDims
        from kconvert.testing.fixtures import make_fixture

        src = make_fixture(ROOT / "gpu-memory-tiny", "k2-int4-kimi", FixtureDims())
        seqs, seq, vocab, device = 4, 32, FixtureDims().vocab, ["--device", "cpu"]
    else:
        import bench_calibrate

        src = ROOT / "calib-src"
        if not (src / "config.json").exists():
            bench_calibrate.make_checkpoint(src)
        seqs, seq = int(os.environ.get("SEQS", 32)), int(os.environ.get("SEQ", 2048))
        vocab, device = bench_calibrate.V, []
    make_s = round(time.perf_counter() - t0, 1)
    ids = torch.randint(0, vocab, (seqs, seq), generator=torch.Generator().manual_seed(0))
    data = ROOT / "gpu-memory.jsonl"
    data.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in ids.tolist()))
    d = ["--data", str(data), "--seq-len", str(seq)]
    out_dir = ROOT / "gpu-memory-out"
    commands = {
        "calibrate": ["calibrate", str(src), *d, "-o", str(out_dir / "stats"), "--overwrite",
                      "--quiet"],
        "eval": ["eval", str(src), str(src), *d, "--quiet"],
        "reap": ["reap", str(src), str(out_dir / "reap"), *d, "--prune-ratio", "0.5",
                 "--overwrite", "--quiet"],
        "sparsify": ["sparsify", str(src), str(out_dir / "sparsify"), "--pattern", "p48",
                     "--method", "sparsegpt", *d, "--overwrite", "--quiet"],
    }
    if has_gptq():
        commands["quantize-gptq"] = ["quantize", str(src), str(out_dir / "gptq"), "--method",
                                     "gptq", *d, "--overwrite", "--quiet"]
    wanted = os.environ.get("COMMANDS")
    if wanted:
        commands = {k: v for k, v in commands.items() if k in wanted.split(",")}
    budgets = os.environ.get("BUDGETS", "default" if args.tiny else "40GiB,default").split(",")
    result: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available()
                    else "cpu", "make_s": make_s, "seqs": seqs, "seq_len": seq,
                    "gptq": "quantize-gptq" in commands, "runs": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for budget in budgets:
        for name, argv in commands.items():
            got = run(name, [*argv, *device], budget, float(os.environ.get("TIMEOUT", 400)))
            result["runs"].append(got)
            out.write_text(json.dumps(result, indent=1))
            print(f"{name:<14} {budget:<8} exit {got['exit_code']} {got['wall_s']:>7} s  "
                  f"peak reserved {got.get('peak_reserved_gib', '-')} of "
                  f"{got.get('budget_gib', '-')} GiB  within {got.get('within_budget', '-')}",
                  flush=True)
    shutil.rmtree(out_dir, ignore_errors=True)
    ok = all(r["exit_code"] == 0 and r.get("within_budget", True) for r in result["runs"])
    result["all_passed"] = ok
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}: {'every run completed within its budget' if ok else 'FAILURES'}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[4:])
    else:
        main()
