"""`kconvert audit`: the 4:8 (p48) pattern check, on crafted bytes against a plain-loop
reference and on a checkpoint whose manifest declares the pattern.

Tampering is done with plain file I/O (headers parsed here with struct + json, bytes patched in
place) or safetensors, never with kconvert's own readers, and expectations come from the
tampering itself (which layer/tensor/row was touched), never from a previous audit run.
"""

from __future__ import annotations

import json

import torch
import xxhash
from audit_support import assert_named, copy, locate, read_raw, write_raw

from helpers import audit_json
from kconvert.formats.p48 import check_packed as p48_check

# The fixture `outputs` (every command and recipe on the fixtures), built once for all
# the audit test modules.
pytest_plugins = ["audit_fixtures"]


# ------------------------------------------------------------------ p48


def _reference_p48(packed: torch.Tensor) -> tuple[int, int]:
    """Plain loops over chunks: (chunks with > 2 nonzero pairs, chunks with > 2 non-0x00 bytes
    but <= 2 nonzero pairs)."""
    over = negz = 0
    for row in packed.tolist():
        for c in range(0, len(row), 4):
            chunk = row[c:c + 4]
            nonzero = sum(1 for b in chunk if b & 0x77)
            stored = sum(1 for b in chunk if b)
            over += nonzero > 2
            negz += nonzero <= 2 < stored
    return over, negz


def test_p48_check_on_crafted_bytes():
    g = torch.Generator().manual_seed(0)
    rows, chunks = 6, 10
    packed = torch.zeros(rows, chunks * 4, dtype=torch.uint8)
    masks = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]  # the 6 valid pair masks
    for r in range(rows):
        for c in range(chunks):
            for p in masks[(r + c) % 6]:
                packed[r, 4 * c + p] = int(torch.randint(1, 256, (), generator=g)) | 0x01
    ok = p48_check(packed)
    assert ok.ok and ok.chunks == rows * chunks
    # A kept pair that quantized to -0 (0x08) next to one nonzero pair is still valid.
    valid = packed.clone()
    valid[0, 0:4] = torch.tensor([0x08, 0x00, 0x35, 0x00], dtype=torch.uint8)
    assert p48_check(valid).ok
    # 3 nonzero pairs in row 4, chunk 7.
    bad = packed.clone()
    bad[4, 28:32] = torch.tensor([0x12, 0x70, 0x00, 0x07], dtype=torch.uint8)
    res = p48_check(bad)
    assert (res.over_two, res.neg_zero) == (1, 0)
    assert res.first == (4, 7, [0x12, 0x70, 0x00, 0x07])
    # A pruned pair stored as -0 (0x80) beside two nonzero pairs: row 2, chunk 3.
    negz = packed.clone()
    chunk = negz[2, 12:16]
    zero_slot = int((chunk == 0).nonzero()[0])
    chunk[zero_slot] = 0x80
    res = p48_check(negz)
    assert (res.over_two, res.neg_zero) == (0, 1) and res.first[:2] == (2, 3)
    # Random bytes: counts agree with the plain-loop reference.
    noise = torch.randint(0, 256, (16, 64), generator=g, dtype=torch.uint8)
    noise[noise < 128] = 0
    res = p48_check(noise)
    assert (res.over_two, res.neg_zero) == _reference_p48(noise)
    assert res.over_two + res.neg_zero > 0


def _p48_prune_bytes(raw: bytes) -> bytes:
    """Keep the 2 pairs (bytes) of largest code magnitude in each chunk of 4, zero the rest."""
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(-1, 4)
    mag = (t & 0x7) + ((t >> 4) & 0x7)
    order = torch.argsort(mag.int() * 4 - torch.arange(4), dim=1, descending=True)
    keep = torch.zeros_like(t, dtype=torch.bool).scatter_(1, order[:, :2], True)
    return bytes(torch.where(keep, t, 0).numpy())


def test_p48_declared_in_manifest_is_checked(outputs, tmp_path):
    out = copy(outputs["int4-to-nvfp4-ct"][0], tmp_path / "o")
    man_path = out / "kconvert-manifest.json"
    man = json.loads(man_path.read_text())
    packed = [n for n in man["tensors"] if ".mlp.experts." in n and n.endswith("weight_packed")]
    for n in packed:
        data = _p48_prune_bytes(read_raw(out, n))
        write_raw(out, n, data)
        man["tensors"][n]["hash"] = xxhash.xxh3_128(data).hexdigest()
    # What the sparsify stage records (a typed SparsifyRecord: the audit reads its fields).
    man["options"]["sparsify"] = {"pattern": "p48", "method": "magnitude", "group_size": 16,
                                  "storage": "dense", "targets": ["routed_expert"]}
    man_path.write_text(json.dumps(man))
    code, rep = audit_json(out)
    assert code == 0, rep["failures"]
    assert rep["checks"]["p48"]["run"] == sum(
        man["tensors"][n]["shape"][0] * man["tensors"][n]["shape"][1] // 4 for n in packed)
    # One chunk given a third nonzero pair (the manifest hash updated so only p48 can object).
    victim = "model.layers.2.mlp.experts.11.down_proj.weight_packed"
    raw = bytearray(read_raw(out, victim))
    row_bytes = locate(out, victim)[3]["shape"][1]
    # The first chunk from row 5 on with exactly 2 nonzero pairs gets a third.
    at = next(c for c in range(5 * row_bytes, len(raw), 4)
              if sum(1 for b in raw[c:c + 4] if b & 0x77) == 2)
    row, chunk = at // row_bytes, (at % row_bytes) // 4
    slot = next(i for i in range(4) if raw[at + i] == 0)
    raw[at + slot] = 0x21
    write_raw(out, victim, bytes(raw))
    man["tensors"][victim]["hash"] = xxhash.xxh3_128(bytes(raw)).hexdigest()
    man_path.write_text(json.dumps(man))
    code, rep = audit_json(out)
    assert code == 1
    f = assert_named(rep, "p48", "pattern", layer=2, tensor=victim,
                     text=f"first: row {row}, chunk {chunk} (elements {8 * chunk}..{8 * chunk + 7})"
                          " has 3 or more nonzero pairs")
    assert len(rep["failures"]) == 1, f
