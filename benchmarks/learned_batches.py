"""Whether a learned expert's bits depend on the batch it trains in, and the router's rows on
the call's row count (docs/obs.md, "A batch's size changes its experts' bits on a GPU").

The trainer (kconvert.methods.expert_training.train) trains E experts stacked; under torchrun a
rank trains only its block of experts, so an expert may train beside other experts, and in
batches of another count, than in one process. Random experts (weights, fit tokens, router
weights, and the source expert a little off the weights) are trained, each from its own seeded
generator as the method seeds them, in six runs: A = experts 0-15; A again; B = 0-11 and
four repeats of 11 (the padding of a GPU batch, kconvert.methods.obs_memory.padded); C = 12-23
and four repeats; D = 16-23 and eight repeats; and E = 0-11 alone, a batch of 12. Each
comparison lists the experts whose trained values differ in any bit: A again, B and C against
A and D against C test the neighbours at one batch count, E against A the count itself. Then
the router's product (fp32, as transformers' DeepseekV3TopkRouter takes it), at the trained
tiny MoE's shape and Kimi's: 1,000 rows as a call of their own against the first rows of
larger calls (the count), and against the same rows at the end of a call of 16,384 (the
position; a rank's token lies elsewhere in its calls than in one process's).

    python3 -m benchmarks learned_batches --device cuda $OUT/learned_batches.json
    python -m benchmarks learned_batches --tiny /tmp/learned_batches.json   # CPU, seconds
"""

from __future__ import annotations

import time

import torch

from benchmarks.harness import arguments, log, parse, record, result_path, save
from kconvert.formats import nvfp4
from kconvert.gpu.devices import deterministic
from kconvert.methods import expert_training as et
from kconvert.methods.learned import NVFP4_LR, P48_LR, P48_MASK_LR

BATCHES = {"A": list(range(16)), "B": list(range(12)) + [11] * 4,
           "C": list(range(12, 24)) + [23] * 4, "D": list(range(16, 24)) + [23] * 8,
           "E": list(range(12))}
# (a run, the run it is compared with, the expert ids compared)
COMPARED = (("A again", "A", range(16)), ("B", "A", range(12)), ("C", "A", range(12, 16)),
            ("D", "C", range(16, 24)), ("E", "A", range(12)))
CALL_ROWS = (1000, 2048, 4096, 15600, 16384, 40000)  # the router's calls


