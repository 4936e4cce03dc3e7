"""Do two kconvert trees write the same bytes? Every command and recipe on the fixtures.

    git worktree add /tmp/old REV                 # (or git archive REV | tar -x -C /tmp/old)
    python scripts/compare_trees.py /tmp/old . [--device cpu|cuda] [--work DIR] [--json OUT]

Fixtures (the bundled INT4 one, a compressed-tensors INT4, a K2.5 with vision, a BF16, the trained
tiny MoE) are made once, by OLD's fixture maker, so both trees read the same inputs. Each job runs
`kconvert` from each tree in its own process (PYTHONPATH=TREE) into its own directory, then every
file of the two outputs is compared byte for byte (the manifests included: same source paths,
same options). Calibration statistics are compared the same way. Exit 0 when every job matches.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLI = "import sys; from kconvert.cli import main; sys.argv[0] = 'kconvert'; main()"
PLAN = {"layers": {"1": {"keep": [0, 2, 3, 5, 8, 9, 12, 15]},
                   "2": {"keep": [1, 2, 4, 6, 7, 10, 11, 14]}}}
TRAINED_PLAN = {"layers": {str(layer): {"keep": list(range(0, 24, 2))} for layer in (1, 2, 3)}}


def jobs(fx: dict[str, Path], w: Path) -> list[tuple[str, list[str]]]:
    """(name, arguments) of every job; {OUT} is each tree's own output directory."""
    i4, ct, k25, bf, tr = (str(fx[k]) for k in ("int4", "ct", "k25", "bf16", "trained"))
    data, plan, tplan = str(w / "data.jsonl"), str(w / "plan.json"), str(w / "trained-plan.json")
    out = "{OUT}"
    cal = ["--data", data, "--samples", "8", "--seq-len", "64"]
    return [
        ("int4-to-nvfp4-mse", ["int4-to-nvfp4", i4, out]),
        ("int4-to-nvfp4-amax", ["int4-to-nvfp4", i4, out, "--block-scale", "amax"]),
        ("int4-to-nvfp4-modelopt", ["int4-to-nvfp4", i4, out, "--format", "modelopt"]),
        ("int4-to-nvfp4-targets", ["int4-to-nvfp4", ct, out, "--targets",
                                   "experts,shared_experts,dense_mlp,attention"]),
        ("int4-to-nvfp4-k25", ["int4-to-nvfp4", k25, out]),
        ("quantize-bf16", ["quantize", bf, out]),
        ("quantize-modelopt-amax", ["quantize", bf, out, "--format", "modelopt",
                                    "--block-scale", "amax"]),
        ("dequant-bf16", ["dequant", i4, out]),
        ("dequant-f32", ["dequant", ct, out, "--dtype", "F32"]),
        ("dequant-k25", ["dequant", k25, out]),
        ("reap-plan", ["reap", i4, out, "--plan", plan]),
        ("reap-data", ["reap", tr, out, "--keep", "12", "--data", data, "--samples", "8",
                       "--seq-len", "64"]),
        ("sparsify-magnitude", ["sparsify", i4, out]),
        ("sparsify-bitmask-32", ["sparsify", i4, out, "--storage", "pair-bitmask",
                                 "--group-size", "32"]),
        ("sparsify-sparsegpt", ["sparsify", tr, out, "--method", "sparsegpt", "--data", data,
                                "--samples", "8", "--seq-len", "64"]),
        ("run-int4-p48-nvfp4", ["run", "int4-p48-nvfp4", i4, out]),
        ("run-reap-int4-to-nvfp4", ["run", "reap-int4-to-nvfp4", i4, out, "--plan", plan]),
        ("run-reap-p48-nvfp4", ["run", "reap-p48-nvfp4", tr, out, "--plan", tplan]),
        ("run-dequant", ["run", "dequant", ct, out]),
        ("int4-to-mxfp4", ["int4-to-mxfp4", i4, out]),
        ("quantize-mxfp4-ct-mse", ["quantize", bf, out, "--format", "mxfp4-pack-quantized",
                                   "--block-scale", "mse"]),
        ("quantize-gptq", ["quantize", tr, out, "--method", "gptq", "--data", data,
                           "--samples", "8", "--seq-len", "64", "--targets",
                           "experts,shared_experts,attention,dense_mlp"]),
        ("reap-compensate", ["reap", tr, out, "--keep", "12", "--data", data, "--samples", "8",
                             "--seq-len", "64", "--repair", "router", "--compensate", "down"]),
        ("calibrate", ["calibrate", tr, "--data", data, "-o", out, "--samples", "8",
                       "--seq-len", "64"]),
        *[(name, [*args[:3], *cal, *args[3:]]) for name, args in (
            ("quantize-learned", ["quantize", tr, out, "--method", "learned", "--steps", "3",
                                  "--tokens", "64"]),
            ("sparsify-learned", ["sparsify", tr, out, "--method", "learned", "--steps", "3"]),
            ("sparsify-sparsegpt-sequential", ["sparsify", tr, out, "--method", "sparsegpt",
                                               "--hessian", "sequential"]),
            ("quantize-gptq-sequential", ["quantize", tr, out, "--method", "gptq", "--hessian",
                                          "sequential"]),
            ("reap-compensate-learned", ["reap", tr, out, "--keep", "12", "--compensate",
                                         "learned"]),
            ("reap-msan-bias-shared", ["reap", tr, out, "--keep", "12", "--criterion", "msan",
                                       "--repair", "bias", "--compensate", "shared"]))],
    ]


