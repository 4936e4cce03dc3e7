"""Every recipe's quality in one table: each output made through the command line's default
path from one source, then compared with it by `kconvert eval` on held-out text (issue 46).

Each row is a chain of `kconvert` commands (the last one's output is the candidate; a
composition such as REAP 192 + GPTQ NVFP4 is two commands, as a user runs them). Per row, in
one `kconvert eval` of the source and the row's output: KL, top-1, ΔNLL and the KL on the
source's 10% highest-entropy positions, and with --generate N the degeneration probe (loop
rate, its z and p against the source's, length-limit rate, median divergence); the output's
bytes and the chain's wall time; with --repeat whether a second run wrote the same bytes, with
--audit whether `kconvert audit --source` passes. Keeps are fractions of the source's routed
experts (keep 288 and 192 of Kimi's 384: 75% and 50%). --jobs runs rows side by side (each
row's commands stay in order); --rows picks rows, so the table can be made in parts and joined
with --merge, which also judges the issue's goals (`goals`).

    python -m benchmarks quality_lab --src tests/fixtures/kimi-proxy --calib calib.jsonl \\
        --heldout heldout.jsonl --device cuda --generate 1000 --repeat --audit --jobs 6
    python -m benchmarks quality_lab --merge part1.json part2.json --out results/quality_lab
    python -m benchmarks quality_lab --tiny     # CPU check on the trained tiny MoE, 3 rows

--calib and --heldout are JSONL files as every data-driven command reads them (token ids, or
text lines with the source's tokenizer); without them the trained tiny MoE's byte corpus is
used (training and held-out windows, kconvert.testing.tiny_moe). Writes OUT.json (every
figure and the commands) and the table beside it in Markdown (suffix .md).
"""

from __future__ import annotations

import filecmp
import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import REPO, arguments, comma_list, log, parse, record, save
from benchmarks.quality.quality_table import goals, merge, table

TINY_MOE = REPO / "tests" / "fixtures" / "tiny-moe-trained"
CLI = [sys.executable, "-m", "kconvert.cli"]


@dataclass(frozen=True)
class Row:
    name: str
    what: str
    chain: tuple[tuple[str, ...], ...]  # commands; {SRC} the previous output, {OUT} this one's
    deterministic: bool = True


