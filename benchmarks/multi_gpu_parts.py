"""The parts of `python -m benchmarks multi_gpu` (calibrate, gptq, reap, reap-learned, eval,
convert), each on
every rank count, and their checks against one rank: scaling efficiency, statistics, bytes,
kept experts and metrics."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from benchmarks.multi_gpu_ranks import Bench
from benchmarks.outputs import compare_dirs, same_output
from benchmarks.synthetic import random_ids, sharded_expert_set, write_ids


def stats_difference(a: Path, b: Path) -> dict:
    from safetensors.torch import load_file

    one, many = load_file(str(a / "stats.safetensors")), load_file(str(b / "stats.safetensors"))
    if sorted(one) != sorted(many):
        return {"same_names": False}
    worst, equal = 0.0, 0
    for name, t in one.items():
        equal += bool(t.equal(many[name]))
        t, u = t.double(), many[name].double()
        worst = max(worst, float(((t - u).abs() / t.abs().clamp_min(1e-30)).max()))
    return {"same_names": True, "max_rel_diff": worst, "bit_equal": equal, "tensors": len(one)}


def differences(a: Path, b: Path) -> dict:
    """Which files of two outputs differ: the manifest's differing keys, per shard how many
    tensors differ and one of them."""
    found = compare_dirs(a, b)
    brief = {}
    for name, what in found["different"].items():
        if isinstance(what, dict):
            first = next(iter(what))
            what = {"tensors_differ": len(what), "first": first, "detail": what[first]}
        brief[name] = what
    return {"files": found["files"], "identical": found["identical"], "different": brief}


def largest_difference(one: object, many: object) -> float:
    """The largest relative difference between the numbers of two reports of the same shape."""
    if isinstance(one, dict):
        return max((largest_difference(one[k], many[k]) for k in one if k in many), default=0.0)
    if isinstance(one, (list, tuple)):
        return max((largest_difference(a, b) for a, b in zip(one, many, strict=True)), default=0.0)
    if isinstance(one, (int, float)) and isinstance(many, (int, float)) and one != many:
        return abs(one - many) / max(abs(one), abs(many), 1e-30)
    return 0.0


def scaling(runs: dict[int, dict]) -> None:
    """Per run of N > 1 ranks: efficiency t1 / (N tN) of the MoE layer, of the process and of
    learned compensation (where it ran), and whether it beat one rank."""
    one = runs.get(1)
    for ranks, r in runs.items():
        if ranks == 1 or one is None or r["rc"] or one["rc"]:
            continue
        for key in ("moe_layer_s", "wall_s", "learned_s"):
            if one.get(key) and r.get(key):
                r[f"efficiency_{key.removesuffix('_s')}"] = round(one[key] / (ranks * r[key]), 3)
        r["faster_than_one"] = r["wall_s"] < one["wall_s"]


def data_file(b: Bench, seqs: int) -> Path:
    data = b.root / f"ids-{seqs}x{b.seq}.jsonl"
    if not data.exists():
        write_ids(data, random_ids(seqs, b.seq, b.dims.vocab))
    return data


def calib_args(b: Bench, seqs: int) -> list[str]:
    return ["--data", str(data_file(b, seqs)), "--samples", str(seqs), "--seq-len", str(b.seq),
            "--batch-size", str(b.batch), "--device", b.dev, "-v"]


def part_calibrate(b: Bench, src: Path) -> None:
    for label, seqs in b.tokens.items():
        runs = b.each_rank_count(f"calibrate {label}", lambda ranks, label=label, seqs=seqs: b.run(
            ranks, ["calibrate", str(src), "-o", str(b.root / f"stats-{label}-{ranks}"),
                    "--overwrite", *calib_args(b, seqs)]))
        scaling(runs)
        for ranks, r in runs.items():
            if ranks > 1 and r["rc"] == 0 and runs.get(1, {}).get("rc") == 0:
                r["statistics"] = stats_difference(b.root / f"stats-{label}-1",
                                                   b.root / f"stats-{label}-{ranks}")
        b.res["calibrate"][label] = {"tokens": seqs * b.seq, "runs": list(runs.values())}
        b.save()


def part_same_bytes(b: Bench, name: str, seqs: int, command) -> None:
    """`command(dst)` with --quiet and the calibration on `seqs` sequences, on every rank count
    (each into its own DST, removed after): scaling, and the output's bytes against one
    rank's."""
    outs = {}

    def run(ranks: int) -> dict:
        dst = outs[ranks] = b.root / f"{name}-{ranks}"
        shutil.rmtree(dst, ignore_errors=True)
        return b.run(ranks, [*command(dst), "--quiet", *calib_args(b, seqs)])

    runs = b.each_rank_count(name, run)
    scaling(runs)
    for ranks, r in runs.items():
        if ranks > 1 and r["rc"] == 0 and runs.get(1, {}).get("rc") == 0:
            r["same_bytes"] = same_output(outs[1], outs[ranks])
            if r["same_bytes"] is not True:
                r["differences"] = differences(outs[1], outs[ranks])
    for dst in outs.values():
        shutil.rmtree(dst, ignore_errors=True)
    b.res[name] = {"tokens": seqs * b.seq, "runs": list(runs.values())}
    b.save()


