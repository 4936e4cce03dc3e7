"""The option groups of the commands that write a converted checkpoint (kconvert.cli.convert):
the run controls, and the stage options by stage kind, the plug-ins' made from their
declarations (kconvert.cli.declared)."""

from __future__ import annotations

import click

from kconvert.cli.base import FORMATS, device_option, gpu_memory_option
from kconvert.cli.declared import choice_option, setting_options
from kconvert.common import options
from kconvert.common.options import (
    BATCH_SIZE,
    BLOCK_SCALE_RULES,
    CASTS,
    SEED,
    SEQ_LEN,
    SPARSEGPT_SAMPLES,
)
from kconvert.plugins.input_scales import INPUT_SCALE_POLICIES, QUANTIZE
from kconvert.plugins.methods import METHODS
from kconvert.plugins.pruning import COMPENSATIONS, CRITERIA, PRUNE, REPAIRS

STORAGES = options.SPARSIFY_STORAGES
ACTIVATIONS = options.ACTIVATIONS
# The stage kinds that take a method, in the order the plug-ins were registered.
METHOD_KINDS = tuple(dict.fromkeys(k for d in METHODS for k in d.kinds))


# The options of the commands that write a converted checkpoint. An option's destination is
# its long name with `_` for `-`: the run controls are kconvert.driver.convert.RunControl's fields
# (plus --revision), every other option is a stage option of kconvert.stages' kinds by name
# (StageKind.settings or .input_options; a test holds the two equal).
RUN_OPTIONS = [
    click.option("--revision", default=None, help="Hub revision when SRC is a repo id."),
    click.option("--token", envvar="HF_TOKEN", default=None,
                 help="Hugging Face token for a gated or private repo [env: HF_TOKEN]."),
    click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
                 help="Hugging Face cache directory [default: huggingface_hub's]."),
    device_option(),
    gpu_memory_option(),
    click.option("--resume", is_flag=True,
                 help="Continue an interrupted run into DST (finished shards are re-hashed "
                      "and kept if unchanged)."),
    click.option("--trust-complete", is_flag=True,
                 help="With --resume: keep finished shards without re-hashing them."),
    click.option("--overwrite", is_flag=True,
                 help="Replace DST if it is a kconvert output (or empty); the old output stays "
                      "until the new one is complete when the disk has room for both."),
    click.option("--dry-run", is_flag=True,
                 help="Print what each tensor role becomes and the output size; write nothing."),
    click.option("--quiet", is_flag=True, help="No progress bar."),
    click.option("--readers", type=click.IntRange(min=1), default=4, show_default=True,
                 help="Reader threads."),
    click.option("--stream", is_flag=True,
                 help="SRC a Hub repo id: download its shards a few at a time while converting, "
                      "each deleted once converted (disk: the window, not the model; shards "
                      "already in the Hugging Face cache are read there and kept)."),
    click.option("--stream-window", type=click.IntRange(min=1), default=options.STREAM_WINDOW,
                 show_default=True,
                 help="With --stream: source shards on disk at once (the one being converted "
                      "and those downloaded ahead)."),
    click.option("--json", "as_json", is_flag=True,
                 help="Print one JSON summary on stdout (schema: manifests/"
                      "run-summary.schema.json); messages go to stderr."),
]


# The destinations of RUN_OPTIONS: kconvert.driver.convert.RunControl's fields and --revision (and
# --json, which the command line itself handles).
RUN_CONTROL_OPTIONS = ("revision", "token", "cache_dir", "device", "gpu_memory", "resume",
                       "trust_complete", "overwrite", "dry_run", "quiet", "readers", "stream",
                       "stream_window")


QUANTIZE_OPTIONS = [
    click.option("--format", type=click.Choice(FORMATS), default=None,
                 help="On-disk format: NVFP4 compressed-tensors | modelopt, MXFP4 "
                      "mxfp4-pack-quantized | quark-mxfp4 (AMD Quark) [default: "
                      "compressed-tensors; int4-to-mxfp4: quark-mxfp4]."),
    click.option("--block-scale", type=click.Choice(BLOCK_SCALE_RULES), default=None,
                 help="Block-scale rule: amax (the format's own tool's bytes) or mse "
                      "(min block error) [default: mse]; with --cast exact, the rule of "
                      "the blocks that cannot be cast exactly."),
    click.option("--cast", type=click.Choice(CASTS), default=None,
                 help="MXFP4 source -> NVFP4: exact keeps its codes and gives each block the "
                      "scale that decodes them to the source's values bit for bit wherever "
                      "FP8 holds it (ModelOpt's cast), the rest by --block-scale, counted in "
                      "the manifest [default: none; mxfp4-to-nvfp4: exact]."),
    click.option("--activations", type=click.Choice(ACTIVATIONS), default=None,
                 help="MXFP4 only: dynamic declares W4A4, activations quantized per 32 at "
                      "run time (AMD's recipe), none is weight-only [default: dynamic for "
                      "quark-mxfp4, none for mxfp4-pack-quantized]."),
    click.option("--act-stats", type=click.Path(exists=True, dir_okay=False), default=None,
                 help="Calibration statistics JSON {\"input_amax\": {module: amax}}: "
                      "listed modules become W4A4 with input scales."),
    choice_option(INPUT_SCALE_POLICIES, "input-scale", QUANTIZE,
                  "NVFP4 W4A4 routed experts' input scales (docs/input-scales.md):"),
    click.option("--targets", default=None,
                 help="Comma list of experts,shared_experts,dense_mlp,attention "
                      "[default: experts]."),
]


