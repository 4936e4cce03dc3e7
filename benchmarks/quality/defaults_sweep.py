"""The defaults tuned on the tiny MoEs, re-judged on the Kimi-routed proxy (issue 46, item 4):
for each knob, its current value and a few others, everything else at its default, each output
compared with the source by one `kconvert eval` on held-out text (KL, top-1, ΔNLL).

Knobs, where each is declared, and how a run sets it:
- learned NVFP4 / p48 steps (kconvert.plugins.methods LearnedNvfp4Settings, LearnedP48Settings:
  `--steps`) and step size (kconvert.methods.learned NVFP4_LR, P48_LR: class settings; p48's
  pattern step P48_MASK_LR moves with it);
- the GPTQ / learned guard's held-out split (kconvert.methods.obs HELDOUT_EVERY: every 8th
  routed token judged on, not fitted);
- the repair/compensation guard's held-out split (kconvert.pruning.router_fit RepairSettings
  .heldout) and compensation's ridges (RepairSettings.ridges: each layer takes the one with the
  lowest held-out error);
- learned compensation's steps, step size and batch (kconvert.pruning.compensate_learned
  LearnedSettings);
- REAP's criterion (`reap --criterion`) and the calibration samples (`--samples`).
Command-line options are passed as options. The others are not options (no user sets them):
the run's command starts through benchmarks.quality.process_settings, which sets them in that
process and then runs the command line unchanged (as learned_sweep overrides class settings).
Each run's command, and what it set, is in the results; a reap run's plan records what its
guards chose (ridge, held-out tokens, learned settings) and the results carry it.

Noise: each family's default again, calibrated on other training windows (a second draw,
seed 1); a knob's best value is called for only where its KL is below the default's by more
than that family's difference.

    python -m benchmarks defaults_sweep --src tests/fixtures/kimi-proxy --device cuda \\
        --jobs 8 --out benchmarks/results/defaults_sweep_proxy
    python -m benchmarks defaults_sweep --tiny     # CPU check: trained tiny MoE, 4 runs

Calibration and held-out data are made by scripts/make_calibration_data.py (text lines the
source's tokenizer reads where the source has one, else byte ids): training split to calibrate
on, held-out split to evaluate on. Writes OUT.json (every figure, command and setting) and the
table in Markdown beside it (suffix .md).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.child_process import child_env
from benchmarks.harness import REPO, arguments, comma_list, log, parse, record, save

TINY_MOE = REPO / "tests" / "fixtures" / "tiny-moe-trained"
PATCHED = [sys.executable, "-m", "benchmarks.quality.process_settings"]


@dataclass(frozen=True)
class Family:
    """One command, at its defaults: the runs of its knobs differ from it in one setting."""

    name: str
    command: tuple[str, ...]  # after SRC OUT; {KEEP} half the routed experts


@dataclass(frozen=True)
class Knob:
    name: str
    family: str
    declared: str  # where its default is declared
    default: object
    values: tuple  # the alternatives tried
    option: str | None = None  # its command-line option; None: set in the process (`patch`)
    patch: str | None = None  # a process_settings.SETTERS key[.its key]

    def setting(self, value) -> tuple[tuple[str, ...], dict]:
        """(extra command-line arguments, process settings) that give it `value`."""
        if self.option:
            return (self.option, str(value)), {}
        group, _, key = (self.patch or "").partition(".")
        return (), {group: {key: value} if key else value}


@dataclass(frozen=True)
class Run:
    name: str
    family: Family
    knob: Knob | None  # None: the family's default (or its noise run)
    value: object = None
    args: tuple[str, ...] = ()
    patch: dict = field(default_factory=dict)


# slowest first (on the CPU: learned compensation, then the learned methods), so that runs
# started together with --jobs end near together
FAMILIES = {f.name: f for f in (
    Family("reap-learned", ("reap", "--keep", "{KEEP}", "--repair", "router", "--compensate",
                            "learned")),
    Family("nvfp4-learned", ("quantize", "--method", "learned")),
    Family("p48-learned", ("sparsify", "--method", "learned")),
    Family("reap-down", ("reap", "--keep", "{KEEP}", "--repair", "router", "--compensate",
                         "down")),
    Family("reap-plain", ("reap", "--keep", "{KEEP}")),
)}

LEARNED = "kconvert/methods/learned.py"
REPAIR = "kconvert/pruning/router_fit.py RepairSettings"
SAMPLES = ("this sweep's --samples (the CLI's, of 2048 tokens: 1024 for reap, 128 for the "
           "learned methods; kconvert/common/options.py REAP_SAMPLES, SPARSEGPT_SAMPLES)")
KNOBS = (
    Knob("steps", "nvfp4-learned", "kconvert/plugins/methods.py LearnedNvfp4Settings", 50,
         (25, 150), option="--steps"),
    Knob("lr", "nvfp4-learned", f"{LEARNED} NVFP4_LR", 5e-3, (2e-3, 1.25e-2),
         patch="method_lr"),
    # every 16th: the routed-token floor (MIN_ROUTED_TOKENS) doubles to 2,048
    Knob("held-out every", "nvfp4-learned", "kconvert/methods/obs.py HELDOUT_EVERY", 8, (4,),
         patch="held_every"),
    # a quarter: most experts fall below the routed-token floor, which leaves them GPTQ's
    Knob("samples", "nvfp4-learned", SAMPLES, "{SAMPLES}", ("{SAMPLES*4}",), option="--samples"),
    Knob("steps", "p48-learned", "kconvert/plugins/methods.py LearnedP48Settings", 25, (75,),
         option="--steps"),
    Knob("lr", "p48-learned", f"{LEARNED} P48_LR", 4e-2, (2e-2, 8e-2), patch="method_lr"),
    Knob("ridges", "reap-down", f"{REPAIR}.ridges", (1e-3, 1e-2, 1e-1, 1.0),
         ((1e-2,), (1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)), patch="repair.ridges"),
    Knob("held-out share", "reap-down", f"{REPAIR}.heldout", 0.25, (0.125, 0.5),
         patch="repair.heldout"),
    # four times: the repair stream takes 32,768 tokens whatever the data (REPAIR_TOKENS)
    Knob("samples", "reap-down", SAMPLES, "{SAMPLES}", ("{SAMPLES/4}",), option="--samples"),
    Knob("steps", "reap-learned", "kconvert/pruning/compensate_learned.py LearnedSettings", 200,
         (400,), patch="learned_compensation.steps"),
    Knob("lr", "reap-learned", "kconvert/pruning/compensate_learned.py LearnedSettings", 2e-3,
         (5e-3,), patch="learned_compensation.lr"),
    Knob("batch", "reap-learned", "kconvert/pruning/compensate_learned.py LearnedSettings", 16,
         (64,), patch="learned_compensation.batch"),
    Knob("criterion", "reap-plain", "kconvert/plugins/pruning.py (default=True)", "reap",
         ("frequency", "ean", "msan"), option="--criterion"),
)
# Defaults that the sweep leaves at their value (too costly for the grid, or not a quality
# knob): reported with the results.
NOT_SWEPT = {
    "learned tokens per step (--tokens 256)": "the step's sample size; steps were swept",
    "learned mask_lr (P48_MASK_LR 2e-2)": "p48 patterns' step; lr was swept",
    "router repair steps, lr_bias, lr_gate, candidates, temperature (RepairSettings)":
        "the repair's own fit; the compensation's were swept",
    "repair stream tokens (REPAIR_TOKENS 32768)": "bounds memory; --samples sweeps the data",
    "compensation sweeps (RepairSettings.sweeps 2)": "Gauss-Seidel sweeps of the closed form",
    "MIN_FIT_TOKENS 64, MAX_FIT_TOKENS 8192 (learned.py)": "limits, not tuned values",
}


def sized(value: object, samples: int) -> object:
    """A samples placeholder ({SAMPLES}, {SAMPLES/4}, {SAMPLES*4}) at the sweep's `samples`."""
    if not isinstance(value, str) or not value.startswith("{SAMPLES"):
        return value
    return {"{SAMPLES}": samples, "{SAMPLES/4}": max(1, samples // 4),
            "{SAMPLES*4}": samples * 4}[value]


def runs(samples: int) -> list[Run]:
    """Every run, family by family: its default, its noise run, and one run per knob value."""
    out = []
    for family in FAMILIES.values():
        out += [Run(family.name, family, None),
                Run(f"{family.name}.seed1", family, None, "calibration seed 1",
                    ("--data", "{CALIB1}"))]
        for knob in (k for k in KNOBS if k.family == family.name):
            for value in knob.values:
                value = sized(value, samples)
                args, patch = knob.setting(value)
                # "+" joins a tuple: a run name must pass through --runs, a comma list
                label = "+".join(map(str, value)) if isinstance(value, tuple) else value
                out.append(Run(f"{knob.family}.{knob.name.replace(' ', '-')}={label}", family,
                               knob, value, args, patch))
    return out


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def execute(cmd: list[str], env: dict[str, str], what: str) -> tuple[float, float]:
    """Runs `cmd`: its wall seconds and the CPU seconds of this process's finished children
    meanwhile (the command's own where one runs at a time: --jobs 1)."""
    start, cpu = time.perf_counter(), children_cpu_s()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if done.returncode:
        raise RuntimeError(f"{what} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return time.perf_counter() - start, children_cpu_s() - cpu


def guards(out: Path) -> dict | None:
    """Per layer what a reap run's guards chose (the ridge, whether compensation and learned
    compensation were written, with the settings the plan records), None for other runs."""
    plan = out / "reap-plan.json"
    if not plan.exists():
        return None
    layers = {}
    for name, layer in json.loads(plan.read_text())["layers"].items():
        c = layer.get("compensation") or {}
        learned = c.get("learned") or {}
        layers[name] = {k: v for k, v in (
            ("ridge", c.get("ridge")), ("applied", c.get("applied")),
            ("heldout_tokens", c.get("heldout_tokens")), ("learned", learned.get("applied")),
            ("learned_settings", [learned.get(k) for k in ("steps", "lr", "batch")]
             if learned else None)) if v is not None}
    return layers


def one(run: Run, a, values: dict[str, str], env: dict[str, str]) -> dict:
    """Makes the run's output and evaluates it against the source: its figures."""
    out = a.root / run.name
    command = [v.format(**values) for v in run.family.command]
    # the run's own options replace the sweep's
    data = {"--data": "{CALIB}", "--samples": str(a.samples), "--seq-len": str(a.seq_len)}
    data |= dict(zip(run.args[::2], run.args[1::2], strict=True))
    args = [command[0], str(a.src), str(out), *command[1:],
            *(x.format(**values) for pair in data.items() for x in pair), "--overwrite",
            "--quiet", "--device", a.device, *a.gpu_memory_args]
    if run.patch:
        cmd = [*PATCHED, json.dumps(run.patch), *args]
    else:
        cmd = [sys.executable, "-m", "kconvert.cli", *args]
    wall, cpu = execute(cmd, env, run.name)
    report = out.with_name(f"{out.name}.eval")
    eval_s, eval_cpu = execute([sys.executable, "-m", "kconvert.cli", "eval", str(a.src), str(out),
                      "--data", str(values["HELDOUT"]), "--samples", str(a.eval_samples),
                      "--seq-len", str(a.seq_len), "--dtype", "float32", "--device", a.device,
                      *a.gpu_memory_args, "-o", str(report), "--overwrite", "--quiet"],
                     env, f"eval of {run.name}")
    logits = json.loads((report / "eval.json").read_text())["candidates"][0]["logits"]
    log(f"{run.name}: {wall:.1f} s, eval {eval_s:.1f} s, KL {logits['kl_mean']:.5f}")
    return {"run": run.name, "family": run.family.name,
            "knob": run.knob.name if run.knob else None, "value": run.value,
            "command": args, "process_settings": run.patch, "wall_s": round(wall, 2),
            "eval_s": round(eval_s, 2), "logits": logits, "guards": guards(out),
            **({"cpu_s": round(cpu, 1), "eval_cpu_s": round(eval_cpu, 1)} if a.jobs == 1
               else {})}


def attempt(run: Run, a, values: dict[str, str], env: dict[str, str]) -> dict:
    """`one`, or the run's failure recorded (the other runs go on)."""
    try:
        return one(run, a, values, env)
    except RuntimeError as exc:
        log(f"{run.name}: FAILED")
        return {"run": run.name, "family": run.family.name,
                "knob": run.knob.name if run.knob else None, "value": run.value,
                "error": str(exc)}


def make_data(a) -> dict[str, str]:
    """Training windows to calibrate on (seed 0, and seed 1 for the noise runs: other windows)
    and held-out windows to evaluate on, by scripts/make_calibration_data.py: text lines of 4
    bytes per token where the source has a tokenizer (a BPE of ~3.4 bytes per token fills
    --seq-len), else byte ids; as many lines as the largest --samples run needs."""
    text = (a.src / "tokenizer.json").exists()
    width = a.seq_len * (4 if text else 1)
    made = {}
    for key, split, lines, seed in (("CALIB", "train", 4 * a.samples, 0),
                                    ("CALIB1", "train", 4 * a.samples, 1),
                                    ("HELDOUT", "heldout", a.eval_samples, 0)):
        path = a.root / f"{key.lower()}.jsonl"
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_calibration_data.py"),
                        str(path), "--samples", str(lines), "--seq-len", str(width), "--split",
                        split, "--seed", str(seed), *(["--text"] if text else [])],
                       check=True, capture_output=True, env=child_env())
        made[key] = str(path)
    return made