def part_gptq(b: Bench, src: Path) -> None:
    part_same_bytes(b, "gptq", b.gptq_seqs,
                    lambda dst: ["quantize", "--method", "gptq", str(src), str(dst)])


def part_reap(b: Bench, src: Path) -> None:
    seqs = next(iter(b.tokens.values()))
    plans = {}

    def run(ranks: int) -> dict:
        dst = b.root / f"reap-{ranks}"
        r = b.run(ranks, ["reap", str(src), str(dst), "--keep", str(b.dims.experts // 2),
                          "--overwrite", "--quiet", *calib_args(b, seqs)])
        if r["rc"] == 0:
            plan = json.loads((dst / "reap-plan.json").read_text())
            plans[ranks] = {layer: entry["keep"] for layer, entry in plan["layers"].items()}
        shutil.rmtree(dst, ignore_errors=True)
        return r

    runs = b.each_rank_count("reap", run)
    scaling(runs)
    for ranks, r in runs.items():
        if ranks > 1 and ranks in plans and 1 in plans:
            r["same_kept_experts"] = plans[ranks] == plans[1]
    b.res["reap"] = {"tokens": seqs * b.seq, "runs": list(runs.values())}
    b.save()


def part_reap_learned(b: Bench, src: Path) -> None:
    """`reap --repair router --compensate learned` on the repair stream's sequences: rank 0's
    learned compensation per MoE layer (its -v line), its efficiency, and the bytes."""
    part_same_bytes(b, "reap-learned", b.repair_seqs,
                    lambda dst: ["reap", str(src), str(dst), "--keep", str(b.dims.experts // 2),
                                 "--repair", "router", "--compensate", "learned"])


def part_learned(b: Bench, src: Path) -> None:
    """`sparsify --method learned` (learned p48) on gptq's sequences: rank 0's MoE layer (its
    -v "OBS layer" line: the one-shot start and the training of its experts), its efficiency,
    and the bytes."""
    part_same_bytes(b, "learned", b.gptq_seqs,
                    lambda dst: ["sparsify", str(src), str(dst), "--method", "learned"])


def part_eval(b: Bench, src: Path) -> None:
    candidate = b.root / "eval-candidate"
    if not (candidate / "kconvert-manifest.json").exists():
        shutil.rmtree(candidate, ignore_errors=True)
        made = b.run(1, ["int4-to-nvfp4", str(src), str(candidate), "--device", b.dev,
                         "--quiet"])
        b.res["eval_candidate"] = made
    reports = {}

    def run(ranks: int) -> dict:
        out = b.root / f"eval-{ranks}"
        r = b.run(ranks, ["eval", str(src), str(candidate), "-o", str(out), "--quiet",
                          *calib_args(b, b.eval_seqs)])
        if r["rc"] == 0:
            report = json.loads((out / "eval.json").read_text())
            reports[ranks] = [(c["logits"], c["layers"]) for c in report["candidates"]]
        return r

    runs = b.each_rank_count("eval", run)
    scaling(runs)
    for ranks, r in runs.items():
        if ranks > 1 and ranks in reports and 1 in reports:
            r["same_metrics"] = reports[ranks] == reports[1]
            r["metrics_max_rel_diff"] = largest_difference(reports[1], reports[ranks])
    if 1 in reports and b.eval_repeat:
        # the same 1-rank run again: a difference here is the device's, not the ranks'
        first = reports[1]
        runs[1]["repeat_max_rel_diff"] = (largest_difference(first, reports[1])
                                          if run(1)["rc"] == 0 else None)
    b.res["eval"] = {"tokens": b.eval_seqs * b.seq, "runs": list(runs.values())}
    b.save()


def part_convert(b: Bench) -> None:
    n, shards = b.n_experts, b.shards
    src = sharded_expert_set(b.root, n, shards)
    src_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    outs = {}

    def run(ranks: int) -> dict:
        dst = outs[ranks] = b.root / f"convert-{ranks}"
        shutil.rmtree(dst, ignore_errors=True)
        return b.run(ranks, ["int4-to-nvfp4", str(src), str(dst), "--device", b.dev,
                             "--quiet"], drop=True)

    runs = b.each_rank_count("int4-to-nvfp4", run)
    scaling(runs)
    for ranks, r in runs.items():
        if ranks > 1 and 1 in outs and r["rc"] == 0:
            r["same_bytes"] = same_output(outs[1], outs[ranks])
    for d in outs.values():
        shutil.rmtree(d, ignore_errors=True)
    b.res["convert"] = {"experts": n, "shards": shards, "source_bytes": src_bytes,
                        "runs": list(runs.values())}
    b.save()
