"""Benchmark: the data-driven commands through the CLI on one full-size synthetic Kimi MoE layer.

Builds (or reuses, when ROOT/calib-src exists) a Kimi-K2-Thinking-shaped checkpoint with real
shapes (layer 0 dense, layer 1 MoE with 384 INT4 experts, MLA attention, a reduced 16k
vocabulary since only the embedding lookup touches it) and SEQS x SEQ random `input_ids` as
JSONL, then runs, each as its own `python -m kconvert ... -v` process:
  calibrate cold  (page cache dropped first: `sync; echo 3 > /proc/sys/vm/drop_caches`, root)
  calibrate hot   (the same, the checkpoint now in the page cache)
  eval hot        (the source against itself: two models, each layer read and run twice)
  reap --data hot (REAP on the same tokens, keeping half the experts; output deleted after)
Per process: wall seconds, per decoder layer the read / compute / overlap / wall seconds from
the -v log (kconvert.calibrate.prefetch), the MoE layer's seconds and the process wall minus
the layers' time, and its breakdown (`startup`): the -v log's phases (kconvert.calibrate.
startup: imports, open checkpoint, data, model code, CUDA start, embedding, write), the CUDA
thread's seconds beside them, what ran before the first phase, the exit (last output line to
the process's end) and the rest. Targets (issue 30): MoE layer cold <= 1.15 x hot, hot <= 6 s,
process wall minus layers <= 6 s.
Before the commands (FLOOR=1, the default; ~30 s), the floor no code of ours can cut: bare
processes that import torch and transformers' DeepSeek-V3 modules, start CUDA, and exit with
and without the interpreter's teardown, and one that pins 9.8 GB of host memory as a MoE
layer's first read does (`floor` in the JSON).

Device (H100/H200, ~3-4 min with the set to build, ~2.5 min when it exists; root for cold):
    ROOT=/tmp/kbench python3 scripts/bench_calibrate.py $OUT/bench_calibrate_cli.json
CPU smoke test (tiny dims, seconds):
    python scripts/bench_calibrate.py --tiny /tmp/bench_calibrate_tiny.json

With MOE_LAYERS=2 the second MoE layer shows the steady state of a whole model: its read
overlaps the first MoE layer's compute (the first's overlaps only the short dense layer 0).

Env: ROOT (scratch dir), SEQS (256), SEQ (2048), BATCH (8), DIMS, MOE_LAYERS (1),
COMMANDS (calibrate,eval,reap), COLD (1: calibrate cold too; 0 on a shared machine, where
dropping the page cache slows everyone), FLOOR (1), TREE (another checkout whose kconvert the
commands run, e.g. the previous code for a before/after comparison in one device run; its -v
log may lack the per-layer lines and phases, and then only process walls and exits compare).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

if "--tiny" in sys.argv:  # before the dims are read from the environment
    sys.argv.remove("--tiny")
    os.environ.update(DIMS="128,64,256,16,512,64,32,4", SEQS="4", SEQ="32", BATCH="2")
    os.environ.setdefault("ROOT", "/tmp/kbench-tiny")

import torch
from safetensors.torch import save_file

ROOT = Path(os.environ.get("ROOT", "/tmp/kbench"))
OUT = Path(os.environ.get("OUT", "/tmp/kbench-out"))  # bench_eval.py's result directory
REPO = Path(__file__).resolve().parent.parent
TREE = Path(os.environ.get("TREE", REPO)).resolve()  # whose kconvert runs
SEQS, SEQ, BATCH = (int(os.environ.get(k, d)) for k, d in
                    (("SEQS", 256), ("SEQ", 2048), ("BATCH", 8)))
H, I_MOE, I_DENSE, E, V, QL, KVL, NH = (int(x) for x in os.environ.get(
    "DIMS", "7168,2048,18432,384,16384,1536,512,64").split(","))
# MoE layers after the dense layer 0: the second one's read overlaps the first one's compute,
# as every MoE layer's does in a 61-layer model (the first's overlaps only the dense layer's).
MOE_LAYERS = int(os.environ.get("MOE_LAYERS", 1))
dev = "cuda" if torch.cuda.is_available() else "cpu"


def bf16(*shape: int) -> torch.Tensor:
    return (torch.randn(*shape, device=dev) * shape[-1] ** -0.5).to(torch.bfloat16).cpu()


def int4(out_f: int, in_f: int) -> dict[str, torch.Tensor]:
    """Kimi-style INT4: codes -7..7 packed low nibble first, bf16 group-32 scales."""
    q = torch.randint(-7, 8, (out_f, in_f), device=dev, dtype=torch.int32) + 8
    shifts = torch.arange(0, 32, 4, device=dev, dtype=torch.int32)
    packed = (q.view(out_f, in_f // 8, 8) << shifts).sum(-1, dtype=torch.int64)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    scale = torch.full((out_f, in_f // 32), (in_f ** -0.5) / 4, device=dev).to(torch.bfloat16)
    return {"weight_packed": packed.cpu(), "weight_scale": scale.cpu(),
            "weight_shape": torch.tensor([out_f, in_f], dtype=torch.int32)}


def attention(p: str) -> dict[str, torch.Tensor]:
    return {f"{p}.self_attn.q_a_proj.weight": bf16(QL, H),
            f"{p}.self_attn.q_a_layernorm.weight": torch.ones(QL, dtype=torch.bfloat16),
            f"{p}.self_attn.q_b_proj.weight": bf16(NH * 192, QL),
            f"{p}.self_attn.kv_a_proj_with_mqa.weight": bf16(KVL + 64, H),
            f"{p}.self_attn.kv_a_layernorm.weight": torch.ones(KVL, dtype=torch.bfloat16),
            f"{p}.self_attn.kv_b_proj.weight": bf16(NH * 256, KVL),
            f"{p}.self_attn.o_proj.weight": bf16(H, NH * 128),
            f"{p}.input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
            f"{p}.post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16)}


def make_checkpoint(src: Path) -> None:
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    count = MOE_LAYERS + 2
    names = [f"model-{i:05d}-of-{count:06d}.safetensors" for i in range(1, count + 1)]
    weight_map: dict[str, str] = {}

    def put(i: int, t: dict[str, torch.Tensor]) -> None:
        save_file(t, str(src / names[i]), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(t, names[i]))

    t = attention("model.layers.0")
    for proj, shape in (("gate_proj", (I_DENSE, H)), ("up_proj", (I_DENSE, H)),
                        ("down_proj", (H, I_DENSE))):
        t[f"model.layers.0.mlp.{proj}.weight"] = bf16(*shape)
    put(0, t)
    for layer in range(1, MOE_LAYERS + 1):
        p = f"model.layers.{layer}"
        t = attention(p)
        t[f"{p}.mlp.gate.weight"] = bf16(E, H)
        t[f"{p}.mlp.gate.e_score_correction_bias"] = torch.randn(E) * 0.01
        for proj, shape in (("gate_proj", (I_MOE, H)), ("up_proj", (I_MOE, H)),
                            ("down_proj", (H, I_MOE))):
            t[f"{p}.mlp.shared_experts.{proj}.weight"] = bf16(*shape)
            for e in range(E):
                for param, v in int4(*shape).items():
                    t[f"{p}.mlp.experts.{e}.{proj}.{param}"] = v
        put(layer, t)
    put(MOE_LAYERS + 1, {"model.embed_tokens.weight": bf16(V, H), "lm_head.weight": bf16(V, H),
            "model.norm.weight": torch.ones(H, dtype=torch.bfloat16)})
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "quantization_status": "compressed",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
              "num_bits": 4, "type": "int", "symmetric": True, "group_size": 32,
              "strategy": "group", "dynamic": False}}},
          "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                     r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]}
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
              "hidden_size": H, "intermediate_size": I_DENSE, "moe_intermediate_size": I_MOE,
              "num_hidden_layers": 1 + MOE_LAYERS, "first_k_dense_replace": 1,
              "n_routed_experts": E,
              "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
              "topk_method": "noaux_tc", "scoring_func": "sigmoid", "routed_scaling_factor": 2.827,
              "norm_topk_prob": True, "q_lora_rank": QL, "kv_lora_rank": KVL,
              "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
              "num_attention_heads": NH, "num_key_value_heads": NH, "vocab_size": V,
              "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
              "rope_theta": 50000.0, "tie_word_embeddings": False,
              "rope_scaling": {"type": "yarn", "factor": 64.0,
                               "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                               "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
              "torch_dtype": "bfloat16", "quantization_config": qc}
    (src / "config.json").write_text(json.dumps(config, indent=1))


def ensure_checkpoint(src: Path) -> None:
    """The set in `src`, made unless it is there with these DIMS and MOE_LAYERS."""
    stamp, made = src.with_suffix(".dims"), f"{os.environ.get('DIMS', '')};{MOE_LAYERS}"
    if not (src / "config.json").exists() or not stamp.exists() or stamp.read_text() != made:
        make_checkpoint(src)
        stamp.write_text(made)


# A -v line of kconvert.calibrate.prefetch:
# "<label>/<n>: read R s, compute C s, overlap O s, wall W s".
LAYER_LINE = re.compile(r"INFO: (?P<label>.+?)/\d+: read (?P<read>[\d.]+) s, compute "
                        r"(?P<compute>[\d.]+) s, overlap (?P<overlap>[\d.]+) s, wall "
                        r"(?P<wall>[\d.]+) s")


def make_data(path: Path) -> None:
    ids = torch.randint(0, V, (SEQS, SEQ), generator=torch.Generator().manual_seed(0))
    with open(path, "w") as fh:
        for row in ids.tolist():
            fh.write(json.dumps({"input_ids": row}) + "\n")


def drop_page_cache() -> str | None:
    """Empty the page cache (root only); None when done, else why not."""
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as exc:
        return str(exc)
    return None


# A -v line of kconvert.calibrate.startup: "phase <name>: S s".
PHASE_LINE = re.compile(r"INFO: phase (?P<name>[\w ]+): (?P<s>[\d.]+) s")
CUDA_THREAD_LINE = re.compile(r"INFO: CUDA started on a thread in (?P<s>[\d.]+) s")


def run_cli(name: str, args: list[str]) -> dict:
    """One `python -m kconvert ARGS -v` process: wall seconds, the per-layer lines and the
    start-up breakdown (each output line is stamped with its arrival time)."""
    env = {**os.environ, "PYTHONPATH": f"{TREE}:{os.environ.get('PYTHONPATH', '')}",
           "PYTHONUNBUFFERED": "1"}  # stdout lines arrive when printed, not at exit
    t0 = time.perf_counter()
    # cwd=TREE: `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH.
    proc = subprocess.Popen([sys.executable, "-m", "kconvert", *args, "-v"], env=env, cwd=TREE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stamped = [(time.perf_counter() - t0, line) for line in proc.stdout]
    proc.wait()
    wall = time.perf_counter() - t0
    text = "".join(line for _, line in stamped)
    if proc.returncode:
        sys.stderr.write(text[-6000:])
        raise SystemExit(f"{name}: kconvert exited {proc.returncode}")
    layers = [{"layer": m["label"], **{k: float(m[k])
                                       for k in ("read", "compute", "overlap", "wall")}}
              for m in LAYER_LINE.finditer(text)]
    layers_s = sum(lay["wall"] for lay in layers)
    # per MoE layer (eval: the source's and the candidate's together)
    moe = [round(sum(lay["wall"] for lay in layers if lay["layer"].endswith(f"layer {L}")), 2)
           for L in range(1, MOE_LAYERS + 1)]
    return {"wall_s": round(wall, 2), "layers": layers, "layers_s": round(layers_s, 2),
            "moe_layer_s": moe,
            "wall_minus_layers_s": round(wall - layers_s, 2),
            "startup": startup_breakdown(stamped, wall, layers_s),
            "projection": [ln.strip() for _, ln in stamped if "projection" in ln]}


def startup_breakdown(stamped: list[tuple[float, str]], wall: float, layers_s: float) -> dict:
    """Where the process wall outside the layers went: kconvert's logged phases (seconds on
    the main thread's path), the CUDA thread's seconds (beside it), the first phase line's
    arrival less the phases before it (interpreter, click, what ran before the command's
    first phase), the exit (last line to the process's end: the interpreter's and the CUDA
    driver's teardown) and what none of these covers."""
    phases: dict[str, float] = {}
    first_phase = None
    for t, line in stamped:
        if m := PHASE_LINE.search(line):
            phases[m["name"]] = round(phases.get(m["name"], 0.0) + float(m["s"]), 3)
            if first_phase is None:
                first_phase = t - float(m["s"])
    thread = [float(m["s"]) for _, line in stamped if (m := CUDA_THREAD_LINE.search(line))]
    exit_s = wall - stamped[-1][0] if stamped else 0.0
    return {"phases": phases, "cuda_thread_s": thread[0] if thread else None,
            "before_first_phase_s": None if first_phase is None else round(first_phase, 3),
            "exit_s": round(exit_s, 3),
            "unaccounted_s": round(wall - layers_s - sum(phases.values()) - exit_s
                                   - (first_phase or 0.0), 3)}


# The start-up floor: what torch, transformers' DeepSeek-V3 modules, CUDA and the interpreter's
# exit cost in bare processes (no kconvert), each timed from inside (perf_counter) and as a
# process wall.
FLOOR_CODE = """
import json, os, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
out = {"torch_import_s": t1 - t0}
if "model" in sys.argv:
    from transformers.models.deepseek_v3 import modeling_deepseek_v3
    out["transformers_import_s"] = time.perf_counter() - t1
if "cuda" in sys.argv and torch.cuda.is_available():
    t2 = time.perf_counter()
    torch.cuda.init()
    t3 = time.perf_counter()
    torch.empty(0, device="cuda")
    t4 = time.perf_counter()
    a = torch.ones(256, 256, dtype=torch.bfloat16, device="cuda")
    float((a @ a)[0, 0])
    out.update(cuda_init_s=t3 - t2, cuda_context_s=t4 - t3,
               first_matmul_s=time.perf_counter() - t4)
if "pin" in sys.argv and torch.cuda.is_available():
    # pinned host memory the size of a full-size MoE layer's raw bytes (9.8 GB), allocated in
    # blocks as the layer reader asks for it: what the first MoE layer's read pays once
    t5 = time.perf_counter()
    blocks = [torch.empty(148 << 20, dtype=torch.uint8, pin_memory=True) for _ in range(66)]
    out["pin_9.8GB_s"] = time.perf_counter() - t5
print(json.dumps(out), flush=True)
if "quick" in sys.argv:
    os._exit(0)
"""


def floor() -> list[dict]:
    rows = []
    for flags in (["model"], ["model", "quick"], ["model", "cuda"], ["model", "cuda", "quick"],
                  ["cuda", "pin"]):
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", FLOOR_CODE, *flags], capture_output=True,
                              text=True)
        wall = time.perf_counter() - t0
        if proc.returncode:
            rows.append({"flags": flags, "error": proc.stderr[-1000:]})
            continue
        inner = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append({"flags": flags, "wall_s": round(wall, 3),
                     **{k: round(v, 3) for k, v in inner.items()},
                     "outside_s": round(wall - sum(inner.values()), 3)})
    return rows


