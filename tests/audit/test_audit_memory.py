"""`kconvert audit`: memory stays bounded on a checkpoint with large shards."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
import xxhash
from audit_support import INDEX, copy, rewrite_shard

from helpers import st_header

# ------------------------------------------------------------------ 4. memory


PROBE = ("import resource, subprocess, sys; "
         "rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode; "
         "print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def _peak_rss_mb(cmd: list[str]) -> tuple[int, float]:
    """Peak RSS of `cmd`, measured in a probe process that runs nothing else."""
    res = subprocess.run([sys.executable, "-c", PROBE, *cmd], capture_output=True, text=True,
                         check=True)
    rc, kib = res.stdout.split()
    return int(rc), int(kib) / 1024


def test_memory_stays_bounded_with_large_shards(fixture_dir, tmp_path):
    """A 384 MB shard (embed_tokens and lm_head of 192 MB each): audit with default settings,
    hashing every tensor against a manifest and comparing every byte with a source, stays
    within 128 MB above an import-only process, a third of that one shard (measured: ~80 MB)."""
    from kconvert.records.manifest import FileEntry, Manifest, SourceEntry, TensorEntry

    bound_mb, vocab = 128, 3 << 18
    ckpt = copy(fixture_dir("bf16"), tmp_path / "big")
    config = json.loads((ckpt / "config.json").read_text())
    config["vocab_size"] = vocab
    (ckpt / "config.json").write_text(json.dumps(config))
    hidden = config["hidden_size"]
    shard = json.loads((ckpt / INDEX).read_text())["weight_map"]["lm_head.weight"]
    # Random 8 MB blocks tiled (what the values are does not matter here, only their size).
    g = torch.Generator().manual_seed(0)
    block = torch.randn(1 << 22, generator=g).bfloat16()
    tiles = vocab * hidden // block.numel()
    rewrite_shard(ckpt, shard, lambda t: {
        **t, "model.embed_tokens.weight": block.repeat(tiles).reshape(vocab, hidden),
        "lm_head.weight": (block * 0.1).repeat(tiles).reshape(vocab, hidden)})
    sizes = {p.name: p.stat().st_size for p in ckpt.glob("*.safetensors")}
    assert max(sizes.values()) > 3 * bound_mb * 2**20, sizes
    # A manifest computed here: xxh3 of raw bytes read straight from the files.
    tensors, files = {}, {}
    for name_ in sorted(sizes):
        header, base = st_header(ckpt / name_)
        header.pop("__metadata__", None)
        files[name_] = FileEntry(bytes=sizes[name_], tensors=len(header))
        with open(ckpt / name_, "rb") as fh:
            for name, e in header.items():
                fh.seek(base + e["data_offsets"][0])
                h, left = xxhash.xxh3_128(), e["data_offsets"][1] - e["data_offsets"][0]
                while left:
                    block = fh.read(min(left, 8 << 20))
                    h.update(block)
                    left -= len(block)
                tensors[name] = TensorEntry(file=name_, dtype=e["dtype"], shape=e["shape"],
                                            hash=h.hexdigest(), stage="copy", sources=[name])
    others = {p.name: xxhash.xxh3_128(p.read_bytes()).hexdigest() for p in ckpt.iterdir()
              if p.suffix != ".safetensors" and p.name not in (INDEX, "config.json")}
    man = Manifest(tool={"name": "test"}, command="copy", options={},
                   source=SourceEntry(path=str(ckpt)), output_format="bf16", files=files,
                   non_weight_files=others, tensors=tensors, fused_sets={}, layers={},
                   summary={"tensors": len(tensors)})
    (ckpt / "kconvert-manifest.json").write_text(man.model_dump_json())

    rc, base = _peak_rss_mb([sys.executable, "-c",
                             "import kconvert.cli, kconvert.audit.auditor, tqdm, xxhash"])
    assert rc == 0
    rc, peak = _peak_rss_mb([sys.executable, "-c",
                             "import sys; from kconvert.cli import main; "
                             "main(['audit', *sys.argv[1:]])",
                             str(ckpt), "--source", str(ckpt), "--quiet", "--device", "cpu"])
    assert rc == 0, "audit of the big checkpoint did not pass"
    assert peak - base < bound_mb, f"audit peak {peak:.0f} MB vs import-only {base:.0f} MB"
