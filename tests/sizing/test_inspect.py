"""`kconvert inspect`: component bytes against the shard files, each prediction against the
bytes a real run writes, KV cache and GPU split against hand computations, and the full-size
Kimi-K2-Thinking layout from headers alone."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import kconvert
from helpers import cli_inproc, data_bytes, st_header
from kconvert.errors import KconvertError
from kconvert.testing.fixture_weights import FixtureDims
from kconvert.testing.header_only import KIMI_K2_THINKING, kimi_int4_shards, write_header_only

GIB = 1 << 30


def shard_data(root: Path) -> dict[str, int]:
    """tensor name -> bytes, from each shard's own header (8-byte length, JSON), and checks
    that the tensors fill the file's data section exactly."""
    out = {}
    for path in sorted(root.glob("*.safetensors")):
        header = st_header(path)[0]
        header.pop("__metadata__", None)
        sizes = {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()}
        assert sum(sizes.values()) == data_bytes(path), path
        out.update(sizes)
    return out


def file_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.glob("*.safetensors"))


def selected(sizes: dict[str, int], pattern: str) -> int:
    return sum(n for k, n in sizes.items() if re.search(pattern, k))


@pytest.fixture(scope="module")
def outputs(fixture_dir, tmp_path_factory):
    """Real outputs of the commands whose sizes inspect predicts, made by the CLI."""
    made = {}

    def make(key: str, variant: str, *args: str) -> Path:
        if key not in made:
            dst = tmp_path_factory.mktemp(key) / "out"
            res = cli_inproc(args[0], fixture_dir(variant), dst, *args[1:], "--device", "cpu",
                             "--quiet")
            assert res.exit_code == 0, res.output
            made[key] = dst
        return made[key]

    def plan(keep: int) -> str:
        path = tmp_path_factory.mktemp("plan") / "plan.json"
        path.write_text(json.dumps({"layers": {str(layer): {"keep": list(range(1, keep + 1))}
                                               for layer in (1, 2)}}))
        return str(path)

    return {
        "nvfp4": lambda: make("nvfp4", "k2-int4-kimi", "int4-to-nvfp4"),
        "bf16-nvfp4": lambda: make("bf16-nvfp4", "bf16", "quantize"),
        "dequant": lambda: make("dequant", "k2-int4-kimi", "dequant"),
        "pruned": lambda: make("pruned", "k2-int4-kimi", "reap", "--plan", plan(6)),
        "k25-pruned": lambda: make("k25-pruned", "k25-int4", "reap", "--plan", plan(5),
                                   "--allow-uneven-ep"),  # 5: what inspect --keep 5 predicts
        "p48": lambda: make("p48", "k2-int4-kimi", "sparsify", "--storage", "pair-bitmask"),
        "p48-dense": lambda: make("p48-dense", "bf16", "sparsify"),
    }


SOURCES = ["k2-int4-kimi", "bf16", "k25-int4", "nvfp4", "pruned", "p48"]


@pytest.mark.parametrize("source", SOURCES)
def test_components_sum_to_the_shard_files(source, fixture_dir, outputs):
    root = outputs[source]() if source in outputs else fixture_dir(source)
    sizes = shard_data(root)
    report = kconvert.inspect(str(root)).to_json()
    ckpt = report["checkpoint"]
    assert sum(ckpt["components"].values()) == ckpt["total_bytes"] == sum(sizes.values())
    assert ckpt["components"]["routed_experts"] == selected(sizes, r"\.mlp\.experts\.\d+\.")
    assert ckpt["components"]["vision_projector"] == selected(sizes,
                                                              r"^(vision_tower|mm_projector)\.")
    assert ckpt["components"]["router"] == selected(sizes, r"\.mlp\.gate\.")
    if source == "k25-int4":
        assert ckpt["components"]["vision_projector"] > 0
    # No option: the output is the checkpoint.
    assert report["output"]["total_bytes"] == ckpt["total_bytes"]
    assert report["output"]["recipe"] is None


@pytest.mark.parametrize("variant,options,output", [
    ("k2-int4-kimi", {"as_format": "nvfp4"}, "nvfp4"),
    ("bf16", {"as_format": "nvfp4"}, "bf16-nvfp4"),
    ("k2-int4-kimi", {"as_format": "bf16"}, "dequant"),
    ("k2-int4-kimi", {"keep": 6}, "pruned"),
    ("k25-int4", {"keep": 5}, "k25-pruned"),
    ("k2-int4-kimi", {"p48": "pair-bitmask"}, "p48"),
    ("bf16", {"p48": "dense"}, "p48-dense"),
])
def test_prediction_is_what_the_command_writes(variant, options, output, fixture_dir, outputs):
    dst = outputs[output]()
    sizes = shard_data(dst)
    report = kconvert.inspect(str(fixture_dir(variant)), **options).to_json()
    out = report["output"]
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    manifest = json.loads((dst / "kconvert-manifest.json").read_text())
    assert out["total_bytes"] == sum(sizes.values()) == index["metadata"]["total_size"]
    assert out["file_bytes"] == file_bytes(dst) == manifest["summary"]["bytes"]
    assert out["tensors"] == len(sizes)
    assert out["components"]["routed_experts"] == selected(sizes, r"\.mlp\.experts\.\d+\.")
    assert out["components"]["router"] == selected(sizes, r"\.mlp\.gate\.")
    assert report["per_gpu_bytes"] == out["total_bytes"]  # one GPU holds everything


