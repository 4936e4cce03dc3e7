"""The audit's parts: the manifest's options read as a typed RunRecord (and a manifest whose
options are not one reported, not half-read), the streaming pass's byte window and NaN/Inf
test, and decode comparisons that give the same numbers in row blocks and in batches as
module by module, whole."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from helpers import audit_json
from kconvert.audit import decode
from kconvert.audit.context import open_side
from kconvert.audit.decode import Bound, DecodeJob, compare
from kconvert.checks.findings import Checks
from kconvert.formats import DenseCodec, Fp8BlockCodec
from kconvert.formats.linear import ModuleWork
from kconvert.io.checkpoint import open_checkpoint
from kconvert.io.finite import BLOCK, find_nonfinite
from kconvert.io.readahead import read_ahead
from kconvert.io.shards import TensorInfo
from kconvert.model.names import parse_name

MANIFEST = "kconvert-manifest.json"


def test_options_are_read_as_a_run_record(converted, tmp_path):
    """The stages' records are read from their fields; options that are no RunRecord (an
    older kconvert's or another tool's) are reported as such and nothing is searched out of
    them (the old audit found `keep` and `pattern` keys anywhere in the options)."""
    _, out = converted("k2-int4-kimi")
    out = Path(shutil.copytree(out, tmp_path / "o"))
    path = out / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["options"] = {"command": "int4-to-nvfp4", "keep": 3, "pattern": "p48"}
    path.write_text(json.dumps(manifest))
    code, rep = audit_json(out)
    assert code == 0, rep["failures"]
    warned = [w for w in rep["warnings"] if (w["group"], w["check"]) == ("manifest", "options")]
    assert len(warned) == 1 and "not a kconvert RunRecord" in warned[0]["message"]
    assert "recipe: Field required" in warned[0]["message"]
    assert rep["checks"]["p48"]["run"] == 0
    # A RunRecord's prune record: its kept count and plan hash are checked against the data.
    manifest["options"] = {"recipe": "reap", "prune": {"kept_per_layer": 3, "layers": 2,
                                                       "plan": "0" * 64}}
    path.write_text(json.dumps(manifest))
    code, rep = audit_json(out)
    assert code == 1
    found = {(f["check"], f["message"].split(" but ")[0]) for f in rep["failures"]}
    assert found == {("keep", "manifest records keep=3"),
                     ("plan", f"the manifest records plan sha256 {'0' * 16}...")}, found


def _expert_jobs(converted, n: int) -> list[DecodeJob]:
    src, out = converted("k2-int4-kimi")
    a = open_side(open_checkpoint(str(src)), Checks(), "source")
    b = open_side(open_checkpoint(str(out)), Checks(), "structure")
    jobs = []
    for e in range(n):
        name = f"model.layers.1.mlp.experts.{e}.down_proj"
        m, s = b.modules[name], a.modules[name]
        jobs.append(DecodeJob(m, s, {p: b.read(i) for p, i in m.params.items()},
                              {p: a.read(i) for p, i in s.params.items()},
                              Bound(False, 0.05, "test")))
    a.close()
    b.close()
    return jobs


def test_batched_decode_comparison_equals_one_module_at_a_time(converted):
    """An accelerator compares same-shaped modules as one batch: each module's numbers are
    the ones a comparison of that module alone gives."""
    jobs = _expert_jobs(converted, 5)
    assert len({j.key for j in jobs}) == 1
    batched = compare(jobs, torch.device("cpu"))
    alone = [compare([j], torch.device("cpu"))[0] for j in jobs]
    for got, want in zip(batched, alone, strict=True):
        assert got.rel_mse == pytest.approx(want.rel_mse, rel=1e-12)
        assert (got.max_abs, got.bad_elems) == (want.max_abs, want.bad_elems)
    assert 1e-4 < max(c.rel_mse for c in alone) < 0.05
    assert len({c.rel_mse for c in alone}) == len(alone)  # five different modules


def _info(name: str, t: torch.Tensor) -> TensorInfo:
    dtype = {torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32", torch.bfloat16: "BF16"}
    return TensorInfo(name, Path("x.safetensors"), dtype[t.dtype], tuple(t.shape), 0,
                      t.numel() * t.element_size())


@pytest.mark.parametrize("rows", [384, 300])
def test_row_blocks_fall_on_the_fp8_scale_blocks(monkeypatch, rows):
    """An FP8-block module decoded 128 rows at a time (its scale rows cut with the weight's,
    as its format's parameter rules say, a partial last block included) gives the numbers of
    one decode of the whole module."""
    g = torch.Generator().manual_seed(0)
    cols = 256
    weight = (torch.randn(rows, cols, generator=g) * 100).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-rows // 128), -(-cols // 128), generator=g) + 0.5
    # The BF16 side: the exact decode, with the last rows off by a little.
    exact = Fp8BlockCodec.decode({"weight": weight[None], "weight_scale_inv": scale[None]},
                                 (rows, cols))[0]
    dense = exact.clone()
    dense[rows - 20:] *= 1.01
    dense = dense.bfloat16()
    base = "model.layers.1.self_attn.o_proj"
    fp8 = {"weight": weight, "weight_scale_inv": scale}
    src = ModuleWork(base, parse_name(f"{base}.weight"), Fp8BlockCodec,
                     {p: _info(f"{base}.{p}", t) for p, t in fp8.items()}, (rows, cols))
    out = ModuleWork(base, parse_name(f"{base}.weight"), DenseCodec,
                     {"weight": _info(f"{base}.weight", dense)}, (rows, cols))
    job = DecodeJob(out, src, {"weight": dense}, fp8, Bound(True, decode.DENSE_REL_TOL, "test"))
    whole = compare([job], torch.device("cpu"))[0]
    monkeypatch.setitem(decode.BLOCK_ELEMS, "cpu", 128 * cols)
    blocks = compare([job], torch.device("cpu"))[0]
    assert blocks.rel_mse == pytest.approx(whole.rel_mse, rel=1e-12)
    assert (blocks.max_abs, blocks.bad_elems) == (whole.max_abs, whole.bad_elems)
    assert whole.bad_elems == int(((dense.float() - exact).abs()
                                   > decode.DENSE_REL_TOL * exact.abs()).sum())
    assert whole.bad_elems > 0


def test_read_ahead_counts_a_window_in_bytes():
    """The streaming pass reads ahead as many units as fit in a window of bytes beyond the
    one the consumer holds (at least one, whatever its size), in order."""
    sizes = [3, 1, 1, 1, 8, 2, 2, 5, 1, 1, 1, 1, 9, 4]
    window = 6
    consumed: list[int] = []
    submitted: list[int] = []
    pending: list[list[int]] = []  # at each submission: units read or being read, in order

    class Recording(ThreadPoolExecutor):
        def submit(self, fn, unit):
            submitted.append(unit)
            pending.append([u for u in submitted if u not in consumed])
            return super().submit(fn, unit)

    with Recording(3) as pool:
        for unit, value in read_ahead(pool, range(len(sizes)), lambda u: u * 10, window,
                                      size=lambda u: sizes[u]):
            assert value == unit * 10
            consumed.append(unit)
    assert consumed == submitted == list(range(len(sizes)))
    for units in pending:
        ahead = units[1:]  # the first is the consumer's (or, at the start, the first read)
        assert sum(sizes[u] for u in ahead) <= window or len(ahead) == 1, units
    assert max(len(units) for units in pending) >= 4  # many small units ahead at once
    assert any(units[-1] == 12 and len(units) == 2 for units in pending)  # 9 > window: alone


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32,
                                   torch.float8_e4m3fn])
def test_find_nonfinite_counts_and_locates_like_torch(dtype):
    """NaN/Inf found on the raw bits, in blocks: the count and the first index torch's own
    test gives, for values planted at and around block boundaries."""
    g = torch.Generator().manual_seed(1)
    n = 3 * BLOCK + 17
    values = (torch.randn(n, generator=g) * 4).to(dtype)
    raw = values.view(torch.uint8)
    assert find_nonfinite(raw, dtype) is None
    bad = torch.tensor([float("nan")]).to(dtype).view(torch.uint8)
    width = values.element_size()
    for at in (2 * BLOCK - 1, 2 * BLOCK, n - 1, BLOCK + 5):
        raw[at * width:(at + 1) * width] = bad
    reference = ~torch.isfinite(values.float())
    assert find_nonfinite(raw, dtype) == (int(reference.sum()), int(reference.nonzero()[0]))
    assert find_nonfinite(raw, dtype) == (4, BLOCK + 5)
    assert find_nonfinite(raw, torch.int32) is None
