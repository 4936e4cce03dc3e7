"""Re-fitted matrices written in their source's own format (reap.md, "Compensation").

Compensation fits on the decoded weights (fp32); what it writes must be what a loader of the
source format reads, so each re-fitted matrix is encoded by the codec of its source
module (Codec.encode, the call `quantize` makes), with the same parameter names, dtypes and
shapes: BF16 stays BF16 (rounded), INT4 becomes compressed-tensors' symmetric INT4 again (its
group size and scale dtype), NVFP4 and MXFP4 are encoded with the block-scale rule the
source's manifest records (`mse`, kconvert's default, when there is none). Parameters the
encoder does not write (an NVFP4 input scale) are the source's bytes. The matrices of a layer
that share a codec are encoded in batches on the device.
"""

from __future__ import annotations

import errno
import math
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kconvert.errors import KconvertError
from kconvert.formats import (
    DEFAULT_SCALE_RULE,
    STORAGE_CODECS,
    Codec,
    EncodeSpec,
    detect_codec,
    encode_spec,
)
from kconvert.io.checkpoint import Checkpoint
from kconvert.io.files import human_bytes
from kconvert.io.shards import TensorInfo
from kconvert.model.names import Role, parse_name
from kconvert.records.manifest import MANIFEST, read_manifest

# Matrices encoded at once on the device: 16 Kimi down_proj are 0.9 GB in fp32.
ENCODE_BATCH = 16


@dataclass(frozen=True)
class SourceLinear:
    """A source down_proj as stored: its module name, format and parameter tensors."""

    module: str
    codec: type[Codec]
    params: dict[str, TensorInfo]

    @property
    def quantized(self) -> bool:
        return self.codec.quantized

    def spec(self, inputs: int, rule: str) -> EncodeSpec:
        """How its matrices are encoded: the source's dtypes, its block size (read off the
        stored scale's shape) and the block-scale `rule`."""
        scale = self.params.get("weight_scale")
        return encode_spec(self.codec, self.params[self.codec.params[0]].torch_dtype, rule,
                           inputs // scale.shape[-1] if scale is not None else None,
                           {p: info.dtype for p, info in self.params.items()})


def expert_linears(ckpt: Checkpoint, proj: str) -> dict[int, dict[int | None, SourceLinear]]:
    """Per MoE layer, per routed expert id (None: the shared expert), its linear `proj`
    (down_proj, gate_proj or up_proj)."""
    params: dict[str, dict[str, TensorInfo]] = {}
    for name, info in ckpt.tensors.items():
        tn = parse_name(name)
        if tn.role in (Role.ROUTED_EXPERT, Role.SHARED_EXPERT) and tn.proj == proj:
            params.setdefault(tn.module, {})[tn.param] = info
    out: dict[int, dict[int | None, SourceLinear]] = {}
    for module, infos in params.items():
        tn = parse_name(next(iter(infos.values())).name)
        codec = detect_codec(infos)
        if codec is None or codec in STORAGE_CODECS.values():
            # a sparse storage holds paired-4:8 values, which a re-fit would not keep
            found = codec.description if codec is not None else f"parameters {sorted(infos)}"
            raise KconvertError(f"compensation cannot write a re-fitted {proj} in this "
                                f"format ({found}); convert the source to BF16, INT4, NVFP4 "
                                "or MXFP4 first", tensor=module)
        out.setdefault(tn.layer, {})[tn.expert] = SourceLinear(module, codec, infos)
    return out


def spilled(spill: Path | None, layer: int, tensors: dict[str, torch.Tensor]
            ) -> dict[str, torch.Tensor]:
    """`tensors` (a layer's re-fitted matrices as written) saved in the spill directory and
    memory-mapped back (file pages, which the kernel may drop), or as they are without one."""
    if spill is None:
        return tensors
    path = spill / f"layer-{layer}.pt"
    try:
        torch.save(tensors, path)
    except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as either
        path.unlink(missing_ok=True)
        nbytes = sum(t.nbytes for t in tensors.values())
        free = shutil.disk_usage(spill).free
        if getattr(exc, "errno", None) not in (errno.ENOSPC, errno.EDQUOT) and free >= nbytes:
            raise
        raise KconvertError(
            f"the disk filled up while spilling layer {layer}'s re-fitted matrices "
            f"({human_bytes(nbytes)}, {human_bytes(free)} free): compensation keeps every "
            "layer's re-fitted matrices on DST's file system until they are written; free "
            "space there and run again", file=str(path)) from exc
    return torch.load(path, mmap=True, weights_only=True)


