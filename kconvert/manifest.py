"""The audit manifest `DST/kconvert-manifest.json`: written last, its presence means complete.

The pydantic models below ARE the schema; `manifests/manifest.schema.json` is generated from
them (`python -m kconvert.manifest > manifests/manifest.schema.json`) and a test keeps the two
in step. Hashes are xxh3-128 of a tensor's raw bytes: fast enough to hash 600 GB at disk speed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

__all__ = ["MANIFEST", "CastEntry", "LearnedEntry", "Manifest", "ObsEntry", "read_manifest",
           "render_manifest"]

MANIFEST = "kconvert-manifest.json"
SCHEMA_ID = "kconvert-manifest/1"


class TensorEntry(BaseModel):
    file: str
    dtype: str
    shape: list[int]
    hash: str = Field(description="xxh3-128 hex digest of the tensor's raw bytes")
    stage: str = Field(description="'copy' or the stages that produced it, e.g. dequant+quantize")
    sources: list[str] = Field(description="source tensors this output tensor was made from")


class FusedSetEntry(BaseModel):
    members: list[str] = Field(description="modules that share this NVFP4 global scale")
    amax: float
    global_scale: float = Field(
        description="2688 / amax as compressed-tensors stores it (ModelOpt stores amax / 2688)")


class LayerEntry(BaseModel):
    quantized_modules: int
    rel_mse_mean: float = Field(description="mean over modules of sum((w'-w)^2) / sum(w^2)")
    rel_mse_max: float


class ObsEntry(BaseModel):
    method: str = Field(
        description="what was written: the method's result (gptq), or its baseline's (rtn) "
                    "where the method's output error was not smaller")
    gptq_error: float = Field(description="tr(dW H dW^T) of GPTQ's result, H = X^T X of the "
                                          "tokens `judged_on` names")
    rtn_error: float = Field(description="tr(dW H dW^T) of round-to-nearest on the same H")
    judged_on: Literal["held-out", "calibration"] = Field(
        default="calibration",
        description="held-out: every 8th token routed to the matrix, left out of GPTQ's fit; "
                    "calibration: all its tokens (too few to hold any out)")


class LearnedEntry(BaseModel):
    """A learned method's choice for one matrix (kconvert.methods.learned): an expert's gate,
    up and down are judged together, on its held-out routed tokens."""

    method: str = Field(description="what was written: learned, or the one-shot method's "
                                    "result where the learned one's error was not smaller")
    oneshot: str = Field(description="the method it started from and was judged against")
    learned_error: float | None = Field(description="sum over held-out routed tokens of "
                                        "g^2 |f(x) - f_source(x)|^2 of the expert as learned "
                                        "(None: too few tokens to judge, or training "
                                        "diverged)")
    oneshot_error: float | None = Field(description="the same of the one-shot result")
    steps: int
    fit_tokens: int = Field(description="the expert's routed tokens it trained on")
    held_out_tokens: int = Field(description="every 8th of its routed tokens, judged on")


class CastEntry(BaseModel):
    exact_blocks: int = Field(description="32-element MXFP4 blocks cast exactly: the source's "
                                          "codes under scales that decode them bit for bit")
    blocks: int = Field(description="all the module's 32-element blocks; the others follow "
                                    "the block-scale rule")


class SourceEntry(BaseModel):
    path: str | None = None
    repo: str | None = None
    revision: str | None = None
    commit: str | None = None
    fingerprint: str | None = Field(
        default=None, description="sha256 of the source's config.json and, per shard, its "
        "name, size, header and first and last MiB of tensor data "
        "(kconvert.io.checkpoint.Checkpoint.fingerprint): `audit --source` refuses a source "
        "whose fingerprint differs; absent where the shards were streamed")


class FileEntry(BaseModel):
    bytes: int
    tensors: int


class Manifest(BaseModel):
    schema_id: Literal["kconvert-manifest/1"] = SCHEMA_ID
    tool: dict[str, str]
    command: str
    options: dict = Field(description="what the run did: a kconvert.stages.records.RunRecord "
                                      "(the recipe, and per stage the options that decide "
                                      "the bytes)")
    source: SourceEntry
    output_format: str = Field(description="compressed-tensors | modelopt | quark | bf16 | "
                                           "source")
    files: dict[str, FileEntry]
    non_weight_files: dict[str, str] = Field(
        description="files carried over from the source: relative path -> xxh3-128 of bytes")
    generated_files: dict[str, str] = Field(
        default_factory=dict, description="files kconvert made (config.json, index, plan, ...): "
                                          "name -> xxh3-128 of bytes")
    tensors: dict[str, TensorEntry]
    fused_sets: dict[str, FusedSetEntry]
    layers: dict[str, LayerEntry]
    summary: dict[str, float | int]
    dropped: dict[str, str] = Field(default_factory=dict,
                                    description="source tensor or file -> why it is not in DST")
    obs: dict[str, ObsEntry | LearnedEntry] = Field(
        default_factory=dict, description="a method judged against a baseline: module -> "
                                          "its choice (gptq: GPTQ or RTN; learned: learned or "
                                          "the one-shot result), whichever has the smaller "
                                          "held-out output error")
    cast: dict[str, CastEntry] = Field(
        default_factory=dict, description="quantize --cast exact: module -> its MXFP4 blocks "
                                          "cast exactly, of all (docs/formats.md §7)")


def render_manifest(manifest: Manifest) -> str:
    """The manifest file's text."""
    return json.dumps(manifest.model_dump(mode="json"), indent=1, sort_keys=True)


def read_manifest(path: Path) -> Manifest:
    return Manifest.model_validate_json(path.read_text())


if __name__ == "__main__":
    print(json.dumps(Manifest.model_json_schema(), indent=2, sort_keys=True))
