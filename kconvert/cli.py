"""The command line: a thin click layer over `convert.convert`, the recipes, calibration and the
audit.

Only click is imported at start-up, so `kconvert --help` answers at once; each command imports
what it runs (torch and compressed-tensors take seconds). Every command reports errors the same
way (`KconvertCommand`): a problem the user can fix is one line and exit 2, an internal error
keeps its traceback, says it is a bug, and exits 1.
"""

from __future__ import annotations

import errno
import json
import re
import sys
import traceback
from collections.abc import Callable

import click
from click.core import ParameterSource

from kconvert import __version__
from kconvert.errors import KconvertError

DEVICE_SPEC = re.compile(r"auto|cpu|cuda(:\d+)?")
# --samples when it is not given: REAP ranks experts on many routed tokens per expert, while
# SparseGPT's per-expert Hessians are good from a few dozen sequences and cost far more each.
REAP_SAMPLES = 1024
SPARSEGPT_SAMPLES = 128
AUDIT_CHUNK_MB = 8  # kconvert.audit.CHUNK, in MiB (a test keeps the two equal)
# Choices whose lists live in modules that import torch (tests keep these equal to them).
CRITERIA = ("ean", "frequency", "reap")  # kconvert.reap.CRITERIA
METHODS = ("magnitude", "wanda", "sparsegpt")  # kconvert.sparsify.METHODS
STORAGES = ("dense", "pair-bitmask")  # kconvert.sparsify.STORAGES
# Options that only act beside another one: given alone they would be silently dropped.
ONLY_WITH = {
    "samples": ("data",), "seq_len": ("data",), "batch_size": ("data",), "seed": ("data",),
    "save_stats": ("data",),
    "keep": ("data", "stats"), "prune_ratio": ("data", "stats"), "criterion": ("data", "stats"),
}
# What to do about an OSError that reaches the command line, by errno.
OS_ADVICE = {
    errno.ENOSPC: "free space on that file system, then run the same command again{resume}",
    errno.EDQUOT: "the disk quota is used up: free space or raise the quota, then run the same "
                  "command again{resume}",
    errno.EROFS: "the file system is read-only: choose an output directory on a writable one",
    errno.EACCES: "make it readable (an input) or writable (the output directory) for this "
                  "user, or choose another directory",
    errno.EPERM: "make it readable (an input) or writable (the output directory) for this user, "
                 "or choose another directory",
    errno.ENOENT: "check the path (was it moved or deleted while kconvert ran?)",
    errno.EMFILE: "raise the open-files limit (ulimit -n)",
    errno.ENFILE: "the system has too many open files: close some programs, then run again",
    errno.EIO: "the disk or network file system failed: check it (dmesg), then run again",
}
BUG_REPORT = ("kconvert: internal error: this is a bug in kconvert {version}, not a problem "
              "with your input. Please report it (an issue in the kconvert repository) with "
              "the command line and the traceback above.")


def _os_error_message(exc: OSError, ctx: click.Context) -> str:
    where = (exc.filename or ctx.params.get("dst") or ctx.params.get("out")
             or ctx.params.get("ckpt") or "?")
    if exc.filename2:
        where = f"{where} -> {exc.filename2}"
    name = errno.errorcode.get(exc.errno, "") if exc.errno is not None else ""
    resume = " with --resume (it keeps what was written)" if "resume" in ctx.params else ""
    advice = OS_ADVICE.get(exc.errno, "fix the cause, then run the same command again{resume}")
    return (f"{where}: {exc.strerror or exc}" + (f" [{name}]" if name else "")
            + f"; {advice.format(resume=resume)}")