def block_scale_rule(ckpt: Checkpoint) -> str:
    """The block-scale rule the source's own quantization recorded (its kconvert manifest's
    quantize stage), else kconvert's default. Refuses a source its record says was made
    paired-4:8 sparse: a re-fitted matrix would not keep the pattern."""
    path = ckpt.root / MANIFEST
    if not path.is_file():
        return DEFAULT_SCALE_RULE
    try:
        options = read_manifest(path).options
    except ValueError as exc:
        raise KconvertError(f"unreadable manifest: {exc}", file=str(path)) from exc
    # Each stage's record, read by its own fields: the one that declares a sparsity `pattern`
    # names the roles made sparse in its `targets`; the one that chose a `block_scale` rule
    # (quantize) names it.
    records = [r for r in options.values() if isinstance(r, dict)]
    sparse = {role for r in records if r.get("pattern") for role in r.get("targets") or ()}
    if sparse & {Role.ROUTED_EXPERT.value, Role.SHARED_EXPERT.value}:
        raise KconvertError("the source's experts are paired-4:8 sparse (its manifest records "
                            "`sparsify`), which a re-fitted down_proj would not keep: "
                            "compensate before sparsifying", file=str(path))
    return next((r["block_scale"] for r in records if r.get("block_scale")), DEFAULT_SCALE_RULE)


def encode(ckpt: Checkpoint, linears: Sequence[SourceLinear],
           weight: Callable[[int], torch.Tensor], rule: str | None, device: torch.device,
           amax: torch.Tensor | None = None) -> list[dict[str, torch.Tensor]]:
    """Each fp32 matrix [out, in] `weight(i)` as its source module `linears[i]` stores it
    (parameter -> tensor: the encoder's on `device`, the source's unchanged ones on the host):
    same-format matrices are encoded together on `device`, ENCODE_BATCH at a time, each
    matrix made when its batch is (a Kimi layer's 193 in fp32 would take 11 GB). `amax` [N]:
    the amax matrix i's per-tensor scale is made for, where its format has one (the members of
    a fused set share their largest: gate and up), else each matrix's own."""
    out: list[dict[str, torch.Tensor] | None] = [None] * len(linears)
    batches: dict[tuple, list[int]] = {}
    for i, lin in enumerate(linears):
        stored = tuple((p, info.dtype, tuple(info.shape)) for p, info in sorted(lin.params.items()))
        batches.setdefault((lin.codec, stored), []).append(i)
    for (codec, _), members in batches.items():
        for start in range(0, len(members), ENCODE_BATCH):
            chunk = members[start:start + ENCODE_BATCH]
            w = torch.stack([weight(i).to(device, torch.float32) for i in chunk])
            shared = None if amax is None else amax[chunk].to(device, torch.float32)
            for i, params in zip(chunk, _encode_batch(codec, linears[chunk[0]], w, rule, shared),
                                 strict=True):
                out[i] = _as_stored(ckpt, linears[i], params)
    return out  # type: ignore[return-value]


def decode(lin: SourceLinear, params: dict[str, torch.Tensor], device: torch.device
           ) -> torch.Tensor:
    """The matrix [out, in] that `params` (as `encode` wrote them) hold, fp32 on `device`
    (a quantized one decoded exactly)."""
    return decode_all([lin], [params], device)[0]


def decode_all(linears: Sequence[SourceLinear], params: Sequence[dict[str, torch.Tensor]],
               device: torch.device) -> torch.Tensor:
    """The matrices [N, out, in] that `params` (as `encode` wrote them, one format and shape)
    hold, fp32 on `device` (quantized ones decoded exactly), decoded at once."""
    lin = linears[0]
    if not lin.quantized:
        return torch.stack([p["weight"] for p in params]).to(device, torch.float32)
    batch = {p: torch.stack([m[p] for m in params]).to(device) for p in lin.codec.params}
    return lin.codec.decode(batch, None)


def _encode_batch(codec: type[Codec], lin: SourceLinear, w: torch.Tensor, rule: str,
                  amax: torch.Tensor | None) -> list[dict[str, torch.Tensor]]:
    encoded = codec.encode(w, lin.spec(w.shape[-1], rule), amax=amax)
    return [encoded.module(i) for i in range(w.shape[0])]


def _as_stored(ckpt: Checkpoint, lin: SourceLinear, params: dict[str, torch.Tensor]
               ) -> dict[str, torch.Tensor]:
    """`params` with the source's dtypes and shapes (a scalar scale stays a scalar), and the
    source's own bytes for every parameter the encoder does not write."""
    out = {}
    for p, info in lin.params.items():
        t = params.get(p)
        if t is None:
            t = ckpt.reader_for(info).read(info)
        if t.dtype != info.torch_dtype or t.numel() != math.prod(info.shape):
            raise KconvertError(f"re-encoded {p} is {t.dtype}{list(t.shape)}, the source stores "
                                f"{info.dtype}{list(info.shape)}", tensor=info.name)
        out[p] = t.reshape(info.shape).contiguous()
    return out


def output_name(name: str, new_id: int) -> str:
    """The output name of a re-fitted expert parameter: the shared expert's unchanged (new_id
    -1), a kept routed expert's under its new id."""
    tn = parse_name(name)
    return name if tn.role is Role.SHARED_EXPERT else tn.with_expert(new_id).name