def gpu_share(a) -> list[str]:
    """--gpu-memory for each of --jobs commands sharing one GPU (each would otherwise plan
    for all of the card's free memory)."""
    if a.gpu_memory or a.device == "cpu" or a.jobs == 1:
        return ["--gpu-memory", a.gpu_memory] if a.gpu_memory else []
    import torch
    free, _ = torch.cuda.mem_get_info(torch.device(a.device))
    return ["--gpu-memory", f"{int(free * 0.9 / a.jobs) >> 20}MiB"]


def kl(result: dict) -> float:
    return result["logits"]["kl_mean"]


def verdicts(results: list[dict], samples: int) -> list[dict]:
    """Per knob: the default's KL, the best value's, the noise (the family's default against
    its seed-1 calibration), and whether the proxy calls for a change (best below the default
    by more than the noise)."""
    done = {r["run"]: r for r in results if "logits" in r}
    out = []
    for knob in KNOBS:
        base, again = done.get(knob.family), done.get(f"{knob.family}.seed1")
        tried = [r for r in done.values() if r["family"] == knob.family
                 and r["knob"] == knob.name]
        if base is None or not tried:
            continue
        default = sized(knob.default, samples)
        best = min(tried, key=kl)
        noise = abs(kl(again) - kl(base)) if again else None
        if kl(best) >= kl(base):
            verdict = f"keep {default}: no value tried is better"
        elif noise is None:
            verdict = f"{best['value']} is better, noise not measured: run {knob.family}.seed1"
        elif kl(base) - kl(best) > noise:
            verdict = f"change to {best['value']}: better by more than the noise"
        else:
            verdict = f"keep {default}: {best['value']} is better only within the noise"
        out.append({"family": knob.family, "knob": knob.name, "declared": knob.declared,
                    "default": default, "default_kl": kl(base), "best": best["value"],
                    "best_kl": kl(best), "noise": noise, "verdict": verdict})
    return out