def rows(experts: int) -> list[Row]:
    """Every row of the table for a source of `experts` routed experts per MoE layer."""
    k75, k50 = experts * 3 // 4, experts // 2
    data = ("--data", "{CALIB}")
    nvfp4 = ("quantize", "{SRC}", "{OUT}")  # any source (INT4 as Kimi ships, or BF16)
    out: list[Row] = [
        Row("nvfp4-rtn", "NVFP4 W4A16, round to nearest (mse block scales)", (nvfp4,)),
        Row("nvfp4-gptq", "NVFP4 W4A16 by GPTQ", ((*nvfp4, "--method", "gptq", *data),)),
        Row("nvfp4-learned", "NVFP4 W4A16, learned", ((*nvfp4, "--method", "learned", *data),)),
    ]
    out += [Row(f"w4a4-{policy}", f"NVFP4 W4A4, --input-scale {policy}",
                ((*nvfp4, "--act-stats", "{STATS}/act_stats.json", "--input-scale", policy),))
            for policy in ("expert", "layer-max", "headroom")]
    out.append(Row("mxfp4", "MXFP4 (compressed-tensors mxfp4-pack-quantized)",
                   (("quantize", "{SRC}", "{OUT}", "--format", "mxfp4-pack-quantized"),)))
    out.append(Row("mxfp4-exact-cast", "the exact cast of the MXFP4 twin to NVFP4", (
        ("quantize", "{SRC}", "{OUT}", "--format", "mxfp4-pack-quantized"),
        ("mxfp4-to-nvfp4", "{SRC}", "{OUT}"))))
    sparse = ("sparsify", "{SRC}", "{OUT}", "--method")
    out += [Row("p48-magnitude", "p48 magnitude + NVFP4", ((*sparse, "magnitude"),)),
            Row("p48-wanda", "p48 Wanda + NVFP4", ((*sparse, "wanda", "--stats", "{STATS}"),)),
            Row("p48-sparsegpt", "p48 SparseGPT + NVFP4", ((*sparse, "sparsegpt", *data),)),
            Row("p48-learned", "p48 learned + NVFP4", ((*sparse, "learned", *data),))]
    for keep in (k75, k50):
        reap = ("reap", "{SRC}", "{OUT}", "--keep", str(keep), *data)
        for criterion in ("reap", "frequency"):
            out.append(Row(f"reap{keep}-{criterion}", f"REAP keep {keep}/{experts} by "
                           f"{criterion}", ((*reap, "--criterion", criterion),)))
        for repair, compensate in (("router", "none"), ("none", "down"), ("router", "down"),
                                   ("router", "learned")):
            out.append(Row(f"reap{keep}-{repair}-{compensate}",
                           f"REAP keep {keep}, --repair {repair} --compensate {compensate}",
                           ((*reap, "--repair", repair, "--compensate", compensate),)))
    best = ("reap", "{SRC}", "{OUT}", "--keep", str(k50), *data, "--repair", "router",
            "--compensate", "down")
    out += [Row("reap-gptq", f"REAP keep {k50} (router+down), then GPTQ NVFP4",
                (best, (*nvfp4, "--method", "gptq", *data))),
            Row("reap-learned-learned", f"REAP keep {k50} (router+learned), then learned NVFP4",
                ((*best[:-1], "learned"), (*nvfp4, "--method", "learned", *data))),
            Row("reap-p48-sparsegpt", f"REAP keep {k50} (router+down), then p48 SparseGPT",
                (best, (*sparse, "sparsegpt", *data))),
            Row("reap-p48-learned", f"REAP keep {k50} (router+learned), then p48 learned",
                ((*best[:-1], "learned"), (*sparse, "learned", *data)))]
    # Restoring pruned experts: keeps between 50% and all, the best repair, for the smallest
    # keep whose loop rate is not significantly above the source's.
    # (of 24 experts: keep 15 and 21, which no common expert-parallel size divides; measured
    # for quality, not served: --allow-uneven-ep)
    for keep in sorted({experts * 5 // 8, experts * 7 // 8}):
        out.append(Row(f"reap{keep}-router-down", f"REAP keep {keep}, router+down",
                       ((*best[:4], str(keep), *best[5:], "--allow-uneven-ep"),)))
    return out


def run_chain(row: Row, src: Path, out: Path, values: dict[str, str], common: list[str]
              ) -> tuple[float, list[list[str]]]:
    """Runs the row's commands (the last writes `out`); its wall seconds and command lines."""
    shutil.rmtree(out, ignore_errors=True)
    prev, lines, start = src, [], time.perf_counter()
    for i, step in enumerate(row.chain):
        dst = out if i == len(row.chain) - 1 else step_dir(out, i)
        args = [a.format(SRC=prev, OUT=dst, **values) for a in step]
        lines.append(args)
        cli([*args, "--overwrite", "--quiet", *common], f"{row.name}: {' '.join(args)}")
        prev = dst
    return time.perf_counter() - start, lines


def step_dir(out: Path, i: int) -> Path:
    return out.with_name(f"{out.name}.step{i}")


def cli(args: list[str], what: str) -> str:
    """`kconvert ARGS`; its stdout, or an error naming `what` with the end of its stderr."""
    done = subprocess.run([*CLI, *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{what} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done.stdout


def same_tree(a: Path, b: Path) -> bool:
    """Every file of the two outputs equal byte for byte (the manifests name their own
    directories, so they are compared without it)."""
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    if files != sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file()):
        return False
    return all(filecmp.cmp(a / f, b / f, shallow=False) for f in files
               if f.name != "kconvert-manifest.json")


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def default_data(root: Path, calib: int, heldout: int, seq_len: int) -> tuple[Path, Path]:
    """The trained tiny MoE's byte corpus: training windows to calibrate on, held-out windows
    to evaluate on."""
    import torch

    from kconvert.testing.tiny_moe import corpus_ids, heldout_ids, windows

    paths = []
    for name, ids in (("calib", windows(corpus_ids("train"), calib, seq_len,
                                        torch.Generator().manual_seed(0))),
                      ("heldout", heldout_ids(heldout * seq_len, seed=0,
                                              window=seq_len).reshape(heldout, seq_len))):
        path = root / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"input_ids": r.tolist()}) + "\n" for r in ids))
        paths.append(path)
    return paths[0], paths[1]