def test_kv_cache_and_context_by_hand(fixture_dir):
    src = fixture_dir("k2-int4-kimi")
    cfg = json.loads((src / "config.json").read_text())
    per_layer = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]  # MLA: latent + rope key
    layers = cfg["num_hidden_layers"]
    for dtype, size in (("bf16", 2), ("fp8", 1)):
        rep = kconvert.inspect(str(src), kv_dtype=dtype, gpu_mem=0.002, mem_util=0.8).to_json()
        assert rep["kv_bytes_per_token"] == layers * per_layer * size
        usable = int(0.002 * 0.8 * GIB)
        assert rep["gpu_mem_bytes"] == usable
        assert rep["max_context_tokens"] == (usable - rep["per_gpu_bytes"]) // (
            layers * per_layer * size)
    rep = kconvert.inspect(str(src), pp=3, gpu_mem=0.002).to_json()
    assert rep["kv_bytes_per_token_per_gpu"] == per_layer * 2  # one layer per stage
    assert rep["max_context_tokens"] == min(
        (int(0.002 * 0.9 * GIB) - w) // (per_layer * 2) for w in rep["per_stage_gpu_bytes"])
    tiny = kconvert.inspect(str(src), gpu_mem=1e-5).to_json()
    assert tiny["max_context_tokens"] == 0  # the weights alone do not fit


def test_gpu_split_by_hand(fixture_dir):
    src = fixture_dir("k2-int4-kimi")
    sizes = shard_data(src)
    replicated = selected(sizes, r"(\.mlp\.gate\.|norm|q_a_proj|kv_a_proj_with_mqa)")
    routed = selected(sizes, r"\.mlp\.experts\.")
    split = sum(sizes.values()) - replicated - routed
    rep = kconvert.inspect(str(src), tp=2, ep=2).to_json()
    assert rep["parallelism"] == {"gpus": 2, "tp": 2, "ep": 2, "pp": 1}
    # 16 experts per layer: 8 whole experts on each EP rank; tensors split in halves
    assert rep["per_gpu_bytes"] == replicated + routed // 2 + split // 2
    rep = kconvert.inspect(str(src), pp=3).to_json()  # layer 0, 1, 2: one stage each
    assert sum(rep["per_stage_gpu_bytes"]) == sum(sizes.values())
    assert rep["per_stage_gpu_bytes"][0] == selected(sizes, r"(layers\.0\.|embed_tokens)")
    pruned = kconvert.inspect(str(src), keep=5, ep=2, tp=2).to_json()
    expert = selected(sizes, r"layers\.1\.mlp\.experts\.0\.")
    router_dropped = 2 * (16 - 5) * (128 * 2 + 4)  # BF16 rows of 128 + F32 bias, 2 layers
    # 5 experts over 2 EP ranks: the fuller rank holds 3 whole experts of each MoE layer
    assert pruned["per_gpu_bytes"] == replicated - router_dropped + 2 * 3 * expert + split // 2
    assert pruned["output"]["components"]["routed_experts"] == 2 * 5 * expert


def test_bad_combinations_are_usage_errors(fixture_dir):
    src = str(fixture_dir("bf16"))
    for kwargs, words in (({"p48": "dense", "as_format": "bf16"}, "--p48 writes NVFP4"),
                          ({"as_format": "int4"}, "writes no INT4"),
                          ({"targets": "experts"}, "add --as nvfp4"),
                          ({"gpus": 8, "tp": 4}, "--gpus is 8"),
                          ({"tp": 4, "ep": 3}, "must divide"),
                          ({"keep": 2}, "fewer than num_experts_per_tok")):
        with pytest.raises(KconvertError, match=re.escape(words)):
            kconvert.inspect(src, **kwargs)
    res = cli_inproc("inspect", src, "--p48", "dense", "--as", "bf16")
    assert res.exit_code != 0 and "--p48 writes NVFP4" in res.output


def test_cli_json_is_the_api_report(fixture_dir):
    src = str(fixture_dir("k25-int4"))
    args = ["--as", "nvfp4", "--gpus", "4", "--pp", "2", "--gpu-mem", "0.01", "--context", "50"]
    res = cli_inproc("inspect", src, *args, "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    api = kconvert.inspect(src, as_format="nvfp4", gpus=4, pp=2, gpu_mem=0.01, context=50)
    assert data == json.loads(json.dumps(api.to_json()))
    for key in ("total_bytes", "components"):
        assert key in data["checkpoint"]
    for key in ("kv_bytes_per_token", "per_gpu_bytes", "max_context_tokens"):
        assert isinstance(data[key], int)
    assert data["parallelism"]["tp"] == 2 and data["context"]["tokens"] == 50
    table = cli_inproc("inspect", src, *args)
    assert "routed_experts" in table.output and "longest context" in table.output


def test_header_only_layout_is_the_fixture_layout(fixture_dir):
    """The full-size generator, at the fixtures' dims, gives the fixture's exact headers."""
    src = fixture_dir("k2-int4-kimi")
    real = {}
    for path in sorted(src.glob("*.safetensors")):
        header = st_header(path)[0]
        header.pop("__metadata__", None)
        real[path.name] = {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items()}
    shards = kimi_int4_shards(FixtureDims())
    made = {f"model-{i:05d}-of-{len(shards):06d}.safetensors": {n: (d, s) for n, d, s in specs}
            for i, specs in enumerate(shards, start=1)}
    assert made == real


def test_header_only_int4_shapes_are_the_fixtures_and_plan(fixture_dir, tmp_path):
    """Its INT4 weight_shape values are written (a conversion's plan reads them): at the
    fixtures' dims, the fixture's own values, and `--dry-run` plans a conversion of it."""
    from safetensors import safe_open

    made = write_header_only(tmp_path / "headers", FixtureDims(), shape_values=True)
    src = fixture_dir("k2-int4-kimi")
    compared = 0
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(path, "pt") as real, safe_open(made / path.name, "pt") as ours:
            for name in real.keys():
                if name.endswith(".weight_shape"):
                    assert real.get_tensor(name).tolist() == ours.get_tensor(name).tolist(), name
                    compared += 1
    assert compared > 0
    res = cli_inproc("int4-to-nvfp4", made, tmp_path / "out", "--dry-run")
    assert res.exit_code == 0, res.output
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def full_size(tmp_path_factory):
    return write_header_only(tmp_path_factory.mktemp("kimi-k2-thinking-headers"))


def test_full_size_kimi_k2_thinking_from_headers(full_size):
    d = KIMI_K2_THINKING
    assert sum(p.stat().st_blocks * 512 for p in full_size.iterdir()) < 200e6  # holes
    rep = kconvert.inspect(str(full_size), as_format="nvfp4", gpus=8, gpu_mem=179).to_json()
    # By hand from docs/kimi.md's tensor table: INT4 experts (I32 codes + BF16 scale per 32 +
    # I32 weight_shape), everything else BF16, router bias F32.
    h, moe, n_moe = d.hidden, d.moe_intermediate, d.moe_layers
    expert = 3 * (h * moe // 2 + h * moe // 32 * 2 + 8)
    attention = 2 * (1536 * h + 12288 * 1536 + 576 * h + 16384 * 512 + h * 8192)
    norms = 2 * (2 * h + 1536 + 512)
    expected = {
        "routed_experts": n_moe * 384 * expert,
        "shared_experts": n_moe * 2 * 3 * moe * h,
        "dense_mlp": 2 * 3 * 18432 * h,
        "attention": 61 * attention,
        "router": n_moe * (384 * h * 2 + 384 * 4),
        "latent_projection": 0,  # Kimi-K3's
        "attn_res": 0,  # Kimi-K3's
        "embeddings_lm_head": 2 * 2 * 163840 * h,
        "vision_projector": 0,
        "other": 61 * norms + 2 * h,
    }
    assert rep["checkpoint"]["components"] == expected
    assert rep["checkpoint"]["total_bytes"] == sum(expected.values())
    assert 593e9 < rep["checkpoint"]["total_bytes"] < 595e9  # "about 594 GB"
    assert rep["checkpoint"]["tensors"] == 208_215
    assert rep["output"]["recipe"] == "int4-to-nvfp4"
    # NVFP4 expert: E2M1 codes (half a byte) + one FP8 scale per 16 + two F32 global scales
    nvfp4_expert = 3 * (h * moe // 2 + h * moe // 16) + 3 * 4
    assert rep["output"]["components"]["routed_experts"] == n_moe * 384 * nvfp4_expert
    assert rep["kv_bytes_per_token"] == 61 * (512 + 64) * 2
    usable = int(179 * 0.9 * GIB)
    assert rep["max_context_tokens"] == (usable - rep["per_gpu_bytes"]) // (61 * 576 * 2)
    assert rep["per_gpu_bytes"] == max(rep["per_stage_gpu_bytes"])
    # TP 8: MLA's q_a/kv_a projections, router and norms on every GPU, the rest in eighths
    replicated = 61 * 2 * (1536 + 576) * h + expected["router"] + expected["other"]
    assert rep["per_gpu_bytes"] == replicated + (rep["output"]["total_bytes"] - replicated) // 8