def table(results: list[dict], judged: list[dict]) -> list[str]:
    head = ("run", "knob", "value", "KL", "KL / default", "top-1", "ΔNLL", "wall s", "eval s",
            "CPU s")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    done = {r["run"]: r for r in results if "logits" in r}
    for r in results:
        if "logits" not in r:
            lines.append(f"| {r['run']} | {r['knob'] or '-'} | {r['value']} | FAILED |"
                         + " |" * (len(head) - 4))
            continue
        m, base = r["logits"], done.get(r["family"])
        cells = (r["run"], r["knob"] or ("noise" if r["value"] else "default"),
                 "-" if r["value"] is None else str(r["value"]), f"{m['kl_mean']:.5f}",
                 f"{m['kl_mean'] / kl(base):.3f}" if base and kl(base) else "-",
                 f"{m['top1_agreement']:.4f}", f"{m['nll_candidate'] - m['nll_source']:+.4f}",
                 f"{r['wall_s']:.1f}", f"{r['eval_s']:.1f}", str(r.get("cpu_s", "-")))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| family | knob | default (KL) | best (KL) | noise | verdict |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {v['family']} | {v['knob']} | {v['default']} ({v['default_kl']:.5f}) | "
              f"{v['best']} ({v['best_kl']:.5f}) | "
              f"{'-' if v['noise'] is None else format(v['noise'], '.5f')} | {v['verdict']} |"
              for v in judged]
    lines += ["", "Not swept (at their defaults): " + "; ".join(
        f"{k}: {why}" for k, why in NOT_SWEPT.items()) + "."]
    return lines


