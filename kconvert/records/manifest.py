"""The audit manifest `DST/kconvert-manifest.json`: written last, its presence means complete.

The pydantic models below ARE the schema; `manifests/manifest.schema.json` is generated from
them (`python -m kconvert.records.manifest > manifests/manifest.schema.json`) and a test keeps the
two in step. Hashes are xxh3-128 of a tensor's raw bytes: fast enough to hash 600 GB at disk speed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic_core import core_schema

from kconvert.plugins.methods import METHODS

__all__ = ["MANIFEST", "CastEntry", "Manifest", "MatrixEntry", "read_manifest",
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


def matrix_entry(record: dict | BaseModel) -> BaseModel:
    """A method's record of one matrix as the per-matrix model its declaration names
    (kconvert.plugins.registry.Declaration.matrix_record): the first registered one that takes
    it whole (they forbid unknown keys)."""
    if isinstance(record, BaseModel):
        record = record.model_dump()
    problems = []
    for model in dict.fromkeys(d.matrix_record for d in METHODS if d.matrix_record):
        try:
            return model.model_validate(record)
        except ValueError as exc:
            problems.append(f"{model.__name__}: {exc}")
    raise ValueError("no method's per-matrix record: " + "; ".join(problems))


class MatrixEntry:
    """A per-matrix record in the manifest: validated by the methods' declared models (those
    registered when it is read), written as that model's JSON; its schema is any of them."""

    @classmethod
    def __get_pydantic_core_schema__(cls, _source: object, _handler: GetCoreSchemaHandler
                                     ) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(
            matrix_entry, serialization=core_schema.plain_serializer_function_ser_schema(
                lambda entry: entry.model_dump(mode="json")))

    @classmethod
    def __get_pydantic_json_schema__(cls, _schema: core_schema.CoreSchema,
                                     handler: GetJsonSchemaHandler) -> dict:
        return {"anyOf": [handler(d.matrix_record.__pydantic_core_schema__)
                          for d in dict.fromkeys(METHODS) if d.matrix_record]}


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
    obs: dict[str, MatrixEntry] = Field(
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