class Problem:
    """24 random experts of `hidden` x `inter` and what they train on (CPU tensors)."""

    def __init__(self, hidden: int, inter: int, tokens: int):
        gen = torch.Generator().manual_seed(0)
        self.w = {"gate_up": torch.randn(24, 2 * inter, hidden, generator=gen) * 0.05,
                  "down": torch.randn(24, hidden, inter, generator=gen) * 0.05}
        self.source = {n: v + 0.01 * torch.randn(v.shape, generator=gen)
                       for n, v in self.w.items()}
        self.x = [torch.randn(tokens + 37 * e, hidden, generator=gen) for e in range(24)]
        self.g = [torch.rand(len(x), generator=gen) for x in self.x]
        # a p48 support per expert (2 of each chunk's 4 pairs kept), drawn once for all 24
        self.keep = {n: (torch.rand(*v.shape[:-1], v.shape[-1] // 8, 4, generator=gen)
                         .argsort(-1) < 2).reshape(*v.shape[:-1], -1)
                     for n, v in self.w.items()}

    def experts(self, ids: list[int], sparse: bool, device: torch.device,
                dtype: torch.dtype) -> et.Experts:
        def rows_gs(v: torch.Tensor) -> torch.Tensor:
            gs = nvfp4.tensor_scale(v.abs().amax((-1, -2)), "compressed-tensors")
            return gs[:, None].expand(v.shape[0], v.shape[1]).contiguous().to(device)

        source = {n: v[ids].to(device, dtype) for n, v in self.source.items()}
        xs = [self.x[e].to(device, dtype) for e in ids]
        ys = [et.expert_outputs(x[None], source["gate_up"][i:i + 1],
                                source["down"][i:i + 1])[0].to(dtype)
              for i, x in enumerate(xs)]
        keep = {n: v[ids].to(device) for n, v in self.keep.items()} if sparse else None
        return et.Experts({n: v[ids].clone().to(device) for n, v in self.w.items()}, keep,
                          {n: rows_gs(v[ids]) for n, v in self.w.items()}, xs, ys,
                          [self.g[e].to(device) for e in ids])


def trained(problem: Problem, ids: list[int], sparse: bool, steps: int,
            device: torch.device) -> dict[str, torch.Tensor]:
    """The trained values of experts `ids` as one batch, each from its own generator."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    settings = et.TrainSettings(steps=steps, tokens=256, lr=P48_LR if sparse else NVFP4_LR,
                                mask_lr=P48_MASK_LR if sparse else 0.0, seed=0)
    gens = [torch.Generator(device=device).manual_seed(1009 + e) for e in ids]
    enc = et.Encoding(nvfp4.BLOCK, "mse", "compressed-tensors")
    with torch.enable_grad(), deterministic():
        values, _ = et.train(problem.experts(ids, sparse, device, dtype), enc, settings, gens,
                             dtype)
    return {n: v.cpu() for n, v in values.items()}


def compare(runs: dict, label: str, first: str, experts: range) -> dict:
    """Expert ids `experts` of run `label` against run `first` (each expert where it sits in
    its run's batch): how many values were compared, and the experts whose values differ."""
    ids = {name: BATCHES[name.split()[0]] for name in (label, first)}
    values, differ = 0, []
    for e in experts:
        pairs = [(runs[first][n][ids[first].index(e)], runs[label][n][ids[label].index(e)])
                 for n in runs[first]]
        values += sum(p.numel() for p, _ in pairs)
        if not all(torch.equal(p, q) for p, q in pairs):
            differ.append(e)
    return {"values": values, "differing": differ}


def router_rows(device: torch.device, shapes: list[tuple[int, int]]) -> dict[str, dict]:
    """Per (hidden, experts), of 1,000 rows whose fp32 router logits are taken as a call of
    their own: how many differ as the first rows of a call of each of CALL_ROWS rows, and as
    the last rows of a call of 16,384."""
    gen = torch.Generator().manual_seed(1)
    out = {}
    for hidden, experts in shapes:
        w = (torch.randn(experts, hidden, generator=gen) * 0.02).to(device)
        x = torch.randn(CALL_ROWS[-1], hidden, generator=gen).to(device, torch.bfloat16)
        ref = torch.nn.functional.linear(x[:1000].float(), w)
        calls = [x[:m] for m in CALL_ROWS]
        moved = torch.cat([x[1000:16384], x[:1000]])
        got = [torch.nn.functional.linear(c.float(), w)[:1000] for c in calls]
        got.append(torch.nn.functional.linear(moved.float(), w)[-1000:])
        differ = [int((g != ref).any(-1).sum()) for g in got]
        out[f"{hidden}x{experts}"] = {"first rows of a call": differ[:-1],
                                      "last rows of a call of 16384": differ[-1]}
    return out


def main(argv: list[str]) -> None:
    ap = arguments("learned_batches", __doc__, results=True)
    ap.add_argument("out", nargs="?", help="JSON results file (default: in --out-dir)")
    ap.add_argument("--tiny", action="store_true", help="a CPU check: small experts, 2 steps")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--hidden", type=int, default=128, help="(default: the trained tiny MoE's)")
    ap.add_argument("--inter", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=2000, help="fit tokens of expert 0")
    ap.add_argument("--steps", type=int, nargs=2, default=[50, 25],
                    help="NVFP4's and p48's steps (default: the methods')")
    ap.add_argument("--router-shapes", default="128x24,7168x384",
                    help="router shapes HIDDENxEXPERTS,... (default: %(default)s)")
    a = parse(ap, argv, tiny={"device": "cpu", "hidden": 32, "inter": 16, "tokens": 300,
                              "steps": [2, 2], "router_shapes": "32x24"})
    device = torch.device(a.device)
    rec = record("learned_batches", gpu=device.type == "cuda")
    problem = Problem(a.hidden, a.inter, a.tokens)
    res: dict = {"record": rec, "dims": [a.hidden, a.inter], "steps": a.steps,
                 "batches": BATCHES}
    for method, sparse, steps in (("nvfp4", False, a.steps[0]), ("p48", True, a.steps[1])):
        t0 = time.perf_counter()
        runs = {name: trained(problem, ids, sparse, steps, device)
                for name, ids in BATCHES.items()}
        runs["A again"] = trained(problem, BATCHES["A"], sparse, steps, device)
        res[method] = {f"{label} against {first}": compare(runs, label, first, experts)
                       for label, first, experts in COMPARED}
        res[method]["seconds"] = round(time.perf_counter() - t0, 1)
        log(method, res[method])
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.router_shapes.split(",")]
    res["router_rows"] = {"calls": CALL_ROWS, "differing": router_rows(device, shapes)}
    log("router", res["router_rows"])
    print("wrote", save(res, result_path(rec, a.out, out_dir=a.out_dir)))
