"""Loading one decoder layer in two halves: `read_layer` reads and checks every byte of the
layer's tensors into host memory (the disk-bound half, which names the file and tensor of
anything wrong), `build_layer` decodes them on the device and builds transformers' decoder
layer (the device-bound half). The layer prefetcher (`prefetch.py`) runs the first half, and
the second where memory allows, for layer L+1 while layer L computes."""

from __future__ import annotations

from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch
from torch import nn

from kconvert.calibrate.expert_ranks import ExpertRanks
from kconvert.calibrate.forward import PROJS, InputGram, Layer, LinearStats
from kconvert.calibrate.moe import Experts, ForwardContext, MoEBlock
from kconvert.errors import KconvertError
from kconvert.formats import Codec
from kconvert.formats.linear import ModuleWork, group_modules
from kconvert.io.checkpoint import Checkpoint
from kconvert.io.finite import find_nonfinite
from kconvert.io.shards import TensorInfo
from kconvert.model.names import Role, parse_name

# KV-cache quantization scales some exports carry: no effect on an unquantized forward.
KV_SCALES = {"k_scale", "v_scale"}


# Decoded fp32 elements per batch of routed experts while a layer's weights are decoded, and
# what that decode holds per element: the fp32 decode, its copy in the compute dtype and the
# packed source bytes.
DECODE_ELEMS = {"cuda": 1 << 28, "cpu": 1 << 24}
DECODE_BYTES_PER_ELEM = 4 + 2 + 1


def decode_bytes(device: torch.device, layer_elems: int | None = None) -> int:
    """Device bytes a layer's decode holds at once beside the layer: one batch of routed
    experts, DECODE_ELEMS decoded elements (or the layer's `layer_elems` when fewer; the GPU
    memory plan's term, kconvert.calibrate.plan)."""
    elems = DECODE_ELEMS.get(device.type, DECODE_ELEMS["cpu"])
    if layer_elems is not None:
        elems = min(elems, layer_elems)
    return elems * DECODE_BYTES_PER_ELEM


# Threads reading a layer's routed experts: several reads in flight keep an NVMe queue busy
# (and copy from the page cache faster than one thread when the file is cached).
READ_THREADS = 8


@dataclass
class ExpertBatch:
    """Routed-expert linears of one codec and shape whose parameters were read side by side."""

    codec: type[Codec]
    shape: tuple[int, int]
    members: list[tuple[int, str]]  # (expert, proj) of each row of `params`
    params: dict[str, torch.Tensor]  # codec parameter -> [len(members), *shape], raw dtype


@dataclass
class LayerBytes:
    """Every tensor of decoder layer `layer`, read and checked, not yet decoded."""

    layer: int
    prefix: str  # "model.layers.L." (whatever the checkpoint's prefix)
    linears: list[tuple[ModuleWork, dict[str, torch.Tensor]]]  # non-expert linears
    others: dict[str, torch.Tensor]  # norms, router, bias: name relative to `prefix`
    experts: list[ExpertBatch]
    expert_names: list[dict[str, str]]  # expert -> proj -> checkpoint module (every expert)
    decoded_nbytes: int  # the layer's weights once decoded to the compute dtype
    # the routed experts read (all of them, or this rank's share); None: a dense layer
    held: range | None = None

    @property
    def nbytes(self) -> int:
        tensors = [*self.others.values(), *(t for _, p in self.linears for t in p.values()),
                   *(t for b in self.experts for t in b.params.values())]
        return sum(t.numel() * t.element_size() for t in tensors)

    def to(self, device: torch.device) -> LayerBytes:
        """The same bytes on `device` (copies from pinned memory run asynchronously)."""
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return replace(
            self, linears=[(m, {p: move(t) for p, t in params.items()})
                           for m, params in self.linears],
            others={k: move(t) for k, t in self.others.items()},
            experts=[replace(b, params={p: move(t) for p, t in b.params.items()})
                     for b in self.experts])


