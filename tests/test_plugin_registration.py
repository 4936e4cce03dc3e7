"""A new format, quantize method, sparsify method or pruning criterion registered in this
process: its own code plus one registration, run through the commands."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import checkpoint_tensors
from kconvert.formats import Codec, Encoded
from kconvert.formats.linear import Batch, Transformed
from kconvert.methods import Method
from kconvert.plugins.registry import Declaration
from kconvert.pruning.kinds import Criterion

# A new format, quantize method, sparsify method or pruning criterion is its own code plus one
# registration: these add each in a test, touching nothing else in kconvert, and run with it.

class RowInt8Codec(Codec):
    """A format with arithmetic of its own, not an existing codec's: symmetric INT8 per output
    row, scale = row amax / 127 (fp32), codes round(w * (1 / scale)) in fp32, ties to even,
    clamped to +-127 (the arithmetic of torch's quantize_per_channel); written in a config
    family of its own."""

    name = "int8-rows"
    params = ("weight_q8", "weight_row_scale")
    description = "INT8 per row (a test's format)"
    grid = "int8"
    config_family = quant_method = "test-int8"  # its config's quant_method names it
    cli_name = "test-int8"

    @classmethod
    def param_rules(cls, shape, group_size):
        return {"weight_q8": (frozenset({"I8"}), tuple(shape)),
                "weight_row_scale": (frozenset({"F32"}), (shape[0], 1))}

    @classmethod
    def logical_shape(cls, infos, shape_value):
        return tuple(infos["weight_q8"].shape)

    @classmethod
    def specs(cls, shape, input_scale=False, group_size=None):
        return [("weight_q8", "I8", tuple(shape)), ("weight_row_scale", "F32", (shape[0], 1))]

    @classmethod
    def decode(cls, t, shape):
        return t["weight_q8"].float() * t["weight_row_scale"].float()

    @classmethod
    def encode(cls, w, spec, *, amax=None, codes=None):
        scale = w.abs().amax(-1, keepdim=True).clamp(min=1e-30) / 127
        q = torch.round(w * (1 / scale)).clamp(-127, 127).to(torch.int8)
        err = (q.float() * scale - w).square().sum((1, 2), dtype=torch.float64)
        return Encoded({"weight_q8": q, "weight_row_scale": scale}, err,
                       w.double().square().sum((1, 2)))

    @classmethod
    def write_config(cls, modules, names):
        return {"quant_method": cls.config_family, "modules": len(modules)}, {"int8.json": {}}


def test_a_new_output_format_is_its_codec_plus_registration(tmp_path):
    """RowInt8Codec, registered by one `formats.register` call, is written by `quantize
    --format test-int8` with the bytes torch's own per-channel INT8 quantizer gives, read
    back and dequantized by the same registry, audited clean against its source, and sized
    by `inspect --as int8`."""
    from kconvert import formats
    from kconvert.model import names as model_names

    # the registries (the objects every module holds) are put back as they were after the test
    saved = (list(formats.SOURCE_CODECS), dict(formats.OUTPUT_CODECS),
             set(model_names.PARAM_SUFFIXES))
    formats.register(RowInt8Codec)
    try:
        _convert_with_row_int8(tmp_path)
    finally:
        formats.SOURCE_CODECS[:] = saved[0]
        formats.OUTPUT_CODECS.clear()
        formats.OUTPUT_CODECS.update(saved[1])
        model_names.PARAM_SUFFIXES.clear()
        model_names.PARAM_SUFFIXES.update(saved[2])
    assert RowInt8Codec not in formats.SOURCE_CODECS


def _convert_with_row_int8(tmp_path: Path) -> None:
    import kconvert
    from conftest import BUNDLED

    made = kconvert.quantize(str(BUNDLED), str(tmp_path / "q8"), format="test-int8",
                             device="cpu")
    assert made.manifest.output_format == "test-int8"
    config = json.loads((tmp_path / "q8" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "test-int8"
    assert (tmp_path / "q8" / "int8.json").is_file()

    # the bytes: torch's quantize_per_channel on the source's decoded experts
    source = kconvert.dequant(str(BUNDLED), str(tmp_path / "f32"), dtype="F32", device="cpu")
    assert source.manifest is not None
    want, got = checkpoint_tensors(tmp_path / "f32"), checkpoint_tensors(tmp_path / "q8")
    experts = [n.removesuffix(".weight") for n in want if ".experts." in n]
    assert experts and all(f"{e}.weight_q8" in got for e in experts)
    for e in experts:
        w = want[f"{e}.weight"]
        scale = w.abs().amax(-1) / 127
        oracle = torch.quantize_per_channel(w, scale.double(), torch.zeros_like(scale).long(),
                                            0, torch.qint8)
        assert torch.equal(got[f"{e}.weight_q8"], oracle.int_repr()), e

    # read back, dequantized and audited through the registry
    back = kconvert.dequant(str(tmp_path / "q8"), str(tmp_path / "back"), dtype="F32",
                            device="cpu")
    assert back.summary["dequantized_modules"] == len(experts)
    decoded = checkpoint_tensors(tmp_path / "back")
    for e in experts:
        assert torch.equal(decoded[f"{e}.weight"], RowInt8Codec.decode(
            {p: got[f"{e}.{p}"] for p in RowInt8Codec.params}, None))
    report = kconvert.audit(str(tmp_path / "q8"), source=str(BUNDLED), device="cpu")
    assert report.passed, report.render()
    sized = kconvert.inspect(str(BUNDLED), as_format="int8")
    assert sized.to_json()["output"]["recipe"] == "quantize"


class Clip3Sigma(Method):
    """A quantize method of a test: each row clipped to 3 standard deviations of its weights
    before the codec's own rounding."""

    declaration = Declaration("clip3", ("quantize",), "rows clipped to 3 sigma",
                              f"{__name__}:Clip3Sigma")

    def transforms(self, m) -> bool:
        return True

    def transform_batch(self, batch):
        w = batch.weights
        bound = 3 * w.std(-1, keepdim=True)  # a row's spread, whatever its batch
        return Transformed(torch.maximum(torch.minimum(w, bound), -bound))


class SmallestPairs(Method):
    """A sparsify method of a test: in every chunk of 8 keep the 2 pairs of SMALLEST
    magnitude (the opposite of `magnitude`)."""

    declaration = Declaration("smallest", ("sparsify",), "the smallest pairs kept",
                              f"{__name__}:SmallestPairs")

    def transforms(self, m) -> bool:
        return True

    def transform_batch(self, batch):
        from kconvert.formats import p48

        w = batch.weights
        keep = p48.top2_pairs(-p48.pair_scores(w))
        return Transformed(p48.apply_pair_mask(w, keep))


@pytest.mark.parametrize("method", [Clip3Sigma, SmallestPairs])
def test_a_new_method_is_its_class_plus_registration(tmp_path, monkeypatch, method):
    """A method registered by kconvert.plugins.methods.register_method runs through its
    stage's command with `method=NAME`, is recorded in the manifest, and writes what its
    transform says: the output decodes to the codec's own encode of the method's values,
    computed here."""
    import kconvert
    from conftest import BUNDLED
    from kconvert.formats import EncodeSpec, Nvfp4Codec
    from kconvert.methods import MethodInputs
    from kconvert.plugins.methods import METHODS, register_method

    monkeypatch.setattr(METHODS, "declared", list(METHODS.declared))  # put back after
    register_method(method.declaration)
    command = kconvert.quantize if method.stage == "quantize" else kconvert.sparsify
    made = command(str(BUNDLED), str(tmp_path / "out"), method=method.name, device="cpu")
    assert made.manifest.options[method.stage]["method"] == method.name
    kconvert.dequant(str(BUNDLED), str(tmp_path / "f32"), dtype="F32", device="cpu")
    source, out = checkpoint_tensors(tmp_path / "f32"), checkpoint_tensors(tmp_path / "out")

    def set_amax(module: str) -> torch.Tensor:
        """An expert's gate and up share their largest amax (one global scale)."""
        base, proj = module.rsplit(".", 1)
        members = ([f"{base}.gate_proj", f"{base}.up_proj"] if proj != "down_proj"
                   else [module])
        return torch.stack([source[f"{m}.weight"].abs().amax() for m in members]).amax()

    checked = 0
    for name, w in source.items():
        if ".mlp.experts." not in name:
            continue
        module = name.removesuffix(".weight")
        values = method(MethodInputs(frozenset())).transform_batch(
            Batch([], w[None], Nvfp4Codec, EncodeSpec(), None)).weights
        want = Nvfp4Codec.encode(values, EncodeSpec(group_size=16),
                                 amax=set_amax(module).reshape(1))
        got = {p: out[f"{module}.{p}"][None] for p in Nvfp4Codec.params}
        assert torch.equal(Nvfp4Codec.decode(got, None),
                           Nvfp4Codec.decode(want.params, None)), module
        checked += 1
    assert checked


class Busiest(Criterion):
    """A criterion of a test: the experts routed the most tokens."""

    declaration = Declaration("busiest", ("prune",), "the most routed tokens",
                              f"{__name__}:Busiest", needs="stats")
    statistic = "count"


def test_a_new_pruning_criterion_is_its_registration(tmp_path, monkeypatch):
    """A criterion registered on kconvert.plugins.pruning.CRITERIA (Busiest) is taken by
    `reap --criterion`, and keeps the experts it ranks highest."""
    import torch
    from safetensors.torch import save_file

    import kconvert
    from conftest import BUNDLED
    from kconvert.calibrate.stats import STATS_FILE
    from kconvert.io.checkpoint import open_checkpoint
    from kconvert.plugins.pruning import CRITERIA
    from kconvert.pruning.reap import moe_layers

    ckpt = open_checkpoint(str(BUNDLED))
    layers = moe_layers(ckpt)
    ckpt.close()
    gen = torch.Generator().manual_seed(0)
    stats = {}
    for layer, n in layers.items():
        stats[f"layers.{layer}.count"] = torch.randperm(n, generator=gen).double()
        stats[f"layers.{layer}.saliency"] = torch.rand(n, generator=gen, dtype=torch.float64)
        stats[f"layers.{layer}.ean_sum"] = torch.rand(n, generator=gen, dtype=torch.float64)
    (tmp_path / "stats").mkdir()
    save_file(stats, tmp_path / "stats" / STATS_FILE)

    monkeypatch.setattr(CRITERIA, "declared", list(CRITERIA.declared))  # put back after
    CRITERIA.register(Busiest.declaration)
    result = kconvert.reap(str(BUNDLED), str(tmp_path / "out"), stats=str(tmp_path / "stats"),
                           keep=6, criterion="busiest", device="cpu")
    plan = json.loads((result.output / "reap-plan.json").read_text())
    assert plan["criterion"] == "busiest"
    for layer in layers:
        busiest = stats[f"layers.{layer}.count"].argsort(descending=True)[:6]
        assert plan["layers"][str(layer)]["keep"] == sorted(busiest.tolist())
    assert result.summary["pruned_experts"] == sum(n - 6 for n in layers.values())


