"""Learned compression (docs/learned.md): each routed expert's values, and for paired-4:8 its
pattern logits, trained against the source expert's outputs on its routed tokens
(kconvert.methods.expert_training), from the one-shot method's result (SparseGPT for p48,
GPTQ for NVFP4), and written per expert only where its router-weighted output error on
held-out routed tokens is below the one-shot result's.

The engine hands the method a whole work item (`unit = "expert"`: an expert's gate, up and
down together); the calibration pass hands it the layer's captured inputs, routing and
router weights. Matrices of other roles (GPTQ's shared experts, attention) keep the one-shot
result.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from kconvert.calibrate.held_out import split_rows
from kconvert.common.options import SEED
from kconvert.errors import KconvertError
from kconvert.formats import nvfp4, p48
from kconvert.formats.linear import Batch, Transformed
from kconvert.gpu.devices import Stopwatch, deterministic
from kconvert.methods import expert_training as et
from kconvert.methods import obs_memory
from kconvert.methods.gptq import Gptq
from kconvert.methods.obs import HELDOUT_EVERY, HELDOUT_MIN
from kconvert.methods.obs_method import ObsMethod
from kconvert.methods.sparsegpt import SparseGpt
from kconvert.model.names import Role
from kconvert.plugins.methods import LEARNED_NVFP4, LEARNED_P48

log = logging.getLogger(__name__)

# Defaults from the quality-versus-time curves on the trained tiny MoE and the full-size layer's
# seconds per step on one H100 (docs/learned.md, "Steps and tokens"): p48 (its patterns and
# values), then dense NVFP4 (values only).
P48_LR, P48_MASK_LR = 4e-2, 2e-2
NVFP4_LR = 5e-3
# An expert with fewer routed tokens than this to fit on keeps the one-shot result.
MIN_FIT_TOKENS = 64
# The routed tokens an expert needs to be trained and judged (fewer: it keeps the one-shot
# result): HELDOUT_MIN held out, every HELDOUT_EVERY-th, and MIN_FIT_TOKENS left to fit on.
MIN_ROUTED_TOKENS = max(HELDOUT_MIN * HELDOUT_EVERY,
                        math.ceil(MIN_FIT_TOKENS * HELDOUT_EVERY / (HELDOUT_EVERY - 1)))
# The most fit tokens an expert trains on (evenly spaced where it has more): bounds the
# inputs and reference outputs a training batch holds.
MAX_FIT_TOKENS = 8192
# Tokens per call of the router when its weights are taken for the loss, every call this many
# rows (the last padded with zeros, dropped). Under torchrun a rank captures only the tokens
# routed to its experts, so the count differs between rank counts, and a product's rounding
# follows its row count: at Kimi's router shape a row's logits differed between calls of 1,000
# and of 2,048, 15,600, 16,384 or 40,000 rows on an H200, and of 40,000 on a CPU (docs/obs.md,
# "The router's rows"; `python -m benchmarks learned_batches` measures it).
ROUTER_ROWS = 1 << 14


@dataclass
class _Routing:
    """One MoE layer's routed tokens per expert, split as GPTQ splits them: every
    HELDOUT_EVERY-th of an expert's tokens (in token order) held out of the fit."""

    x: torch.Tensor  # every real token's MoE input [N, H]
    fit: list[torch.Tensor]  # per expert its fit tokens' indices into x
    held: list[torch.Tensor]
    fit_g: list[torch.Tensor]  # their router weights, fp32
    held_g: list[torch.Tensor]


