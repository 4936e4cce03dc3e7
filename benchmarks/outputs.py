"""How two conversion outputs compare: file by file, tensor by tensor, byte by byte."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

MANIFEST = "kconvert-manifest.json"


def compare_dirs(a: Path, b: Path) -> dict:
    """Byte comparison of every file; tensor-level detail for differing .safetensors."""
    files = sorted({p.name for p in a.iterdir()} | {p.name for p in b.iterdir()})
    out: dict = {"files": len(files), "identical": 0, "different": {}}
    for f in files:
        pa, pb = a / f, b / f
        if not (pa.is_file() and pb.is_file()):
            out["different"][f] = "missing in " + (str(b) if pa.is_file() else str(a))
        elif pa.read_bytes() == pb.read_bytes():
            out["identical"] += 1
        elif f.endswith(".safetensors"):
            out["different"][f] = tensor_differences(pa, pb) or "header/metadata differs"
        elif f.endswith(".json"):
            out["different"][f] = json_diff(json.loads(pa.read_text()),
                                            json.loads(pb.read_text()))[:20]
        else:
            out["different"][f] = "bytes differ"
    return out


def tensor_differences(pa: Path, pb: Path) -> dict:
    """Per differing tensor of two shards: dtype, shape, how many bytes differ, the first five."""
    detail: dict = {}
    with safe_open(pa, "pt") as ha, safe_open(pb, "pt") as hb:
        for k in sorted(set(ha.keys()) | set(hb.keys())):
            if k not in ha.keys() or k not in hb.keys():
                detail[k] = "missing on one side"
                continue
            ta, tb = ha.get_tensor(k), hb.get_tensor(k)
            if ta.dtype != tb.dtype or ta.shape != tb.shape:
                detail[k] = f"{ta.dtype}{list(ta.shape)} vs {tb.dtype}{list(tb.shape)}"
                continue
            ua = ta.contiguous().view(-1).view(torch.uint8)
            ub = tb.contiguous().view(-1).view(torch.uint8)
            diff = (ua != ub).nonzero().flatten()
            if len(diff):
                idx = diff[:5].tolist()
                detail[k] = {"dtype": str(ta.dtype), "shape": list(ta.shape),
                             "bytes_differing": len(diff), "bytes": ua.numel(),
                             "first_byte_idx": idx,
                             "a": [hex(int(ua[i])) for i in idx],
                             "b": [hex(int(ub[i])) for i in idx]}
    return detail


def json_diff(a: object, b: object, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        d = []
        for k in sorted(set(a) | set(b)):
            d += json_diff(a.get(k), b.get(k), f"{path}.{k}")
        return d
    return [] if a == b else [f"{path}: {str(a)[:80]} != {str(b)[:80]}"]


def same_output(a: Path, b: Path) -> bool | str:
    """True when every file of the two outputs is equal, the manifests but for their
    world_size; else what differs first."""
    names_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    names_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    if names_a != names_b:
        return f"files differ: {sorted(set(map(str, names_a)) ^ set(map(str, names_b)))}"
    for rel in names_a:
        if rel.name == MANIFEST:
            ma, mb = (json.loads((d / rel).read_text()) for d in (a, b))
            for m in (ma, mb):
                m["summary"].pop("world_size", None)
            if ma != mb:
                return "manifests differ beyond world_size"
        elif (a / rel).read_bytes() != (b / rel).read_bytes():
            return f"{rel} differs"
    return True


def tensor_bytes(d: Path) -> dict[str, bytes]:
    out = {}
    for p in sorted(d.glob("*.safetensors")):
        with safe_open(str(p), framework="pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k).contiguous().view(torch.uint8).numpy().tobytes()
    return out


def share_differing(a: Path, b: Path) -> dict:
    """How many tensors differ and what share of all tensor bytes."""
    ta, tb = tensor_bytes(a), tensor_bytes(b)
    differ = [k for k in ta if ta[k] != tb.get(k)]
    nbytes = sum(len(ta[k]) for k in differ)
    diff_bytes = sum(sum(x != y for x, y in zip(ta[k], tb[k], strict=True)) for k in differ)
    return {"tensors": len(ta), "tensors_differ": len(differ),
            "bytes_differ_share": round(diff_bytes / max(sum(map(len, ta.values())), 1), 6),
            "differing_tensor_bytes": nbytes}
