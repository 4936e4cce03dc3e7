"""The quality lab's table and the issue's goals judged on it (benchmarks.quality.quality_lab).

A goal is judged only on the rows it names; a row not in the results, or a probe of fewer than
MIN_PROMPTS prompts where the goal needs the loop rate, makes the goal "not measured", never
met.
"""

from __future__ import annotations

from typing import Any

# Prompts a loop-rate goal needs (issue 46: p >= 0.05 at >= 1,000 prompts).
MIN_PROMPTS = 1000
ALPHA = 0.05


def kl(row: dict | None) -> float | None:
    return None if row is None else row["logits"]["kl_mean"]


def loops_not_above(row: dict) -> bool | None:
    """The row's loop rate not significantly above the source's (one side: a rate below the
    source's passes whatever its p); None where the probe did not run on MIN_PROMPTS."""
    g = row.get("generation")
    if not g or g["prompts"] < MIN_PROMPTS:
        return None
    return g["z"] <= 0 or g["p"] >= ALPHA


def ratio_goal(goal: str, num: dict | None, den: float | None, limit: float) -> dict[str, Any]:
    if num is None or den is None or den <= 0:
        return {"goal": goal, "met": None, "figure": "not measured"}
    r = kl(num) / den
    return {"goal": goal, "row": num["row"], "ratio": round(r, 4), "met": r <= limit,
            "figure": f"{r:.3f}x (KL {kl(num):.4g} against {den:.4g})"}


def goals(rows: list[dict], experts: int) -> list[dict[str, Any]]:
    """Issue 46's four goals and the restoring keep, each met or not with its figure."""
    by = {r["row"]: r for r in rows}
    k50 = experts // 2
    plain = by.get(f"reap{k50}-reap")
    repaired = [r for n, r in by.items() if n.startswith(f"reap{k50}-")
                and n not in (f"reap{k50}-reap", f"reap{k50}-frequency")]
    best = min(repaired, key=kl, default=None)
    out = [ratio_goal(f"REAP keep {k50} with the best repair/compensation at most 0.5x plain "
                      "REAP's KL", best, kl(plain), 0.5)]
    loops = None if best is None else loops_not_above(best)
    out.append({"goal": f"... and its loop rate not significantly above the source's "
                        f"(p >= {ALPHA} at >= {MIN_PROMPTS} prompts)",
                "row": None if best is None else best["row"], "met": loops,
                "figure": "not measured" if loops is None else probe_figure(best)})
    out.append(ratio_goal("p48 learned at most 0.6x SparseGPT's KL", by.get("p48-learned"),
                          kl(by.get("p48-sparsegpt")), 0.6))
    out.append(ratio_goal("NVFP4 learned at most 0.8x GPTQ's KL", by.get("nvfp4-learned"),
                          kl(by.get("nvfp4-gptq")), 0.8))
    parts = [kl(by.get(f"reap{k50}-router-down")), kl(by.get("nvfp4-gptq"))]
    out.append(ratio_goal(f"REAP {k50} + GPTQ NVFP4 at most 1.1x the sum of each alone",
                          by.get("reap-gptq"), None if None in parts else sum(parts), 1.1))
    out.append(restoring_keep(by, k50))
    return out


def restoring_keep(by: dict[str, dict], k50: int) -> dict[str, Any]:
    """The smallest keep (router repair + down compensation) whose loop rate is not
    significantly above the source's: how many pruned experts must come back."""
    keeps = sorted(int(n[4:].split("-")[0]) for n in by
                   if n.startswith("reap") and n.endswith("-router-down") and n[4].isdigit())
    judged = [(k, loops_not_above(by[f"reap{k}-router-down"])) for k in keeps if k >= k50]
    ok = [k for k, fine in judged if fine]
    measured = all(fine is not None for _, fine in judged) and judged
    return {"goal": "the smallest keep (router+down) whose loop rate is not significantly above "
                    "the source's", "met": (bool(ok) if measured else None),
            "figure": (f"keep {min(ok)}" if ok else "none of " + ", ".join(map(str, keeps)))
            if measured else "not measured", "judged": dict(judged)}


def probe_figure(row: dict) -> str:
    g = row["generation"]
    return (f"loop rate {g['candidate']['loop_rate']:.3f} against the source's "
            f"{g['source']['loop_rate']:.3f} on {g['prompts']} prompts, z {g['z']:.2f}, "
            f"p {g['p']:.3g}")


def merge(parts: list[dict]) -> dict:
    """Parts of one table (the same source, data and probe) joined: rows in the order the
    parts list them, a row measured twice is an error."""
    keys = ("source", "experts", "calib", "heldout", "samples", "eval_samples", "seq_len",
            "generate", "new_tokens")
    first = parts[0]
    for p in parts[1:]:
        differ = [k for k in keys if p.get(k) != first.get(k)]
        if differ:
            raise SystemExit(f"quality_lab --merge: the parts differ in {', '.join(differ)}")
    rows = [r for p in parts for r in p["rows"]]
    names = [r["row"] for r in rows]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SystemExit(f"quality_lab --merge: rows measured twice: {', '.join(twice)}")
    # a part is one run (its record) or an earlier merge (its records)
    records = [r for p in parts for r in p.get("records", [p.get("record")])]
    return {k: first.get(k) for k in keys} | {"records": records, "rows": rows}


def cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(result: dict) -> list[str]:
    """The table in Markdown, then the goals."""
    head = ("row", "what", "KL", "KL high-entropy", "top-1", "ΔNLL", "loop rate (source)", "p",
            "length-limit", "divergence", "MB", "wall s", "same bytes", "audit")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        m, g = r["logits"], r.get("generation")
        c = g["candidate"] if g else {}
        loops = f"{c['loop_rate']:.3f} ({g['source']['loop_rate']:.3f})" if g else "-"
        cells = (r["row"], r["what"], cell(m["kl_mean"], ".4f"),
                 cell(m["kl_high_entropy"], ".4f"), cell(m["top1_agreement"], ".4f"),
                 cell(m["nll_candidate"] - m["nll_source"], "+.4f"), loops,
                 cell(g and g["p"], ".3g"), cell(c.get("length_limit_rate"), ".3f"),
                 cell(g and g["divergence_median"], ".0f"), f"{r['bytes'] / 1e6:.1f}",
                 f"{r['wall_s']:.1f}", {True: "yes", False: "NO", None: "-"}[r["same_bytes"]],
                 {True: "PASS", False: "FAIL", None: "-"}[r["audit"]])
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| goal | figure | met |", "|---|---|---|"]
    for goal in result.get("goals", []):
        met = {True: "met", False: "NOT met", None: "not measured"}[goal["met"]]
        lines.append(f"| {goal['goal']} | {goal['figure']} | {met} |")
    return lines