DEQUANT_OPTIONS = [
    click.option("--dtype", type=click.Choice(["BF16", "F32"]), default="BF16",
                 show_default=True,
                 help="F32 keeps INT4's q * scale exactly (a lossless intermediate)."),
]


def calibration_options(samples_default: int | None, samples_help: str) -> list:
    """--samples/--seq-len/--batch-size/--seed: how `--data` is read and run."""
    return [
        click.option("--samples", type=click.IntRange(min=1), default=samples_default,
                     show_default=samples_default is not None, help=samples_help),
        click.option("--seq-len", type=click.IntRange(min=1), default=SEQ_LEN,
                     show_default=True,
                     help="With --data: tokens per sequence."),
        click.option("--batch-size", type=click.IntRange(min=1), default=BATCH_SIZE,
                     show_default=True,
                     help="With --data: sequences per step."),
        click.option("--seed", default=SEED, show_default=True, help="With --data: data order."),
        click.option("--allow-short-data", is_flag=True, default=None,
                     help="With --data: run on what it holds when it cannot fill --samples "
                          "sequences of --seq-len tokens (a warning; otherwise an error)."),
    ]


def prune_options(samples_default: int | None, samples_help: str) -> list:
    return [
        click.option("--keep", type=click.IntRange(min=1), default=None,
                     help="Routed experts to keep per layer (at least num_experts_per_tok)."),
        click.option("--prune-ratio", type=click.FloatRange(0, 1, max_open=True), default=None,
                     help="Fraction of routed experts to drop, in [0, 1) (instead of --keep)."),
        click.option("--allow-uneven-ep", is_flag=True, default=None,
                     help="Keep a count that no common expert-parallel size (2, 4, 8, 16) "
                          "divides (a warning; otherwise an error: engines refuse to split "
                          "it across GPUs)."),
        choice_option(CRITERIA, "criterion", PRUNE, "How experts are ranked:",
                      default=CRITERIA.default(PRUNE[0]).name),
        click.option("--plan", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="Apply this plan file instead of computing one."),
        click.option("--stats", type=click.Path(exists=True, file_okay=False), default=None,
                     help="Calibration statistics from `kconvert calibrate`."),
        click.option("--data", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="Calibrate on this JSONL first (as `kconvert calibrate --data`)."),
        *calibration_options(samples_default, samples_help),
        click.option("--save-stats", type=click.Path(file_okay=False), default=None,
                     help="With --data: also keep the statistics here, for reuse."),
        choice_option(REPAIRS, "repair", PRUNE, "With --data: re-fit the kept experts' router "
                      "so each pruned MoE block matches the unpruned one:"),
        choice_option(COMPENSATIONS, "compensate", PRUNE, "With --data: re-fit matrices so "
                      "each pruned MoE block matches the unpruned one:"),
    ]


def _to_int(_ctx, _param, value: str | None) -> int | None:
    return None if value is None else int(value)


def method_options(lead: str, kinds: tuple[str, ...]) -> list:
    """--method of stage kinds `kinds` (its help starts with `lead`) and its methods' settings
    (kconvert.plugins.methods)."""
    return [choice_option(METHODS, "method", kinds, lead), *setting_options(METHODS, kinds)]


SPARSIFY_OPTIONS = [
    click.option("--pattern", type=click.Choice(["p48"]), default=None,
                 help="Sparsity pattern: paired-4:8 [default: p48]."),
    click.option("--group-size", type=click.Choice(["16", "32"]), default=None,
                 callback=_to_int,
                 help="Elements per FP8 block scale: 16 loads on stock vLLM, 32 is what "
                      "sparse FP4 kernels read [default: 16]."),
    click.option("--storage", type=click.Choice(STORAGES), default=None,
                 help="dense (zeros inside weight_packed) or pair-bitmask (kept bytes + "
                      "4-bit masks, ~0.65x) [default: dense]."),
]


# `quantize` and `int4-to-nvfp4`: the method and GPTQ's calibration.
QUANTIZE_METHOD_OPTIONS = [
    *method_options("How the targets' values are decided:", ("quantize",)),
    click.option("--data", type=click.Path(exists=True, dir_okay=False), default=None,
                 help="Calibration JSONL for the methods that need it (run layer by layer "
                      "beside the conversion)."),
    *calibration_options(SPARSEGPT_SAMPLES, "With --data: sequences."),
]


# The `sparsify` command's calibration: Wanda's statistics or SparseGPT's data.
SPARSIFY_CALIBRATION_OPTIONS = [
    click.option("--stats", type=click.Path(exists=True, file_okay=False), default=None,
                 help="`kconvert calibrate` output: Wanda's input column norms."),
    click.option("--data", type=click.Path(exists=True, dir_okay=False), default=None,
                 help="Calibration JSONL for SparseGPT (run layer by layer beside the "
                      "conversion)."),
    *calibration_options(SPARSEGPT_SAMPLES, "With --data: sequences."),
]