class KconvertCommand(click.Command):
    """A command whose errors reach the user as one line: KconvertError and OSError exit 2
    without a traceback; anything else is a bug, reported as one, exit 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except KconvertError as exc:
            click.echo(f"kconvert: error: {exc}", err=True)
            ctx.exit(2)
        except OSError as exc:
            if exc.errno == errno.EPIPE:  # output piped into `head`: click ends quietly
                raise
            click.echo(f"kconvert: error: {_os_error_message(exc, ctx)}", err=True)
            ctx.exit(2)
        except Exception:
            traceback.print_exc()
            click.echo(BUG_REPORT.format(version=__version__), err=True)
            ctx.exit(1)


class KconvertGroup(click.Group):
    command_class = KconvertCommand


def _device_spec(_ctx, _param, value: str) -> str:
    if not DEVICE_SPEC.fullmatch(value):
        raise click.BadParameter(f"{value!r} is not auto, cpu, cuda or cuda:N")
    return value


def _device_option(help_text: str = "auto | cpu | cuda | cuda:N"):
    return click.option("--device", default="auto", show_default=True, callback=_device_spec,
                        help=help_text)


def _apply(options: list) -> Callable:
    def decorate(f):
        for option in reversed(options):
            f = option(f)
        return f

    return decorate


_run_options = _apply([
    click.option("--revision", default=None, help="Hub revision when SRC is a repo id."),
    _device_option(),
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
])

_quant_options = _apply([
    click.option("--format", "fmt", type=click.Choice(["compressed-tensors", "modelopt"]),
                 default=None, help="NVFP4 on-disk flavour [default: compressed-tensors]."),
    click.option("--block-scale", type=click.Choice(["amax", "mse"]), default=None,
                 help="FP8 block-scale rule: amax (compressed-tensors/ModelOpt bytes) or mse "
                      "(min block error) [default: mse]."),
    click.option("--act-stats", type=click.Path(exists=True, dir_okay=False), default=None,
                 help="Calibration statistics JSON {\"input_amax\": {module: amax}}: "
                      "listed modules become W4A4 with input scales."),
    click.option("--targets", default=None,
                 help="Comma list of experts,shared_experts,dense_mlp,attention "
                      "[default: experts]."),
])


def _calibration_options(samples_default: int | None, samples_help: str) -> list:
    """--samples/--seq-len/--batch-size/--seed: how `--data` is read and run."""
    return [
        click.option("--samples", type=click.IntRange(min=1), default=samples_default,
                     show_default=samples_default is not None, help=samples_help),
        click.option("--seq-len", type=click.IntRange(min=1), default=2048, show_default=True,
                     help="With --data: tokens per sequence."),
        click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True,
                     help="With --data: sequences per step."),
        click.option("--seed", default=0, show_default=True, help="With --data: data order."),
    ]


def _prune_options(samples_default: int | None, samples_help: str) -> Callable:
    return _apply([
        click.option("--keep", type=click.IntRange(min=1), default=None,
                     help="Routed experts to keep per layer (at least num_experts_per_tok)."),
        click.option("--prune-ratio", type=click.FloatRange(0, 1, max_open=True), default=None,
                     help="Fraction of routed experts to drop, in [0, 1) (instead of --keep)."),
        click.option("--criterion", type=click.Choice(CRITERIA), default="reap",
                     show_default=True, help="How experts are ranked."),
        click.option("--plan", "plan_file", type=click.Path(exists=True, dir_okay=False),
                     default=None, help="Apply this plan file instead of computing one."),
        click.option("--stats", type=click.Path(exists=True, file_okay=False), default=None,
                     help="Calibration statistics from `kconvert calibrate`."),
        click.option("--data", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="Calibrate on this JSONL first (as `kconvert calibrate --data`)."),
        *_calibration_options(samples_default, samples_help),
        click.option("--save-stats", "save_stats_dir", type=click.Path(file_okay=False),
                     default=None,
                     help="With --data: also keep the statistics here, for reuse."),
    ])


PRUNE_OPTIONS = ("keep", "prune_ratio", "criterion", "plan_file", "stats", "data", "samples",
                 "seq_len", "batch_size", "seed", "save_stats_dir")
SPARSIFY_OPTIONS = ("pattern", "method", "group_size", "storage")

_sparsify_options = _apply([
    click.option("--pattern", type=click.Choice(["p48"]), default=None,
                 help="Sparsity pattern: paired-4:8 [default: p48]."),
    click.option("--method", type=click.Choice(METHODS), default=None,
                 help="Mask selection: magnitude (data-free), wanda (--stats), sparsegpt "
                      "(--data) [default: magnitude]."),
    click.option("--group-size", type=click.Choice(["16", "32"]), default=None,
                 help="Elements per FP8 block scale: 16 loads on stock vLLM, 32 is what "
                      "sparse FP4 kernels read [default: 16]."),
    click.option("--storage", type=click.Choice(STORAGES), default=None,
                 help="dense (zeros inside weight_packed) or pair-bitmask (kept bytes + "
                      "4-bit masks, ~0.65x) [default: dense]."),
])


def _given_options(ctx: click.Context) -> list[str]:
    """Options set on the command line (or from the environment), by long name with `_`:
    the names kconvert.pipeline.STAGE_KINDS uses."""
    given = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    return [max(p.opts, key=len).lstrip("-").replace("-", "_") for p in ctx.command.params
            if isinstance(p, click.Option) and ctx.get_parameter_source(p.name) in given]


def _echo(quiet: bool) -> Callable[[str], None]:
    return (lambda _message: None) if quiet else click.echo


def _go(recipe_name: str, src: str, dst: str, overrides: dict, revision, prepare=None,
        **run) -> None:
    """Check the given options against the recipe, then convert."""
    from kconvert.convert import RunControl, convert, summary_line
    from kconvert.pipeline import check_options, load_recipe

    given = _given_options(click.get_current_context())
    recipe = load_recipe(recipe_name)
    check_options(recipe, given)
    for option, needs in ONLY_WITH.items():
        if option in given and not set(needs) & set(given):
            raise click.UsageError(f"--{option.replace('_', '-')} applies only with "
                                   + " or ".join(f"--{n}" for n in needs))
    manifest = convert(src, dst, recipe, overrides, RunControl(**run), revision=revision,
                       echo=click.echo, prepare=prepare)
    if manifest is not None and not run["quiet"]:
        click.echo(summary_line(manifest, dst))


@click.group(cls=KconvertGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__)
def main() -> None:
    """Convert and compress Kimi-K2 family MoE checkpoints shard by shard."""


@main.command("int4-to-nvfp4")
@click.argument("src")
@click.argument("dst")
@_quant_options
@_run_options
def int4_to_nvfp4(src, dst, fmt, block_scale, act_stats, targets, revision, **run):
    """INT4 pack-quantized SRC -> NVFP4 DST in one pass (dequant + quantize)."""
    _go("int4-to-nvfp4", src, dst,
        {"format": fmt, "block_scale": block_scale, "targets": targets,
         "act_stats": act_stats}, revision, **run)


@main.command()
@click.argument("src")
@click.argument("dst")
@_quant_options
@_run_options
def quantize(src, dst, fmt, block_scale, act_stats, targets, revision, **run):
    """Any SRC -> NVFP4 on the targeted modules."""
    _go("quantize", src, dst,
        {"format": fmt, "block_scale": block_scale, "targets": targets,
         "act_stats": act_stats}, revision, **run)


@main.command()
@click.argument("src")
@click.argument("dst")
@click.option("--dtype", type=click.Choice(["BF16", "F32"]), default="BF16", show_default=True,
              help="F32 keeps INT4's q * scale exactly (a lossless intermediate).")
@_run_options
def dequant(src, dst, dtype, revision, **run):
    """Quantized SRC -> BF16 (or F32) DST, quantization_config removed."""
    _go("dequant", src, dst, {"dtype": dtype}, revision, **run)


def _pruning(keep, prune_ratio, criterion, plan_file, stats, data, samples, seq_len, batch_size,
             seed, save_stats_dir, device):
    """prepare(ckpt) for convert(): the Prune stage from a plan file, statistics or data."""
    if sum(x is not None for x in (plan_file, stats, data)) > 1:
        raise click.UsageError("give only one of --plan, --stats and --data")
    if plan_file is None and stats is None and data is None:
        return None

    def prepare(ckpt):
        from kconvert.calibrate import calibrate, load_calibration_data, save_stats
        from kconvert.convert import pick_device
        from kconvert.plan import load_plan
        from kconvert.reap import (
            keep_count,
            plan_from_scores,
            prune_stage,
            scores_from_stats,
            scores_of,
        )

        if plan_file is not None:
            return {"prune": prune_stage(load_plan(plan_file), ckpt)}
        n = keep_count(ckpt, keep, prune_ratio)
        if stats is not None:
            scores = scores_from_stats(stats)
        else:
            ids = load_calibration_data(data, ckpt.root, samples or REAP_SAMPLES, seq_len, seed)
            measured = calibrate(ckpt, ids, pick_device(device), batch_size)
            if save_stats_dir:
                save_stats(measured, save_stats_dir)
            scores = scores_of(measured)
        return {"prune": prune_stage(plan_from_scores(scores, n, criterion, ckpt.identity),
                                     ckpt)}

    return prepare


@main.command()
@click.argument("src")
@click.argument("dst")
@_prune_options(REAP_SAMPLES, "With --data: sequences.")
@_run_options
def reap(src, dst, revision, **opts):
    """Prune routed experts of SRC: REAP saliency from --data or --stats, or a given --plan."""
    prune = {k: opts.pop(k) for k in PRUNE_OPTIONS}
    prepare = _pruning(**prune, device=opts["device"])
    if prepare is None:
        raise click.UsageError("give --data FILE, --stats DIR or --plan FILE")
    _go("reap", src, dst, {}, revision, prepare=prepare, **opts)


def _sparsifying(recipe_name: str, sparse: dict, stats, data, samples, seq_len, batch_size,
                 seed, device, prune_prepare=None):
    """Overrides for the sparsify stage, and prepare(ckpt) for what needs the source:
    SparseGPT's calibration pass (and a pruning plan, when the recipe prunes too)."""
    from kconvert.pipeline import load_recipe

    overrides = {k: v for k, v in sparse.items() if v is not None}
    if "group_size" in overrides:
        overrides["group_size"] = int(overrides["group_size"])
    overrides["stats"] = stats
    recipe_methods = [s.get("method", "magnitude") for s in load_recipe(recipe_name).stages
                      if s["stage"] == "sparsify"]
    method = overrides.get("method", next(iter(recipe_methods), None))
    # Without --data, the stage itself refuses sparsegpt (as it refuses wanda without --stats).
    sparsegpt_data = method == "sparsegpt" and data is not None
    if prune_prepare is None:  # else --data and --stats also serve the pruning plan
        for option, value, user in (("data", data, "sparsegpt"), ("stats", stats, "wanda")):
            if value is not None and method != user:
                raise click.UsageError(f"--{option} serves --method {user}; this run's sparsify "
                                       f"method is {method}")

    def prepare(ckpt):
        from kconvert.calibrate import load_calibration_data
        from kconvert.convert import pick_device
        from kconvert.sparsegpt import CalibrationHessians
        from kconvert.sparsify import data_record

        out = prune_prepare(ckpt) if prune_prepare is not None else {}
        if sparsegpt_data:
            n = samples or SPARSEGPT_SAMPLES
            ids = load_calibration_data(data, ckpt.root, n, seq_len, seed)
            out["hessians"] = CalibrationHessians(ckpt, ids, pick_device(device), batch_size)
            out["data_record"] = data_record(data, n, seq_len, seed)
        return out

    return overrides, prepare


