"""`audit --source` compares every tensor whose format did not change with the source, byte for
byte: a tensor changed in the output whose manifest hash is made to agree (so the manifest
checks cannot object) passes the audit without `--source` and fails it with `--source`, naming
the tensor and the first element that differs. The edit and the hashes are made here with
plain file I/O and xxhash, independently of kconvert."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import xxhash

from conftest import BUNDLED
from helpers import INDEX, MANIFEST, audit_json, run_inproc


def _span(ckpt: Path, name: str) -> tuple[Path, int, int]:
    shard = ckpt / json.loads((ckpt / INDEX).read_text())["weight_map"][name]
    with open(shard, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    start, end = header[name]["data_offsets"]
    return shard, 8 + n + start, 8 + n + end


@pytest.fixture(scope="module")
def output(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("src-bytes") / "out"
    run_inproc("int4-to-nvfp4", BUNDLED, dst)
    return dst


# A BF16 attention weight and a norm weight, passed through, each changed at its last
# element: the comparison must reach a tensor's end.
@pytest.mark.parametrize("name", ["model.layers.1.self_attn.o_proj.weight",
                                  "model.layers.2.post_attention_layernorm.weight"])
def test_changed_pass_through_tensor_fails_only_with_source(output, tmp_path, name):
    out = Path(shutil.copytree(output, tmp_path / "o"))
    shard, start, end = _span(out, name)
    data = bytearray(shard.read_bytes())
    data[end - 1] ^= 0x01  # lowest mantissa bit of the last element's high byte
    shard.write_bytes(bytes(data))
    man = json.loads((out / MANIFEST).read_text())
    man["tensors"][name]["hash"] = xxhash.xxh3_128(bytes(data[start:end])).hexdigest()
    (out / MANIFEST).write_text(json.dumps(man))

    code, rep = audit_json(out)
    assert code == 0, rep["failures"]  # a manifest is not a signature: only the source knows
    code, rep = audit_json(out, "--source", BUNDLED)
    assert code == 1
    found = [f for f in rep["failures"] if f["group"] == "source" and f["check"] == "bytes"]
    assert [f["tensor"] for f in found] == [name], rep["failures"]
    assert "differs from source" in found[0]["message"]
    # and the unchanged output passes the same audit
    code, rep = audit_json(output, "--source", BUNDLED)
    assert code == 0, rep["failures"]