def read_layer(ckpt: Checkpoint, cfg, layer: int, tensors: dict[str, TensorInfo],
               dtype: torch.dtype, device: torch.device, held: range | None = None
               ) -> LayerBytes:
    """Layer L's tensors in host memory (pinned when `device` is a GPU), checked against the
    config: any error names the file and tensor. `held`: the routed experts to read (under
    torchrun this rank's share, kconvert.calibrate.expert_ranks; None: all)."""
    pin = device.type == "cuda"
    held = range(cfg.n_routed_experts) if held is None else held
    for name, info in tensors.items():  # the kernel reads the layer's bytes ahead of the loop
        tn = parse_name(name)
        if tn.role is not Role.ROUTED_EXPERT or tn.expert in held:
            ckpt.reader_for(info).will_need(info)
    prefix = f"{parse_name(next(iter(tensors))).prefix}layers.{layer}."
    shape_values = {n: ckpt.reader_for(i).read_ints(i)
                    for n, i in tensors.items() if n.endswith(".weight_shape")}
    modules, other_infos = group_modules(tensors, shape_values)
    experts = [m for m in modules if m.tn.role is Role.ROUTED_EXPERT]
    is_moe = layer >= cfg.first_k_dense_replace
    if is_moe != bool(experts):
        raise KconvertError(f"layer {layer}: first_k_dense_replace={cfg.first_k_dense_replace} "
                            f"but the layer has {len(experts)} routed expert linears")
    item = torch.empty((), dtype=dtype).element_size()
    linears = []
    decoded = 0
    for m in modules:
        if m.tn.role is not Role.ROUTED_EXPERT:
            linears.append((m, {p: _read(ckpt, m.params[p], pin) for p in m.codec.params}))
            decoded += m.shape[0] * m.shape[1] * item
    others = {}
    for info in other_infos:
        if info.name.endswith(".weight_shape") or info.name.rsplit(".", 1)[-1] in KV_SCALES:
            continue
        t = _read(ckpt, info, pin)
        if not t.is_floating_point():
            raise KconvertError("unexpected non-float tensor in a decoder layer",
                                file=info.file.name, tensor=info.name)
        others[info.name[len(prefix):]] = t
        decoded += t.numel() * item
    batches, names = (_read_experts(ckpt, cfg, experts, layer, device, pin, held) if is_moe
                      else ([], []))
    decoded += sum(len(b.members) * b.shape[0] * b.shape[1] for b in batches) * item
    return LayerBytes(layer, prefix, linears, others, batches, names, decoded,
                      held if is_moe else None)


def nonfinite_hidden_error(ckpt: Checkpoint, tensors: dict[str, TensorInfo], layer: int,
                           what: str = "") -> KconvertError:
    """The error for non-finite hidden states after decoder layer `layer` (`tensors`: its
    source tensors), naming where to look: the first tensor of the layer that holds a NaN or
    Inf, or, where all are finite (the activations overflowed), the float tensor of largest
    magnitude. `what` qualifies the layer (" with its compressed experts"). Read only on this
    failure path."""
    floats = {n: i for n, i in sorted(tensors.items()) if i.torch_dtype.is_floating_point}
    largest, where = -1.0, None
    for name, info in floats.items():
        t = _read(ckpt, info).contiguous()
        if find_nonfinite(t.reshape(-1).view(torch.uint8), info.torch_dtype) is not None:
            return KconvertError(f"non-finite hidden states after decoder layer {layer}{what}: "
                                 "the source weights hold NaN or Inf", file=info.file.name,
                                 tensor=name)
        peak = float(t.float().abs().max()) if t.numel() else 0.0
        if peak > largest:
            largest, where = peak, info
    if where is None:
        return KconvertError(f"non-finite hidden states after decoder layer {layer}{what}")
    return KconvertError(f"non-finite hidden states after decoder layer {layer}{what}; its "
                         f"source weights are finite: the activations overflowed; its largest "
                         f"value, {largest:.4g}, is in the tensor named here (a float32 run, "
                         "--dtype float32, has more range)", file=where.file.name,
                         tensor=where.name)