def main(argv: list[str]) -> None:
    ap = arguments("defaults_sweep", __doc__, root="/tmp/defaults-sweep")
    ap.add_argument("--src", type=Path, default=REPO / "tests" / "fixtures" / "kimi-proxy")
    ap.add_argument("--runs", type=comma_list, help="only these runs (comma list of names)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (each its own process)")
    ap.add_argument("--gpu-memory", help="each command's --gpu-memory (default: with --jobs "
                                         "on a GPU, 90%% of its free memory / jobs)")
    ap.add_argument("--samples", type=int, default=256, help="calibration sequences")
    ap.add_argument("--eval-samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512, help="the proxy's training length")
    ap.add_argument("--tiny", action="store_true", help="CPU check: tiny MoE, 4 runs")
    ap.add_argument("--out", type=Path, default=Path("/tmp/defaults-sweep/defaults_sweep"),
                    help="OUT.json and the Markdown table beside it are written")
    a = parse(ap, argv, tiny={"src": TINY_MOE, "samples": 16, "eval_samples": 8, "seq_len": 64,
                              "runs": ["reap-down", "reap-down.seed1",
                                       "reap-down.held-out-share=0.5",
                                       "nvfp4-learned.lr=0.002"]})
    a.root.mkdir(parents=True, exist_ok=True)
    experts = json.loads((a.src / "config.json").read_text())["n_routed_experts"]
    every = runs(a.samples)
    chosen = [r for r in every if a.runs is None or r.name in a.runs]
    unknown = set(a.runs or ()) - {r.name for r in every}
    if unknown or not chosen:
        raise SystemExit(f"no run {sorted(unknown)}; runs: {', '.join(r.name for r in every)}")
    values = {**make_data(a), "KEEP": str(experts // 2)}
    a.gpu_memory_args = gpu_share(a)
    # the cores shared among the runs at once
    env = child_env(OMP_NUM_THREADS=max(1, (os.cpu_count() or 1) // a.jobs))
    start, done = time.perf_counter(), {}
    with ThreadPoolExecutor(a.jobs) as pool:
        for future in as_completed([pool.submit(attempt, r, a, values, env) for r in chosen]):
            finished = future.result()
            done[finished["run"]] = finished
            # written as each run ends: a call cut at its time limit keeps what finished
            results = [done[r.name] for r in chosen if r.name in done]
            judged = verdicts(results, a.samples)
            save({"record": record("defaults_sweep", gpu=a.device != "cpu"),
                  "source": str(a.src), "experts": experts, "keep": experts // 2,
                  "samples": a.samples, "seq_len": a.seq_len, "eval_samples": a.eval_samples,
                  "jobs": a.jobs, "data": values, "wall_s": round(time.perf_counter() - start, 1),
                  "runs": results, "verdicts": judged, "not_swept": NOT_SWEPT},
                 a.out.with_suffix(".json"))
            lines = table(results, judged)
            a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    log(f"{len(chosen)} runs in {time.perf_counter() - start:.0f} s with --jobs {a.jobs}")
    for v in judged:
        print(f"{v['family']} {v['knob']}: {v['verdict']}")