def evaluate(src: Path, cand: Path, heldout: Path, out: Path, a) -> dict:
    """One `kconvert eval` of the source and one candidate on the held-out data, with the
    probe where --generate is given: its eval.json."""
    probe = [] if not a.generate else [
        "--generate", str(a.generate), "--new-tokens", str(a.new_tokens),
        "--generate-batch-size", str(a.generate_batch_size)]
    shutil.rmtree(out, ignore_errors=True)
    cli(["eval", str(src), str(cand), "--data", str(heldout), "--seq-len", str(a.seq_len),
         "--samples", str(a.eval_samples), "--device", a.device, *a.gpu_memory, *probe,
         "-o", str(out), "--quiet"], f"eval of {cand.name}")
    return json.loads((out / "eval.json").read_text())


def measure(row: Row, a, values: dict[str, str], heldout: Path) -> dict:
    """One row: its chain (twice with --repeat), the audit of its last command with --audit,
    and the eval of its output against the source. Its outputs are removed after, unless
    --keep-outputs."""
    out = a.root / row.name
    takes_data = any("{CALIB}" in step for step in row.chain)
    opts = ["--device", a.device, *a.gpu_memory] + (
        ["--samples", str(a.samples), "--seq-len", str(a.seq_len)] if takes_data else [])
    wall, lines = run_chain(row, a.src, out, values, opts)
    log(f"{row.name}: made in {wall:.1f} s")
    same = None
    if a.repeat and row.deterministic:
        again = out.with_name(out.name + ".again")
        run_chain(row, a.src, again, values, opts)
        same = same_tree(out, again)
    audited = None
    if a.audit:
        last_src = a.src if len(row.chain) == 1 else step_dir(out, len(row.chain) - 2)
        audited = subprocess.run([*CLI, "audit", str(out), "--source", str(last_src)],
                                 capture_output=True).returncode == 0
    report = evaluate(a.src, out, heldout, a.root / f"eval-{row.name}", a)
    made = report["candidates"][0]
    result = {"row": row.name, "what": row.what, "commands": lines, "wall_s": round(wall, 2),
              "bytes": tree_bytes(out), "same_bytes": same, "audit": audited,
              "logits": made["logits"], "generation": report.get("generation")}
    g = result["generation"]
    log(f"{row.name}: KL {made['logits']['kl_mean']:.4g}" + (
        "" if not g else f", loop rate {g['candidate']['loop_rate']:.3f} against the source's "
        f"{g['source']['loop_rate']:.3f}, p {g['p']:.3g}") + f", same bytes {same}, audit "
        f"{audited}")
    if not a.keep_outputs:
        # this row's directories only: another row's name may start with this one's
        for path in [out, out.with_name(out.name + ".again"), a.root / f"eval-{row.name}",
                     *(step_dir(d, i) for d in (out, out.with_name(out.name + ".again"))
                       for i in range(len(row.chain)))]:
            shutil.rmtree(path, ignore_errors=True)
    return result