@main.command()
@click.argument("src")
@click.argument("dst")
@_sparsify_options
@click.option("--stats", type=click.Path(exists=True, file_okay=False), default=None,
              help="`kconvert calibrate` output: Wanda's input column norms.")
@click.option("--data", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Calibration JSONL for SparseGPT (run layer by layer beside the conversion).")
@_apply(_calibration_options(SPARSEGPT_SAMPLES, "With --data: sequences."))
@_quant_options
@_run_options
def sparsify(src, dst, pattern, method, group_size, storage, stats, data, samples, seq_len,
             batch_size, seed, fmt, block_scale, act_stats, targets, revision, **run):
    """Paired-4:8 routed experts of SRC (BF16, INT4 or NVFP4) -> p48 NVFP4 DST, one pass."""
    sparse = {"pattern": pattern, "method": method, "group_size": group_size,
              "storage": storage}
    overrides, prepare = _sparsifying("sparsify", sparse, stats, data, samples, seq_len,
                                      batch_size, seed, run["device"])
    overrides.update({"format": fmt, "block_scale": block_scale, "targets": targets,
                      "act_stats": act_stats})
    _go("sparsify", src, dst, overrides, revision, prepare=prepare, **run)


@main.command()
@click.argument("src")
@click.argument("dst")
@_run_options
def densify(src, dst, revision, **run):
    """pair-bitmask p48 SRC -> dense NVFP4 DST (stock compressed-tensors layout), lossless."""
    _go("densify", src, dst, {}, revision, **run)


@main.command("run")
@click.argument("recipe")
@click.argument("src")
@click.argument("dst")
@_quant_options
@_prune_options(None, f"With --data: sequences [default: {REAP_SAMPLES} for a prune stage's "
                      f"REAP calibration, {SPARSEGPT_SAMPLES} for SparseGPT].")
@_sparsify_options
@_run_options
def run_recipe(recipe, src, dst, fmt, block_scale, act_stats, targets, revision, **opts):
    """Run RECIPE (a pipelines/ name or a .toml path) on SRC into DST.

    --stats and --data serve every stage that needs calibration: REAP's saliency, Wanda's
    column norms, SparseGPT's inputs. An option that no stage of RECIPE takes is an error."""
    from kconvert.pipeline import load_recipe

    prune = {k: opts.pop(k) for k in PRUNE_OPTIONS}
    sparse = {k: opts.pop(k) for k in SPARSIFY_OPTIONS}
    calib = {k: prune[k] for k in ("stats", "data", "samples", "seq_len", "batch_size", "seed")}
    kinds = set(load_recipe(recipe).kinds)
    prune_prepare = _pruning(**prune, device=opts["device"]) if "prune" in kinds else None
    if "sparsify" not in kinds:
        calib.update(stats=None, data=None)  # calibration serves the pruning plan only
    overrides, prepare = _sparsifying(recipe, sparse, **calib, device=opts["device"],
                                      prune_prepare=prune_prepare)
    overrides.update({"format": fmt, "block_scale": block_scale, "targets": targets,
                      "act_stats": act_stats})
    _go(recipe, src, dst, overrides, revision, prepare=prepare, **opts)


@main.command("calibrate")
@click.argument("src")
@click.option("--data", required=True, type=click.Path(exists=True, dir_okay=False),
              help="JSONL calibration data: one {\"input_ids\"|\"text\"|\"messages\": ...} a line.")
@click.option("-o", "--output", "out", required=True, type=click.Path(file_okay=False),
              help="Directory for stats.safetensors, stats.json and act_stats.json.")
@click.option("--samples", type=click.IntRange(min=1), default=REAP_SAMPLES, show_default=True,
              help="Sequences to calibrate on.")
@click.option("--seq-len", type=click.IntRange(min=1), default=2048, show_default=True,
              help="Tokens per sequence.")
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True,
              help="Sequences per forward step through a layer.")