def _read(ckpt: Checkpoint, info: TensorInfo, pin: bool = False) -> torch.Tensor:
    return ckpt.reader_for(info).read(info, pin)


def _read_experts(ckpt: Checkpoint, cfg, modules: list[ModuleWork], layer: int,
                  device: torch.device, pin: bool, held: range
                  ) -> tuple[list[ExpertBatch], list[dict[str, str]]]:
    n, hidden, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    by_id: dict[int, dict[str, ModuleWork]] = {}
    for m in modules:
        by_id.setdefault(m.tn.expert, {})[m.tn.proj] = m
    missing = [e for e in range(n) if set(by_id.get(e, {})) != set(PROJS)]
    extra = sorted(set(by_id) - set(range(n)))
    if missing or extra:
        raise KconvertError(f"layer {layer}: routed experts must be 0..{n - 1} with gate/up/down "
                            f"(n_routed_experts); incomplete {missing[:8]}, unexpected "
                            f"{extra[:8]}", file=modules[0].primary.file.name if modules else None)
    want = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    groups: dict[tuple, list[tuple[int, str, ModuleWork]]] = {}
    for e in range(n):
        for proj, m in by_id[e].items():
            if tuple(m.shape) != want[proj]:
                raise KconvertError(f"expert linear is {list(m.shape)}, config says "
                                    f"{list(want[proj])}", file=m.primary.file.name,
                                    tensor=m.module)
            if e not in held:
                continue
            groups.setdefault((m.codec, tuple(m.shape)), []).append((e, proj, m))
    # Batches sized for the decode's fp32 temporaries on the device.
    budget = DECODE_ELEMS.get(device.type, DECODE_ELEMS["cpu"])
    batches = []
    reads: list[tuple[TensorInfo, torch.Tensor]] = []  # (tensor, where its bytes go)
    for (codec, shape), members in groups.items():
        step = max(1, budget // (shape[0] * shape[1]))
        for i in range(0, len(members), step):
            chunk = members[i:i + step]
            params = {}
            for p in codec.params:
                first = chunk[0][2].params[p]
                raw = torch.empty(len(chunk), first.nbytes, dtype=torch.uint8, pin_memory=pin)
                for j, (_, _, m) in enumerate(chunk):
                    info = m.params[p]
                    if info.shape != first.shape or info.dtype != first.dtype:
                        raise KconvertError(f"{p} is {info.dtype}{list(info.shape)} but its "
                                            f"siblings are {first.dtype}{list(first.shape)}",
                                            file=info.file.name, tensor=info.name)
                    reads.append((info, raw[j]))
                params[p] = raw.view(first.torch_dtype).reshape(len(chunk), *first.shape)
            batches.append(ExpertBatch(codec, shape, [(e, proj) for e, proj, _ in chunk],
                                       params))
    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kconvert-read") as pool:
        # list(): the first failed read raises here, naming its file and tensor
        list(pool.map(lambda r: ckpt.reader_for(r[0]).read_into(*r), reads))
    names = [{proj: by_id[e][proj].module for proj in PROJS} for e in range(n)]
    return batches, names


def build_layer(raw: LayerBytes, cfg, ctx: ForwardContext, device: torch.device,
                dtype: torch.dtype, stats: bool = True, grams: Collection[Role] = (),
                held_every: int = 0, ranks: ExpertRanks | None = None) -> Layer:
    """transformers' decoder layer holding exactly the layer's tensors, decoded on `device`;
    with `stats` False it computes the forward alone (no calibration statistics). The linears
    of the roles in `grams` (transformers' nn.Linear modules: attention, dense MLP) accumulate
    their input Gram (`InputGram`, `held_every`), one per fused set: its linears see one input.
    `ranks`: an expert-parallel MoE layer's blocks (`raw` holds this rank's experts)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    layer, prefix = raw.layer, raw.prefix
    state: dict[str, torch.Tensor] = {}
    for m, params in raw.linears:
        t = {p: v.to(device).unsqueeze(0) for p, v in params.items()}
        state[m.module[len(prefix):] + ".weight"] = m.codec.decode(t, m.shape)[0].to(dtype)
    for rel, t in raw.others.items():
        # e_score_correction_bias stays F32 (transformers keeps it in fp32 too).
        state[rel] = t.to(device, torch.float32 if rel.endswith("e_score_correction_bias")
                          else dtype)
    with torch.device("meta"):
        module = DeepseekV3DecoderLayer(cfg, layer)
    moe = None
    if raw.held is not None:
        moe = MoEBlock(cfg, ctx, _decode_experts(raw, cfg, device, dtype), device, ranks)
        module.mlp = moe
    try:
        module.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise KconvertError(f"layer {layer} does not match the config: {exc}",
                            tensor=prefix.rstrip(".")) from exc
    module.eval()

    linear_stats: dict[str, LinearStats] = {}
    hooks = []
    if moe is not None:
        moe.collect = stats
    for rel, sub in module.named_modules() if stats else ():
        if isinstance(sub, nn.Linear):
            acc = linear_stats[prefix + rel] = LinearStats(sub.in_features, device)
            hooks.append(sub.register_forward_pre_hook(
                lambda _mod, args, acc=acc: acc.add(ctx.real_rows(args[0]))))
    input_grams: dict[str, InputGram] = {}
    for rel, sub in module.named_modules() if grams else ():
        if not isinstance(sub, nn.Linear):
            continue
        tn = parse_name(f"{prefix}{rel}.weight")
        if tn.role in grams and tn.fused_set not in input_grams:
            gram = input_grams[tn.fused_set] = InputGram(sub.in_features, device, held_every)
            hooks.append(sub.register_forward_pre_hook(
                lambda _mod, args, gram=gram: gram.add(ctx.real_rows(args[0]))))
    return Layer(module, moe, linear_stats, hooks, input_grams)


def _decode_experts(raw: LayerBytes, cfg, device: torch.device, dtype: torch.dtype) -> Experts:
    n, hidden, inter = len(raw.held), cfg.hidden_size, cfg.moe_intermediate_size
    gate_up = torch.empty(n, 2 * inter, hidden, dtype=dtype, device=device)
    down = torch.empty(n, hidden, inter, dtype=dtype, device=device)
    for batch in raw.experts:
        params = {p: t.to(device) for p, t in batch.params.items()}
        w = batch.codec.decode(params, batch.shape).to(dtype)
        for j, (expert, proj) in enumerate(batch.members):
            e = expert - raw.held.start
            if proj == "gate_proj":
                gate_up[e, :inter] = w[j]
            elif proj == "up_proj":
                gate_up[e, inter:] = w[j]
            else:
                down[e] = w[j]
        del w, params
    return Experts(gate_up, down, raw.expert_names, raw.held.start)


def tensors_by_layer(ckpt: Checkpoint, n_layers: int) -> dict[int, dict[str, TensorInfo]]:
    layers: dict[int, dict[str, TensorInfo]] = {}
    for name, info in ckpt.tensors.items():
        tn = parse_name(name)
        if tn.layer is not None:
            layers.setdefault(tn.layer, {})[name] = info
    missing = [L for L in range(n_layers) if L not in layers]
    if missing:
        raise KconvertError(f"decoder layers {missing[:8]} have no tensors "
                            f"(num_hidden_layers={n_layers})")
    # Layers past the decoder stack are the multi-token-prediction layers the config counts;
    # any others would be skipped silently by a forward that runs num_hidden_layers layers.
    mtp = ckpt.text_config.get("num_nextn_predict_layers", 0)
    first_beyond = n_layers + mtp
    extra = sorted(layer for layer in layers if layer >= first_beyond)
    if extra:
        name = next(iter(layers[extra[0]]))
        raise KconvertError(f"the shards hold decoder layers {extra[:8]} beyond the config's "
                            f"num_hidden_layers={n_layers} (and num_nextn_predict_layers={mtp})",
                            file=layers[extra[0]][name].file.name, tensor=name)
    return layers