def main(argv: list[str]) -> None:
    ap = arguments("quality_lab", __doc__, root="/tmp/quality-lab")
    ap.add_argument("--src", type=Path, default=TINY_MOE, help="the source checkpoint")
    ap.add_argument("--calib", type=Path, help="calibration JSONL (default: tiny corpus)")
    ap.add_argument("--heldout", type=Path, help="held-out JSONL (default: tiny corpus)")
    ap.add_argument("--rows", type=comma_list, help="only these rows (comma list)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--gpu-memory", help="every command's --gpu-memory (rows run side by side "
                                         "share one GPU)")
    ap.add_argument("--jobs", type=int, default=1, help="rows run side by side")
    ap.add_argument("--samples", type=int, default=64, help="calibration sequences")
    ap.add_argument("--eval-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--generate", type=int, default=0, help="eval --generate N (0: none)")
    ap.add_argument("--new-tokens", type=int, default=192, help="eval --new-tokens")
    ap.add_argument("--generate-batch-size", type=int, default=16)
    ap.add_argument("--repeat", action="store_true", help="run each row twice: same bytes?")
    ap.add_argument("--audit", action="store_true", help="audit --source each output")
    ap.add_argument("--keep-outputs", action="store_true", help="keep each row's checkpoints")
    ap.add_argument("--merge", type=Path, nargs="+", help="join these results files (parts "
                    "of one table, the same source and data) instead of running rows")
    ap.add_argument("--tiny", action="store_true", help="CPU check: 3 rows, little data")
    ap.add_argument("--out", type=Path, default=Path("/tmp/quality-lab/quality_lab"),
                    help="OUT.json and the Markdown table beside it are written")
    a = parse(ap, argv, tiny={"rows": ["nvfp4-rtn", "reap12-router-down", "reap-gptq"],
                              "samples": 8, "eval_samples": 8, "seq_len": 64, "generate": 8,
                              "new_tokens": 32, "jobs": 2})
    result = merge([json.loads(p.read_text()) for p in a.merge]) if a.merge else run_rows(a)
    order = [r.name for r in rows(result["experts"])]
    result["rows"].sort(key=lambda r: order.index(r["row"]))
    result["goals"] = goals(result["rows"], result["experts"])
    save(result, a.out.with_suffix(".json"))
    lines = table(result)
    a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def run_rows(a) -> dict:
    """The chosen rows, --jobs at a time, after one calibration their options may read."""
    a.root.mkdir(parents=True, exist_ok=True)
    a.gpu_memory = [] if a.gpu_memory is None else ["--gpu-memory", a.gpu_memory]
    experts = json.loads((a.src / "config.json").read_text())["n_routed_experts"]
    chosen = [r for r in rows(experts) if a.rows is None or r.name in a.rows]
    if a.rows is not None and len(chosen) != len(a.rows):
        unknown = sorted(set(a.rows) - {r.name for r in chosen})
        raise SystemExit(f"quality_lab: no row named {', '.join(unknown)}")
    calib, heldout = (a.calib, a.heldout) if a.calib else default_data(
        a.root, a.samples, a.eval_samples, a.seq_len)
    stats = a.root / "stats"
    cli(["calibrate", str(a.src), "--data", str(calib), "--samples", str(a.samples),
         "--seq-len", str(a.seq_len), "-o", str(stats), "--overwrite", "--quiet", "--device",
         a.device, *a.gpu_memory], "calibrate")
    values = {"CALIB": f"{calib}", "STATS": str(stats)}
    head = {"record": record("quality_lab", gpu=a.device != "cpu"), "source": str(a.src),
            "experts": experts, "calib": str(calib), "heldout": str(heldout),
            "samples": a.samples, "eval_samples": a.eval_samples, "seq_len": a.seq_len,
            "generate": a.generate, "new_tokens": a.new_tokens}

    def one(row: Row) -> dict:
        # each row's figures saved as it ends: a part --merge can join if the run is cut short
        made = measure(row, a, values, heldout)
        save(head | {"rows": [made]}, a.out.with_name(f"{a.out.name}.row-{row.name}.json"))
        return made

    # the longest rows first (learned methods, then chains), so side-by-side jobs end together
    chosen.sort(key=lambda r: (-sum("learned" in step for step in r.chain), -len(r.chain)))
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        done = list(pool.map(one, chosen))
    log(f"{len(done)} rows in {time.perf_counter() - start:.0f} s, {a.jobs} at a time")
    return head | {"rows": done}