def chained(w: Path) -> list[tuple[str, list[str]]]:
    """Jobs whose input is another job's output (in the same tree)."""
    return [
        ("densify", ["densify", "{OUT:sparsify-bitmask-32}", "{OUT}"]),
        ("sparsify-wanda", ["sparsify", str(w / "fixtures" / "trained"), "{OUT}", "--method",
                            "wanda", "--stats", "{OUT:calibrate}"]),
        ("w4a4", ["quantize", str(w / "fixtures" / "trained"), "{OUT}", "--act-stats",
                  "{OUT:calibrate}/act_stats.json"]),
    ]


def tree_env(tree: Path) -> dict[str, str]:
    """The environment that imports kconvert from `tree`, ahead of any PYTHONPATH already set
    (where carried packages live on the device machine)."""
    rest = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *([rest] if rest else [])])}


def make_fixtures(old: Path, w: Path) -> dict[str, Path]:
    fx = w / "fixtures"
    paths = {"int4": fx / "int4", "ct": fx / "ct", "k25": fx / "k25", "bf16": fx / "bf16",
             "trained": fx / "trained"}
    if not fx.is_dir():
        maker = old / "scripts" / "make_fixture.py"
        for key, variant in (("int4", "k2-int4-kimi"), ("ct", "k2-int4-ct"), ("k25", "k25-int4"),
                             ("bf16", "bf16")):
            subprocess.run([sys.executable, str(maker), str(paths[key]), "--variant", variant],
                           check=True, env=tree_env(old))
        shutil.copytree(old / "tests" / "fixtures" / "tiny-moe-trained", paths["trained"])
    text = (ROOT / "README.md").read_bytes()
    with open(w / "data.jsonl", "w") as fh:
        for i in range(16):
            fh.write(json.dumps({"input_ids": list(text[i * 64:(i + 1) * 64])}) + "\n")
    (w / "plan.json").write_text(json.dumps(PLAN))
    (w / "trained-plan.json").write_text(json.dumps(TRAINED_PLAN))
    return paths


def run(tree: Path, name: str, args: list[str], outs: dict[str, Path], device: str) -> dict:
    out = outs[name]
    argv = [a.replace("{OUT}", str(out)) for a in args]
    for other, path in outs.items():
        argv = [a.replace("{OUT:" + other + "}", str(path)) for a in argv]
    if argv[0] != "calibrate" or "--device" not in argv:
        argv += ["--device", device]
    if argv[0] != "calibrate":
        argv.append("--quiet")
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CLI, *argv], capture_output=True, text=True,
                          env=tree_env(tree), cwd=tree)
    return {"rc": proc.returncode, "s": round(time.perf_counter() - t, 2),
            "stderr": proc.stderr[-2000:] if proc.returncode else ""}


def differences(a: Path, b: Path, roots: tuple[Path, Path]) -> list[str]:
    """Relative paths whose bytes differ or that exist on one side only. A chained job's
    manifest names its input, which is its own tree's output directory: that path, and the
    run times calibration records in stats.json, are the only things allowed to differ."""
    files_a = {p.relative_to(a) for p in a.rglob("*") if p.is_file()}
    files_b = {p.relative_to(b) for p in b.rglob("*") if p.is_file()}
    out = sorted(str(p) for p in files_a ^ files_b)
    for rel in sorted(files_a & files_b):
        if filecmp.cmp(a / rel, b / rel, shallow=False):
            continue
        if rel.suffix == ".json" and _normalised(a / rel, roots[0]) == _normalised(b / rel,
                                                                                   roots[1]):
            continue
        out.append(str(rel))
    return out


def _normalised(path: Path, root: Path) -> object:
    data = json.loads(path.read_text().replace(str(root), "{OUT}"))
    if path.name == "stats.json":
        for key in ("seconds", "timing"):
            data.pop(key, None)
    return data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--work", type=Path, default=Path("/tmp/kconvert-compare"))
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    fx = make_fixtures(a.old.resolve(), a.work)
    all_jobs = jobs(fx, a.work) + chained(a.work)
    results, ok = {}, True
    trees = {"old": a.old.resolve(), "new": a.new.resolve()}
    outs = {side: {n: a.work / a.device / side / n for n, _ in all_jobs} for side in trees}
    for name, args in all_jobs:
        res = {}
        for side, tree in trees.items():
            if outs[side][name].exists():
                shutil.rmtree(outs[side][name])
            res[side] = run(tree, name, args, outs[side], a.device)
        roots = (a.work / a.device / "old", a.work / a.device / "new")
        diff = (differences(outs["old"][name], outs["new"][name], roots)
                if res["old"]["rc"] == res["new"]["rc"] == 0 else ["(a run failed)"])
        res["differ"] = diff
        results[name] = res
        ok &= not diff
        verdict = "identical" if not diff else "DIFFER: " + ", ".join(diff[:4])
        print(f"{name:28s} old {res['old']['rc']} ({res['old']['s']} s)  new "
              f"{res['new']['rc']} ({res['new']['s']} s)  {verdict}", flush=True)
        for side in trees:
            if res[side]["rc"]:
                print(f"  {side}: {res[side]['stderr']}", flush=True)
    summary = {"device": a.device, "old": str(trees["old"]), "new": str(trees["new"]),
               "jobs": len(results), "identical": sum(not r["differ"] for r in results.values()),
               "results": results}
    if a.json:
        a.json.write_text(json.dumps(summary, indent=1))
    print(f"{summary['identical']}/{summary['jobs']} jobs byte-identical")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
