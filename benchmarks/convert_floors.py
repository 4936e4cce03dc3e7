"""`python -m benchmarks convert full` and `cast`: kconvert against the anchor and the I/O
floors, measured in the same run on the same disk, and the ratios of its walls to them."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from benchmarks.child_process import child_env, run_child
from benchmarks.convert_runs import (
    Run,
    child,
    cpu_comparison,
    cpu_env,
    du,
    echo,
    rm,
    timed_kc,
    warm_cpu_kernels,
)
from benchmarks.harness import Timer, drop_page_cache, log
from benchmarks.synthetic import anchor_script, anchor_set, mxfp4_set


def full(run: Run) -> None:
    res, root = run.res, run.root
    src = root / "src"
    # 1. anchor_convert.py: builds ROOT/src, times the anchor (cold) and the floors.
    a_out = root / "anchor_out"
    p = run_child([sys.executable, anchor_script()], merge=True, echo=echo, env=child_env(
        DIMS=run.args.dims, MOE_LAYERS=str(run.args.moe_layers),
        WORKERS=str(run.args.workers), ROOT=root, OUT=a_out))
    anchor = json.loads((a_out / "anchor.json").read_text()) if (a_out / "anchor.json"
                                                                ).is_file() else {}
    anchor["script_wall_s"] = round(p.wall_s, 1)
    if p.rc:
        anchor["error_tail"] = p.output[-3000:]
    res["anchor"] = anchor
    if (a_out / "anchor.json").is_file():
        run.path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(a_out / "anchor.json", run.path.parent / "anchor.json")
    rm(root / "dst_floor")
    run.save()
    dst_bytes = anchor.get("dst_bytes") or anchor.get("src_bytes")
    # 2. Concurrent floor: read every source byte while writing the output's bytes.
    if dst_bytes and src.is_dir():
        cold = drop_page_cache(run.args.keep_page_cache) is None
        r = child(["_iofloor", str(src), str(root / "floor_conc"), str(dst_bytes)], gpu=False)
        r["drop_caches_ok"] = cold
        res["io_floor_concurrent"] = r
        log("concurrent floor", {k: r.get(k) for k in ("read_s", "write_s", "both_s")})
        run.save()
    # 2b. What the disk does with more requests in flight and O_DIRECT (not a floor).
    if dst_bytes and src.is_dir() and not run.args.no_io_probe:
        r = child(["_ioprobe", str(src), str(root / "probe"), str(dst_bytes),
                   str(run.args.probe_threads), str(int(run.args.keep_page_cache))], gpu=False)
        r.pop("timeline", None)
        res["io_probe"] = r
        log("io probe", {k: v for k, v in r.items() if k.endswith("_s")})
        run.save()
    # 3. kconvert on the same src, cold, its own process each.
    if shutil.disk_usage(root).free < 1.3 * (dst_bytes or 0):
        rm(root / "dst")
    res["kc"] = {}
    nv, mx = "int4-to-nvfp4", "int4-to-mxfp4"
    variants = [("mse", None, "cuda", nv), ("amax", "amax", "cuda", nv)]
    if not run.args.no_mxfp4:
        variants += [("mxfp4_amax", None, "cuda", mx), ("mxfp4_mse", "mse", "cuda", mx)]
    variants.append(("mse_cpu", None, "cpu", nv))
    if res["record"]["device"]["kind"] == "cpu":
        variants = [v for v in variants if v[2] != "cuda"]
    for label, bs, device, command in variants:
        if device == "cpu" and run.timer.late():
            continue
        env = None
        if device == "cpu":
            warm_cpu_kernels(run)
            env = cpu_env()
        r = timed_kc(src, root / "kc", device, bs, run.args.keep_page_cache, env=env,
                     command=command)
        r["device"], r["command"] = device, command
        res["kc"][label] = r
        log(f"kconvert {label}", {k: r.get(k) for k in (
            "rc", "wall_main_s", "wall_process_s", "vmhwm_gb", "maxrss_gb", "gpu")}
            | {"stages": r.get("stages")})
        if label == "amax" and (root / "dst").is_dir() and r["rc"] == 0:
            res["anchor_vs_kc_amax_sample"] = sample_vs_anchor(root / "dst", root / "kc")
        run.save()
    rm(root / "kc")
    res["ratios"] = ratios(res, anchor)
    run.save()
    log("ratios", res["ratios"])
    # 5. CPU per expert matrix, both tools, same machine (skipped when short of time).
    if not run.timer.late():
        rm(src)
        res["cpu"] = cpu_comparison(run)
        log("cpu per matrix", res["cpu"].get("per_matrix"))


def ratios(res: dict, anchor: dict) -> dict:
    """Each kconvert run against the floors and the anchor, and the targets."""
    floor = anchor.get("io_floor_s")
    conc = res.get("io_floor_concurrent", {}).get("both_s")
    out = {}
    for label, r in res["kc"].items():
        if r.get("rc") == 0 and r.get("rc_main") == 0 and floor:
            out[label] = {
                "wall_main_over_floor": round(r["wall_main_s"] / floor, 2),
                "wall_main_over_concurrent_floor": round(r["wall_main_s"] / conc, 2)
                if conc else None,
                "wall_process_over_floor": round(r["wall_process_s"] / floor, 2),
                "anchor_over_wall_main": round(anchor["anchor_w1_s"] / r["wall_main_s"], 2)
                if anchor.get("anchor_w1_s") else None,
                "peak_rss_gb": r.get("vmhwm_gb") or r.get("maxrss_gb"),
                "target_wall_ok": r["wall_main_s"] <= 1.3 * floor,
                "target_rss_ok": (r.get("vmhwm_gb") or r.get("maxrss_gb") or 99) <= 4.0}
    if conc:
        out["concurrent_floor_over_io_floor"] = round(conc / floor, 2) if floor else None
    return out


def sample_vs_anchor(anchor_dst: Path, kc_dst: Path, n: int = 4) -> dict:
    """down_proj (no fused partner: same global scale rule) bytes, kconvert amax vs anchor."""
    import torch
    from safetensors import safe_open

    def find(d: Path, name: str):
        idx = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
        with safe_open(d / idx[name], "pt") as h:
            return h.get_tensor(name)

    out = {}
    for e in range(n):
        for p in ("weight_packed", "weight_scale", "weight_global_scale"):
            name = f"model.layers.1.mlp.experts.{e}.down_proj.{p}"
            try:
                a, b = find(anchor_dst, name), find(kc_dst, name)
            except (KeyError, OSError) as exc:
                out[name] = f"missing: {exc}"
                continue
            ua, ub = a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(
                torch.uint8)
            out[name] = (round(float((ua == ub).float().mean()), 5) if ua.shape == ub.shape
                         else f"shape {list(a.shape)} vs {list(b.shape)}")
    return out


def cast(run: Run) -> None:
    """The exact cast on the MXFP4 twin of the anchor's set, against the concurrent copy."""
    res, root = run.res, run.root
    src = root / "src"
    if not (src / "config.json").is_file():
        res["src_bytes"] = anchor_set(src, run.args.dims, run.args.moe_layers)
    gpu = res["record"]["device"]["kind"] != "cpu"
    made = Timer()
    mx = mxfp4_set(src, root / "mx-src", "cuda" if gpu else "cpu")
    res["mx_src"] = {"bytes": du(mx), "build_s": round(made.elapsed(), 1)}
    run.save()
    res["kc"] = {}
    variants = [("exact_cuda", "cuda", ()), ("exact_modelopt_cuda", "cuda",
                                             ("--format", "modelopt")), ("exact_cpu", "cpu", ())]
    for label, device, extra in variants:
        if (device == "cuda" and not gpu) or (device == "cpu" and run.args.no_cpu):
            continue
        env = None
        if device == "cpu":
            warm_cpu_kernels(run)
            env = cpu_env()
        r = timed_kc(mx, root / "kc", device, None, run.args.keep_page_cache, env=env,
                     extra=extra, command="mxfp4-to-nvfp4")
        r["device"] = device
        res["kc"][label] = r
        log(f"kconvert {label}", {k: r.get(k) for k in (
            "rc", "wall_main_s", "wall_process_s", "vmhwm_gb", "out_bytes")})
        run.save()
    made_bytes = next((r["out_bytes"] for r in res["kc"].values() if r.get("out_bytes")), None)
    rm(root / "kc")
    if made_bytes:
        cold = drop_page_cache(run.args.keep_page_cache) is None
        floor = child(["_iofloor", str(mx), str(root / "floor_conc"), str(made_bytes)],
                      gpu=False)
        floor["drop_caches_ok"] = cold
        res["io_floor_concurrent"] = floor
        conc = floor.get("both_s")
        res["ratios"] = {label: round(r["wall_main_s"] / conc, 2)
                         for label, r in res["kc"].items()
                         if conc and r.get("rc") == 0 and r.get("wall_main_s")}
        log("concurrent copy", conc, "wall_main / it", res["ratios"])