def main() -> None:
    out_json = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT / "bench_calibrate_cli.json"
    src, data = ROOT / "calib-src", ROOT / f"ids-{SEQS}x{SEQ}.jsonl"
    t0 = time.perf_counter()
    ensure_checkpoint(src)
    if not data.exists():
        make_data(data)
    res: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                 "tree": str(TREE),
                 "make_s": round(time.perf_counter() - t0, 1), "seqs": SEQS, "seq_len": SEQ,
                 "batch": BATCH, "tokens": SEQS * SEQ, "experts": E, "moe_layers": MOE_LAYERS,
                 "targets": {"cold_over_hot": 1.15, "moe_layer_hot_s": 6.0,
                             "wall_minus_layers_s": 6.0}}
    common = ["--data", str(data), "--samples", str(SEQS), "--seq-len", str(SEQ),
              "--batch-size", str(BATCH), "--device", dev]
    stats = ROOT / "stats"
    calibrate = ["calibrate", str(src), "-o", str(stats), "--overwrite", *common]
    commands = os.environ.get("COMMANDS", "calibrate,eval,reap").split(",")
    if os.environ.get("FLOOR", "1") == "1":
        res["floor"] = floor()
    if "calibrate" in commands:
        if os.environ.get("COLD", "1") == "1":
            res["drop_caches_failed"] = drop_page_cache()
            res["calibrate_cold"] = run_cli("calibrate cold", calibrate)
        res["calibrate_hot"] = run_cli("calibrate hot", calibrate)
        if "calibrate_cold" in res:
            cold, hot = (res[k]["moe_layer_s"] for k in ("calibrate_cold", "calibrate_hot"))
            res["moe_cold_over_hot"] = [round(c / h, 3) if h else None
                                        for c, h in zip(cold, hot, strict=True)]
    if "eval" in commands:
        res["eval_hot"] = run_cli("eval", ["eval", str(src), str(src), *common])
    if "reap" in commands:
        pruned = ROOT / "reap-out"
        res["reap_hot"] = run_cli("reap", ["reap", str(src), str(pruned), "--keep",
                                           str(E // 2), "--overwrite", *common])
        shutil.rmtree(pruned, ignore_errors=True)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(res, indent=1) + "\n")
    for key in ("calibrate_cold", "calibrate_hot", "eval_hot", "reap_hot"):
        if key in res:
            r = res[key]
            print(f"{key}: wall {r['wall_s']} s, layers {r['layers_s']} s, MoE layer "
                  f"{r['moe_layer_s']} s, wall - layers {r['wall_minus_layers_s']} s")
            st = r["startup"]
            print(f"  start-up: {st['phases']}, CUDA thread {st['cuda_thread_s']} s, before "
                  f"the first phase {st['before_first_phase_s']} s, exit {st['exit_s']} s, "
                  f"unaccounted {st['unaccounted_s']} s")
    for row in res.get("floor", []):
        print(f"floor {'+'.join(row['flags'])}: {row}")
    print(f"MoE layer cold/hot: {res.get('moe_cold_over_hot')}; wrote {out_json}")


if __name__ == "__main__":
    main()