class Learned(ObsMethod):
    """Base of the learned methods: `oneshot` gives the starting point and the guard's
    baseline, `sparse` whether the pattern logits are learned too."""

    unit = "expert"
    # Under torchrun each rank trains the experts it holds, on the rows the expert-parallel
    # calibration routed to them (kconvert.calibrate.expert_ranks): an expert's tokens, their
    # order and so its fit and held-out split are one process's.
    across_ranks = True
    oneshot: type[ObsMethod]
    sparse: bool
    lr: float
    mask_lr: float = 0.0

    def __init__(self, inputs) -> None:
        super().__init__(inputs)
        self.oneshot_method = self.oneshot(inputs)
        self.train_settings = et.TrainSettings(
            steps=int(self.settings["steps"]), tokens=int(self.settings["tokens"]), lr=self.lr,
            mask_lr=self.mask_lr,
            seed=SEED)
        self._routing: tuple[int, _Routing] | None = None

    def transforms(self, m) -> bool:
        return self.oneshot_method.transforms(m)

    @property
    def shared_experts(self) -> bool:  # type: ignore[override]
        return self.oneshot_method.shared_experts

    @property
    def against_rtn(self) -> bool:  # type: ignore[override]
        return self.oneshot_method.against_rtn

    def record(self) -> dict[str, object]:
        return {**self.oneshot_method.record(), "method": self.name,
                "steps": self.train_settings.steps, "tokens": self.train_settings.tokens,
                **self.sequential_record()}

    def transform_batch(self, batch: Batch) -> Transformed:
        return self.oneshot_method.transform_batch(batch)

    def transform(self, batches: list[Batch]) -> list[Transformed]:
        watch = Stopwatch(batches[0].weights.device)
        with watch.phase("one-shot"):
            made = [self.oneshot_method.transform_batch(b) for b in batches]
        # the one-shot results are written where learning does not win: `out` starts as them
        out = [Transformed(m.weights, m.codes, _records(m, b))
               for m, b in zip(made, batches, strict=True)]
        experts = _expert_slots(batches)
        if experts:
            layer = next(iter(experts))[0]
            with watch.phase("routing"):
                routing = self._layer_routing(layer)
            ids = sorted(e for _, e in experts)
            # an expert with too few tokens to fit or to judge keeps the one-shot result
            few = [e for e in ids if len(routing.fit[e]) < MIN_FIT_TOKENS
                   or len(routing.held[e]) < HELDOUT_MIN]
            for e in few:
                self._write(experts[(layer, e)], 0, {}, {}, out, False, self._record(
                    None, None, len(routing.fit[e]), len(routing.held[e])))
            trained = [e for e in ids if e not in few]
            per = self._per_batch(batches)
            for start in range(0, len(trained), per):
                chunk = trained[start:start + per]
                group = obs_memory.padded(chunk, per, batches[0].weights.device)
                self._learn(layer, group, len(chunk), [experts[(layer, e)] for e in group],
                            batches, made, out, routing, watch)
            chose = [r for o in out for r in o.records if r and "oneshot" in r]
            log.info("layer %d experts %d-%d: %s; learned written for %d of %d matrices",
                     layer, ids[0], ids[-1], ", ".join(f"{k} {v:.2f} s" for k, v in
                                                      watch.seconds.items()),
                     sum(r["method"] == self.name for r in chose), len(chose))
        if self.calibration.hessians.sequential:
            for b, m in zip(batches, out, strict=True):
                self.write_back(b, m)
        return out

    def gpu_work(self, shapes):
        """The one-shot method's forward and OBS batches, each batch entry (an expert) at
        least what training it takes."""
        work = self.oneshot_method.gpu_work(shapes)
        per_expert = training_bytes(shapes.hidden, shapes.moe_inter, self.sparse,
                                    self.train_settings.tokens)
        return replace(work, obs=replace(work.obs, bytes_per_matrix=max(
            work.obs.bytes_per_matrix, per_expert)))

    def _per_batch(self, batches: list[Batch]) -> int:
        """Experts trained at once: OBS_BATCH, or on a GPU fewer where the GPU plan's share
        holds fewer."""
        budget = self.calibration.hessians.obs_budget(batches[0].weights.device)
        down = next(b for b in batches if b.modules[0].tn.proj == "down_proj").weights
        return obs_memory.per_batch(budget, training_bytes(
            down.shape[1], down.shape[2], self.sparse, self.train_settings.tokens))

    def _layer_routing(self, layer: int) -> _Routing:
        if self._routing is not None and self._routing[0] == layer:
            return self._routing[1]
        moe = self.calibration.hessians.moe_layer(layer)
        x = moe.captured()[0]
        with torch.no_grad():
            weights = torch.cat([router_weights(moe.gate, part)
                                 for part in x.split(ROUTER_ROWS)]).float()
        rows = moe.routed_rows()
        g = weights.reshape(-1)
        fit, held, fit_g, held_g = [], [], [], []
        for t, slots in zip(rows.tokens, rows.slots, strict=True):
            w = g[slots]
            kept, out = split_rows(len(t), HELDOUT_EVERY, t.device)
            every = max(1, -(-len(kept) // MAX_FIT_TOKENS))  # evenly spaced, at most the cap
            fit.append(t[kept[::every]])
            held.append(t[out])
            fit_g.append(w[kept[::every]])
            held_g.append(w[out])
        routing = _Routing(x, fit, held, fit_g, held_g)
        self._routing = (layer, routing)
        return routing

    def _learn(self, layer: int, ids: list[int], real: int,
               slots: list[dict[str, tuple[int, int]]], batches: list[Batch],
               made: list[Transformed], out: list[Transformed], routing: _Routing,
               watch: Stopwatch) -> None:
        """Train experts `ids` of `layer` and write the winners of the first `real` into `out`
        (the rest repeat the last one: obs_memory.padded)."""
        first = batches[slots[0]["gate_proj"][0]]
        enc = et.Encoding(first.spec.group(first.codec), first.spec.rule,
                          first.codec.arithmetic, first.spec.local_dtype)
        device = first.weights.device
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        with torch.no_grad(), watch.phase("data"):
            experts, held, baseline = self._problem(ids, slots, batches, made, routing, enc,
                                                    dtype)
        fit_tokens = [len(x) for x in experts.x]
        generators = [torch.Generator(device=device).manual_seed(
            self.train_settings.seed * 1_000_003 + layer * 1009 + e) for e in ids]
        with torch.enable_grad(), deterministic(), watch.phase("train"):
            values, codes = et.train(experts, enc, self.train_settings, generators, dtype)
        del experts
        with torch.no_grad(), watch.phase("guard"):
            for i, (x, y, g) in enumerate(held[:real]):
                learned = float(_error(x, y, g, values, i, dtype))
                if not math.isfinite(learned):
                    learned = None  # training diverged: nothing to judge, the one-shot stays
                chose = learned is not None and learned < baseline[i]
                self._write(slots[i], i, values, codes, out, chose,
                            self._record(learned, baseline[i], fit_tokens[i], len(x)))

    def _record(self, learned: float | None, oneshot: float | None, fit: int, held: int
                ) -> dict:
        """What the manifest records of one expert's matrices
        (kconvert.plugins.methods.LearnedEntry): learned where its error is strictly below the
        one-shot's."""
        chose = learned is not None and oneshot is not None and learned < oneshot
        return {"method": self.name if chose else self.oneshot.name, "learned_error": learned,
                "oneshot_error": oneshot, "oneshot": self.oneshot.name,
                "steps": self.train_settings.steps, "fit_tokens": fit, "held_out_tokens": held}

    def _problem(self, ids: list[int], slots: list[dict[str, tuple[int, int]]],
                 batches: list[Batch], made: list[Transformed], routing: _Routing,
                 enc: et.Encoding, dtype: torch.dtype
                 ) -> tuple[et.Experts, list[tuple[torch.Tensor, ...]], list[float]]:
        """(the training problem, stacked as gate_up [E, 2I, H] and down [E, H, I]; per expert
        its held-out tokens' inputs, source outputs and router weights; per expert the one-shot
        result's error on them). The source and one-shot matrices are not held past this."""
        device = batches[0].weights.device

        def stacked(get) -> dict[str, torch.Tensor]:
            return {"gate_up": torch.stack([torch.cat([get(s["gate_proj"]), get(s["up_proj"])])
                                            for s in slots]),
                    "down": torch.stack([get(s["down_proj"]) for s in slots])}

        def row_gs(s: tuple[int, int]) -> torch.Tensor:
            b = batches[s[0]]
            gs = nvfp4.tensor_scale(b.amax[s[1]].reshape(1), b.codec.arithmetic)
            return gs.expand(b.weights.shape[1]).to(device)

        source = stacked(lambda s: batches[s[0]].weights[s[1]])
        x_fit = [routing.x[routing.fit[e]].to(device, dtype) for e in ids]
        y_fit = [_outputs(x, source, i, dtype).to(dtype) for i, x in enumerate(x_fit)]
        held = []
        for i, e in enumerate(ids):
            x = routing.x[routing.held[e]].to(device, dtype)
            held.append((x, _outputs(x, source, i, dtype), routing.held_g[e].to(device)))
        oneshot = stacked(lambda s: _values(made[s[0]], batches[s[0]], s[1], enc))
        baseline = [float(_error(x, y, g, oneshot, i, dtype)) for i, (x, y, g) in
                    enumerate(held)]
        keep = None
        if self.sparse:  # where the one-shot pruned, training starts from the source's weight
            keep = {n: _support(v) for n, v in oneshot.items()}
            for n, v in oneshot.items():
                torch.where(keep[n].repeat_interleave(2, -1), v, source[n], out=v)
        del source
        return et.Experts(oneshot, keep, stacked(row_gs), x_fit, y_fit,
                          [routing.fit_g[e].to(device) for e in ids]), held, baseline

    def _write(self, slot: dict[str, tuple[int, int]], i: int, values, codes, out, chose: bool,
               record: dict) -> None:
        """Expert i's gate, up and down (of the stacked `values` and `codes`) into their
        batches' rows of `out` where `chose`, and its record into each."""
        for proj in ("gate_proj", "up_proj", "down_proj"):
            b, j = slot[proj]
            if chose:
                name = "down" if proj == "down_proj" else "gate_up"
                inter = values["down"].shape[-1]
                rows = {"gate_proj": slice(0, inter), "up_proj": slice(inter, None),
                        "down_proj": slice(None)}[proj]
                out[b].weights[j] = values[name][i, rows]
                out[b].codes[j] = codes[name][i, rows]
            out[b].records[j] = record


class LearnedP48(Learned):
    """`sparsify --method learned`: p48 masks and NVFP4 values, from SparseGPT's."""

    declaration = LEARNED_P48
    oneshot = SparseGpt
    sparse = True
    lr, mask_lr = P48_LR, P48_MASK_LR


class LearnedNvfp4(Learned):
    """`quantize --method learned`: NVFP4 values of the routed experts, from GPTQ's."""

    declaration = LEARNED_NVFP4
    oneshot = Gptq
    sparse = False
    lr = NVFP4_LR


def router_weights(gate: Callable[[torch.Tensor], tuple[torch.Tensor, ...]], x: torch.Tensor
                    ) -> torch.Tensor:
    """The router weights [T, k] of at most ROUTER_ROWS tokens x [T, H], computed on
    ROUTER_ROWS rows (x, then zeros)."""
    if len(x) > ROUTER_ROWS:
        raise ValueError(f"router_weights takes at most {ROUTER_ROWS} tokens a call, not {len(x)}")
    if len(x) == ROUTER_ROWS:
        return gate(x)[1]
    return gate(torch.cat([x, x.new_zeros(ROUTER_ROWS - len(x), x.shape[1])]))[1][:len(x)]


def training_bytes(hidden: int, inter: int, sparse: bool, tokens: int) -> int:
    """Device bytes training one expert holds: per weight the fp32 master and Adam's two
    moments (12), a step's rounded values and their gradient (bf16, 4) and slack for the
    compiled passes' temporaries (8), and with p48 the pattern logits (6 per 8 weights) with
    their moments (9) and a step's masked fp32 weights (4, one matrix at a time, plus 3 of
    slack); its fit tokens' inputs and reference outputs (bf16); a step's activations and
    their gradients. (Measured on one H100 before the trainer's fused update, which dropped the
    fp32 gradients and autograd's copies: 29.8 bytes a weight dense, 43 with p48, the data and
    activations included: benchmarks/results/README.md.)"""
    per_weight = 24 + (16 if sparse else 0)
    data = MAX_FIT_TOKENS * hidden * 2 * 2
    step = tokens * (hidden * (2 + 2 + 4 + 4) + 3 * inter * (2 + 4) * 2)
    return 3 * hidden * inter * per_weight + data + step


def _expert_slots(batches: list[Batch]) -> dict[tuple[int, int], dict[str, tuple[int, int]]]:
    """(layer, expert) -> projection -> (batch, row in batch) of every routed expert matrix;
    an expert whose gate, up and down are not all here is an error."""
    slots: dict[tuple[int, int], dict[str, tuple[int, int]]] = {}
    for b, batch in enumerate(batches):
        for j, m in enumerate(batch.modules):
            if m.tn.role is Role.ROUTED_EXPERT:
                slots.setdefault((m.tn.layer, m.tn.expert), {})[m.tn.proj] = (b, j)
    for key, found in slots.items():
        if set(found) != {"gate_proj", "up_proj", "down_proj"}:
            raise KconvertError(f"--method learned trains an expert's gate, up and down "
                                f"together, and this work item holds only {sorted(found)} of "
                                f"layer {key[0]} expert {key[1]}")
    return slots


def _records(made: Transformed, batch: Batch) -> list[dict | None]:
    return list(made.records) if made.records else [None] * len(batch.modules)


def _values(made: Transformed, batch: Batch, j: int, enc: et.Encoding) -> torch.Tensor:
    """The values the one-shot result of matrix j writes (on NVFP4's grid, by its codes)."""
    w = made.weights[j]
    gs = nvfp4.tensor_scale(batch.amax[j].reshape(1), batch.codec.arithmetic).to(w.device)
    return nvfp4.fake_quantize(w.reshape(w.shape[0], -1, enc.group), made.codes[j],
                               gs.expand(w.shape[0]).reshape(-1, 1),
                               enc.arithmetic).reshape(w.shape)


def _support(values: torch.Tensor) -> torch.Tensor:
    """The p48 pair mask [..., K/2] of one-shot values: the nonzero pairs of each chunk, filled
    to 2 with its lowest-index zero pairs (a kept pair may have quantized to 0)."""
    pairs = (values.reshape(*values.shape[:-1], -1, p48.PAIRS, 2) != 0).any(-1)
    rank = (~pairs).long() * p48.PAIRS + torch.arange(p48.PAIRS, device=values.device)
    order = (rank.unsqueeze(-1) > rank.unsqueeze(-2)).sum(-1)
    return (order < p48.KEEP).reshape(*values.shape[:-1], -1)


def _outputs(x: torch.Tensor, w: dict[str, torch.Tensor], i: int, dtype: torch.dtype
             ) -> torch.Tensor:
    """Expert i of stacked matrices `w` on its inputs x [T, H], fp32 [T, H]."""
    return et.expert_outputs(x[None], w["gate_up"][i:i + 1].to(dtype),
                             w["down"][i:i + 1].to(dtype))[0].float()


def _error(x: torch.Tensor, y: torch.Tensor, g: torch.Tensor, w: dict[str, torch.Tensor],
           i: int, dtype: torch.dtype) -> torch.Tensor:
    """sum_t g_t^2 |f_w(x_t) - y_t|^2 of expert i."""
    return ((_outputs(x, w, i, dtype) - y).square().sum(-1) * g.square()).sum()