@click.option("--seed", default=0, show_default=True, help="Order in which data lines are used.")
@_device_option()
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16",
              show_default=True, help="Compute dtype of weights and hidden states.")
@click.option("--tokenizer", default=None,
              help="Tokenizer directory for text/messages lines [default: SRC].")
@click.option("--revision", default=None, help="Hub revision when SRC is a repo id.")
@click.option("--overwrite", is_flag=True, help="Replace statistics already in the directory.")
@click.option("--quiet", is_flag=True, help="No per-layer progress.")
def calibrate_cmd(src, data, out, samples, seq_len, batch_size, seed, device, dtype, tokenizer,
                  revision, overwrite, quiet):
    """Layer-streamed calibration of SRC: REAP saliency, expert counts, activation stats."""
    from kconvert.calibrate import run_calibration

    run_calibration(src, data, out, samples, seq_len, batch_size, seed, device, dtype,
                    tokenizer, revision, overwrite, progress=_echo(quiet))


@main.command("audit")
@click.argument("ckpt", type=click.Path(file_okay=False))
@click.option("--source", default=None,
              help="The checkpoint CKPT was made from (directory or Hub repo id): compare "
                   "router rows, experts, tensors and files against it.")
@click.option("--plan", "plan_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Pruning plan JSON (manifests/plan.schema.json); default: the manifest's, "
                   "else inferred from router rows.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_device_option("Where decodes are compared: auto | cpu | cuda | cuda:N")
@click.option("--revision", default=None, help="Hub revision when --source is a repo id.")
@click.option("--max-rel-mse", type=float, default=None,
              help="Bound on a re-encoded module's relative MSE against the source decode "
                   "[default: the manifest's per-layer maximum, else 0.05].")
@click.option("--chunk-mb", type=click.IntRange(1, 1024), default=AUDIT_CHUNK_MB,
              show_default=True, help="Bytes read per piece of a large tensor; pieces in "
                                      "flight hold about 8x this.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def audit(ckpt, source, plan_path, as_json, device, revision, max_rel_mse, chunk_mb, quiet):
    """Check that CKPT is what its config, manifest and plan say; exit 0 only if all pass.

    Exit status: 0 every check passed, 1 some check failed, 2 the audit could not run.
    """
    from kconvert.audit import run_audit

    if revision is not None and source is None:
        raise click.UsageError("--revision applies only with --source (a Hub repo id)")
    report = run_audit(ckpt, source, plan_path, device, revision, progress=not quiet,
                       max_rel_mse=max_rel_mse, chunk=chunk_mb << 20)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=1, default=str))
    else:
        click.echo(report.render())
    sys.exit(0 if report.passed else 1)


if __name__ == "__main__":
    main()
