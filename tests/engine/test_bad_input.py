"""Bad input: every case fails with exit code 1 / KconvertError, a message naming the file (and
the tensor where one is involved), the source byte-for-byte unchanged, and no
kconvert-manifest.json / config.json in DST.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from robustness_support import assert_no_result

from conftest import BUNDLED
from helpers import (
    INDEX,
    S2,
    S3,
    cli_subprocess,
    edit_json,
    edit_tensor,
    run_inproc,
    set_at,
    snapshot,
)
from kconvert.errors import KconvertError

# Shards of the bundled tiny fixture (layer 0 dense, layers 1-2 MoE with 16 INT4 experts).


# ------------------------------------------------------------------------------- helpers


def assert_names(msg: str, *names: str) -> None:
    for name in names:
        # a whole name: "experts.5.down_proj.weight_scale" must not match "...weight_scale_2"
        assert re.search(re.escape(name) + r"(?![\w])", msg), f"{name!r} not named in: {msg}"


# ------------------------------------------------------------------------ bad input


@dataclass(frozen=True)
class Case:
    id: str
    mutate: Callable[[Path], None]
    file: str | None  # a path fragment the message must contain
    tensors: tuple[str, ...]  # tensor names the message must contain
    why: str  # regex (case-insensitive) the message must match
    cli: bool = False  # through the real CLI subprocess (else in-process convert())
    args: tuple[str, ...] = ()
    module: str | None = None  # the message must name one of this module's tensors


def _truncate(src: Path) -> None:
    p = src / S3
    os.truncate(p, p.stat().st_size - 1000)


def _garbage_header(src: Path) -> None:
    p = src / S2
    data = bytearray(p.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    data[8:8 + n] = b"{not json at all" + b"#" * (n - 16)
    p.write_bytes(bytes(data))


def _absurd_header_length(src: Path) -> None:
    p = src / S2
    data = bytearray(p.read_bytes())
    data[:8] = struct.pack("<Q", 1 << 60)
    p.write_bytes(bytes(data))


MISSING = "model.layers.1.self_attn.q_b_proj.bias"
STALE = "model.layers.2.mlp.experts.7.up_proj.weight_scale"
SHAPE_MODULE = "model.layers.1.mlp.experts.4.up_proj"
NAN_SCALE = "model.layers.2.mlp.experts.5.down_proj.weight_scale"
INF_SCALE = "model.layers.1.mlp.experts.9.gate_proj.weight_scale"
NAN_NORM = "model.layers.1.post_attention_layernorm.weight"
INF_ATTN = "model.layers.2.self_attn.kv_b_proj.weight"


def poke(shard: str, name: str, index: tuple, value: float) -> Callable[[Path], None]:
    return lambda src: edit_tensor(src / shard, name, set_at(index, value))


def _index_names_missing_tensor(src: Path) -> None:
    edit_json(src / INDEX, lambda i: i["weight_map"].update({MISSING: S2}))


def _index_names_missing_file(src: Path) -> None:
    (src / S3).unlink()


def _stale_index(src: Path) -> None:
    edit_json(src / INDEX, lambda i: i["weight_map"].pop(STALE))


def _shape_disagrees(src: Path) -> None:
    edit_tensor(src / S2, SHAPE_MODULE + ".weight_shape",
                lambda t: torch.tensor([int(t[0]), 2 * int(t[1])], dtype=t.dtype))


def _llama(src: Path) -> None:
    edit_json(src / "config.json", lambda c: c.update(model_type="llama",
                                                      architectures=["LlamaForCausalLM"]))


BAD_INPUT = [
    Case("truncated-shard", _truncate, S3, (), r"truncat|ended early|not fully covered",
         cli=True),
    Case("header-garbage-json", _garbage_header, S2, (), r"header|json"),
    Case("header-absurd-length", _absurd_header_length, S2, (), r"header"),
    Case("index-names-missing-tensor", _index_names_missing_tensor, S2, (MISSING,), r"index"),
    Case("index-names-missing-file", _index_names_missing_file, S3, (), r"not exist|missing"),
    Case("stale-index", _stale_index, S3, (STALE,), r"index"),
    # weight_shape or weight_packed: either names the module and the disagreement says which
    Case("weight-shape-disagrees", _shape_disagrees, S2, (), r"weight_shape.*disagree",
         module=SHAPE_MODULE),
    Case("nan-int4-weight-scale", poke(S3, NAN_SCALE, (3, 1), math.nan),
         S3, (NAN_SCALE,), r"nan", cli=True),
    Case("inf-int4-weight-scale", poke(S2, INF_SCALE, (0, 0), math.inf), S2, (INF_SCALE,),
         r"inf"),
    Case("nan-bf16-norm", poke(S2, NAN_NORM, (5,), math.nan), S2, (NAN_NORM,), r"nan"),
    Case("inf-bf16-attention", poke(S3, INF_ATTN, (1, 2), -math.inf), S3, (INF_ATTN,), r"inf"),
    # the same tensor, decoded and re-encoded instead of copied
    Case("inf-bf16-attention-quantized", poke(S3, INF_ATTN, (1, 2), -math.inf), S3,
         (INF_ATTN,), r"inf", args=("--targets", "experts,attention")),
    Case("unsupported-architecture", _llama, "config.json", (), r"unsupported|architecture"),
]


def _patterns(dtype: torch.dtype) -> torch.Tensor:
    """Every bit pattern of a 1- or 2-byte float; for wider ones, the special values, the
    largest finite, the smallest normal, a subnormal, and one ulp either side of each."""
    if dtype.itemsize <= 2:
        ints = {1: torch.uint8, 2: torch.int16}[dtype.itemsize]
        lo, hi = (0, 256) if dtype.itemsize == 1 else (-(1 << 15), 1 << 15)
        return torch.arange(lo, hi, dtype=torch.int32).to(ints).view(dtype)
    fi = torch.finfo(dtype)
    v = torch.tensor([0.0, -0.0, 1.0, fi.max, -fi.max, fi.tiny, fi.smallest_normal / 2**10,
                      math.inf, -math.inf, math.nan], dtype=dtype)
    return torch.cat([v, torch.nextafter(v, v.new_tensor(math.inf)),
                      torch.nextafter(v, v.new_tensor(-math.inf))])


@pytest.mark.parametrize("name", ["F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"])
def test_pass_through_nan_inf_check_equals_torch_isfinite(name):
    """Pass-through bytes are checked on their bits (numpy, in the reader threads): the verdict
    on each value is torch.isfinite's."""
    from kconvert.io.finite import check_finite
    from kconvert.io.shards import DTYPES, TensorInfo

    values = _patterns(DTYPES[name])
    info = TensorInfo("model.layers.0.w", Path("a.safetensors"), name, (1,), 0, 1)
    wide = values.float() if values.dtype.itemsize == 1 else values  # FP8: exact in fp32
    finite = torch.isfinite(wide).tolist()
    raw = values.view(torch.uint8).reshape(len(values), -1)
    verdicts = []
    for row in raw:
        try:
            check_finite(row.clone(), info)
            verdicts.append(True)
        except KconvertError as err:
            assert "a.safetensors" in str(err) and "model.layers.0.w" in str(err)
            verdicts.append(False)
    assert verdicts == finite
    assert not all(finite) and any(finite)


@pytest.mark.parametrize("case", BAD_INPUT, ids=[c.id for c in BAD_INPUT])
def test_bad_input_fails_cleanly(case: Case, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(BUNDLED, src)
    case.mutate(src)
    before = snapshot(src)
    dst = tmp_path / "out"
    if case.cli:
        proc = cli_subprocess("int4-to-nvfp4", src, dst, "--quiet", "--block-scale", "amax",
                              *case.args)
        assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
        msg = proc.stderr
        assert "kconvert: error:" in msg, msg
    else:
        targets = case.args[1] if case.args[:1] == ("--targets",) else None
        with pytest.raises(KconvertError) as err:
            run_inproc("int4-to-nvfp4", src, dst, block_scale="amax", targets=targets)
        msg = str(err.value)
    if case.file:
        assert case.file in msg, f"file {case.file!r} not named in: {msg}"
    assert_names(msg, *case.tensors)
    if case.module:
        assert re.search(re.escape(case.module) + r"\.weight_\w+", msg), msg
    assert re.search(case.why, msg, re.IGNORECASE), msg
    assert snapshot(src) == before, "the source was modified"
    assert_no_result(dst)

