"""The methods' declarations (kconvert.plugins.registry): what decides a matrix's values before
its codec encodes them. Their behaviour is in kconvert.methods, one class each.

Adding a method: its class (a kconvert.methods.base.Method whose `declaration` is its
Declaration) and one `register_method` call; the command line, recipes, the Python API, the
stage records, the manifest and docs/methods.md take it from there.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kconvert.plugins.registry import Declaration, Registry

METHODS = Registry("method")


def register_method(declaration: Declaration) -> Declaration:
    """Make a method known to every stage kind it names."""
    return METHODS.register(declaration)


class DataMethodSettings(BaseModel):
    """What every data-driven method takes."""

    model_config = ConfigDict(extra="forbid")
    hessian: Literal["source", "sequential"] = Field(
        "source", description="the layer inputs: from the already-compressed model "
                              "(sequential) or the source.")


class LearnedNvfp4Settings(DataMethodSettings):
    # steps and tokens: the quality-versus-time curves on the trained tiny MoE and a full-size
    # layer's seconds per step (docs/learned.md, "Steps and tokens")
    steps: int = Field(50, ge=1, description="training steps per expert.")
    tokens: int = Field(256, ge=1, description="routed tokens per expert per step.")


class LearnedP48Settings(LearnedNvfp4Settings):
    steps: int = Field(25, ge=1, description="training steps per expert.")


class ObsRecord(BaseModel):
    """What the OBS engine's methods record in their stage's record."""

    percdamp: float | None = None
    blocksize: int | None = None
    data: dict | None = Field(None, description="the calibration data")
    hessian: str | None = Field(None, description="where a data-driven method's layer inputs "
                                                  "come from: sequential (absent: the source)")
    obs_precision: str | None = Field(
        None, description="the inverse's and the column loop's matrix products, tf32 on a GPU "
                          "(absent: fp32, a CPU)")


class GptqRecord(ObsRecord):
    gptq_targets: list[str] | None = Field(
        None, description="gptq: the targeted roles quantized by GPTQ (the others RTN)")
    gptq_precision: str | None = Field(
        None, description="gptq: obs_precision's name in GPTQ's records before SparseGPT ran "
                          "in TF32 too (read in those manifests, no longer written)")


class LearnedRecord(ObsRecord):
    steps: int | None = Field(None, description="learned: training steps per expert")
    tokens: int | None = Field(None, description="learned: routed tokens per expert per step")


class LearnedNvfp4Record(GptqRecord, LearnedRecord):
    pass


class WandaRecord(BaseModel):
    stats: str | None = Field(None, description="xxh3 of Wanda's stats.safetensors")


class ObsEntry(BaseModel):
    """GPTQ's choice for one matrix, against round to nearest."""

    model_config = ConfigDict(extra="forbid")
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

    model_config = ConfigDict(extra="forbid")
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


RTN = register_method(Declaration(
    "rtn", ("quantize",), "round to nearest: the codec's own encode (its --block-scale rule)",
    "kconvert.methods.rtn:Rtn", default=True))
GPTQ = register_method(Declaration(
    "gptq", ("quantize",), "error-compensated on --data (the OBS engine), kept per matrix "
    "where it beats rtn", "kconvert.methods.gptq:Gptq", DataMethodSettings, needs="data",
    gpu=True, record=GptqRecord, matrix_record=ObsEntry))
LEARNED_NVFP4 = register_method(Declaration(
    "learned", ("quantize",), "routed experts' values trained from gptq's on --data, kept per "
    "expert where they beat it (docs/learned.md)", "kconvert.methods.learned:LearnedNvfp4",
    LearnedNvfp4Settings, needs="data", gpu=True, record=LearnedNvfp4Record,
    matrix_record=LearnedEntry))
MAGNITUDE = register_method(Declaration(
    "magnitude", ("sparsify",), "paired-4:8 masks by weight magnitude (data-free)",
    "kconvert.methods.magnitude:Magnitude", default=True))
WANDA = register_method(Declaration(
    "wanda", ("sparsify",), "paired-4:8 masks by magnitude times input column norm (--stats)",
    "kconvert.methods.wanda:Wanda", needs="stats", record=WandaRecord))
SPARSEGPT = register_method(Declaration(
    "sparsegpt", ("sparsify",), "paired-4:8 prune and NVFP4 quantize jointly on --data (the "
    "OBS engine)", "kconvert.methods.sparsegpt:SparseGpt", DataMethodSettings, needs="data",
    gpu=True, record=ObsRecord))
LEARNED_P48 = register_method(Declaration(
    "learned", ("sparsify",), "masks and values trained per expert from sparsegpt's on --data, "
    "kept per expert where they beat it (docs/learned.md)",
    "kconvert.methods.learned:LearnedP48", LearnedP48Settings, needs="data", gpu=True,
    record=LearnedRecord, matrix_record=LearnedEntry))
