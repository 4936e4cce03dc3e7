"""The commands that read a checkpoint: calibration, eval and the audit."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator

import click
from click.core import ParameterSource

from kconvert.cli.base import (
    AUDIT_CHUNK_MB,
    KconvertCommand,
    apply_options,
    device_option,
    echo_unless_quiet,
    exit_status,
    gpu_memory_option,
)
from kconvert.common.options import BATCH_SIZE, EVAL_SAMPLES, REAP_SAMPLES, SEED, SEQ_LEN
from kconvert.evaluate.loops import LoopRule

LOOP_RULE = LoopRule()  # the defaults (kconvert.evaluate.loops: why these)

# The layer-streamed forward's options, shared by calibrate and eval.
FORWARD_OPTIONS = [
    click.option("--seq-len", type=click.IntRange(min=1), default=SEQ_LEN, show_default=True,
                 help="Tokens per sequence."),
    click.option("--batch-size", type=click.IntRange(min=1), default=BATCH_SIZE,
                 show_default=True,
                 help="Sequences per forward step through a layer."),
    click.option("--seed", default=SEED, show_default=True,
                 help="Order in which data lines are used."),
    device_option(),
    gpu_memory_option(),
    click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16",
                 show_default=True, help="Compute dtype of weights and hidden states."),
    click.option("--tokenizer", default=None,
                 help="Tokenizer directory for text/messages lines [default: SRC]."),
    click.option("--allow-short-data", is_flag=True,
                 help="Run on what --data holds when it cannot fill --samples sequences of "
                      "--seq-len tokens (a warning; otherwise an error)."),
]


@contextlib.contextmanager
def json_failure(as_json: bool, command: str, src: str | None) -> Iterator[None]:
    """With --json, a failure inside the command (a usage error it finds itself among them)
    as the failure object on stdout, as KconvertCommand prints one for click's parsing
    errors; the error then goes on to KconvertCommand, which prints it and sets the exit
    status."""
    start = time.perf_counter()
    try:
        yield
    except Exception as exc:
        if as_json:
            from kconvert.driver.run_summary import RunSummary

            click.echo(RunSummary.failed(command, src or "", False, _message(exc),
                                         time.perf_counter() - start, [], 0,
                                         exit_status(exc)).model_dump_json())
        raise


def _message(exc: Exception) -> str:
    return exc.format_message() if isinstance(exc, click.ClickException) else str(exc)


@click.command("calibrate", cls=KconvertCommand)
@click.argument("src")
@click.option("--data", required=True, type=click.Path(exists=True, dir_okay=False),
              help="JSONL calibration data: one {\"input_ids\"|\"text\"|\"messages\": ...} a line.")
@click.option("-o", "--output", "out", required=True, type=click.Path(file_okay=False),
              help="Directory for stats.safetensors, stats.json and act_stats.json.")
@click.option("--samples", type=click.IntRange(min=1), default=REAP_SAMPLES, show_default=True,
              help="Sequences to calibrate on.")
@apply_options(FORWARD_OPTIONS)
@click.option("--revision", default=None, help="Hub revision when SRC is a repo id.")
@click.option("--overwrite", is_flag=True, help="Replace statistics already in the directory.")
@click.option("--quiet", is_flag=True, help="No per-layer progress.")
def calibrate_cmd(src, data, out, samples, seq_len, batch_size, seed, device, gpu_memory, dtype,
                  tokenizer, allow_short_data, revision, overwrite, quiet):
    """Layer-streamed calibration of SRC: REAP saliency, expert counts, activation stats."""
    # kconvert.api's calibrate, without importing the rest of the API (audit, convert, sizing)
    from kconvert.calibrate import calibrate_to as calibrate

    calibrate(src, data, out, samples=samples, seq_len=seq_len, batch_size=batch_size,
              seed=seed, device=device, gpu_memory=gpu_memory, dtype=dtype, tokenizer=tokenizer,
              revision=revision, overwrite=overwrite, progress=echo_unless_quiet(quiet),
              allow_short_data=allow_short_data, warn=lambda m: click.echo(m, err=True))


# The degeneration probe's loop rule, shared by --generate and --generations.
LOOP_OPTIONS = [
    click.option("--loop-max-period", type=click.IntRange(min=1), default=LOOP_RULE.max_period,
                 show_default=True, help="Longest cycle, in tokens, words or characters, that "
                                         "counts as a loop."),
    click.option("--loop-min-copies", type=click.IntRange(min=2), default=LOOP_RULE.min_copies,
                 show_default=True,
                 help="Copies of the cycle a looping tail holds at least."),
    click.option("--loop-min-cover", type=click.IntRange(min=1), default=LOOP_RULE.min_cover,
                 show_default=True,
                 help="Elements a looping tail covers at least."),
]

# --generate's settings: given without it, a usage error.
GENERATE_ONLY = ("new_tokens", "prompt_tokens", "temperature", "sample_seed",
                 "generate_batch_size")


@click.command("eval", cls=KconvertCommand)
@click.argument("src", required=False)
@click.argument("candidates", nargs=-1)
@click.option("--data", default=None, type=click.Path(exists=True, dir_okay=False),
              help="JSONL token data: one {\"input_ids\"|\"text\"|\"messages\": ...} a line "
                   "(use held-out text, not the calibration set).")
@click.option("-o", "--output", "out", default=None, type=click.Path(file_okay=False),
              help="Directory for eval.json and eval.png [default: print the table only].")
@click.option("--samples", type=click.IntRange(min=1), default=EVAL_SAMPLES, show_default=True,
              help="Sequences to evaluate on.")
@apply_options(FORWARD_OPTIONS)
@click.option("--generate", type=click.IntRange(min=1), default=None, metavar="N",
              help="Degeneration probe: continue N held-out prompts of --data with SRC and "
                   "the one CANDIDATE (docs/eval-generation.md).")
@click.option("--new-tokens", type=click.IntRange(min=1), default=192, show_default=True,
              help="Tokens each continuation may run to (--generate).")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="Tokens of each prompt (--generate).")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="0: greedy; above 0: tokens drawn at this temperature (--generate).")
@click.option("--sample-seed", type=int, default=0, show_default=True,
              help="Seed of the draws when --temperature is above 0 (--generate).")
@click.option("--generate-batch-size", type=click.IntRange(min=1), default=16,
              show_default=True, help="Prompts continued together (--generate).")
@click.option("--generations", nargs=2, default=None, metavar="SRC.jsonl CAND.jsonl",
              type=click.Path(exists=True, dir_okay=False),
              help="Compare two files of continuations any engine wrote ({\"prompt\", "
                   "\"completion\"} a line) instead of running checkpoints.")
@apply_options(LOOP_OPTIONS)
@click.option("--overwrite", is_flag=True, help="Replace an eval report already in -o DIR.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the report as JSON (the table and messages go to stderr).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.pass_context
def eval_cmd(ctx, src, candidates, data, out, samples, seq_len, batch_size, seed, device,
             gpu_memory, dtype, tokenizer, allow_short_data, generate, new_tokens,
             prompt_tokens, temperature, sample_seed, generate_batch_size, generations,
             loop_max_period, loop_min_copies, loop_min_cover, overwrite, as_json, quiet):
    """Compare each CANDIDATE with SRC on the same tokens, layer by layer.

    Per decoder layer: accumulated and local relative error of the hidden states; at the end:
    KL(SRC || CANDIDATE) (on every position and the source's 10% highest-entropy ones),
    top-1/top-5 agreement and both models' NLL and perplexity. --generate N adds the
    degeneration probe (loop rates and their z test); --generations compares two engines'
    texts without checkpoints.
    """
    with json_failure(as_json, "eval", src):
        from kconvert.calibrate.startup import phase

        rule = LoopRule(loop_max_period, loop_min_copies, loop_min_cover)
        echo = (lambda m: click.echo(m, err=True)) if as_json else click.echo
        if generations is not None:
            if src is not None or data is not None or out is not None or generate is not None:
                raise click.UsageError("--generations compares two files of texts: give no SRC, "
                                       "CANDIDATE, --data, -o or --generate with it")
            from kconvert.evaluate.generation import render
            from kconvert.evaluate.probe import compare_files

            report = compare_files(*generations, tokenizer, rule)
            if as_json:
                click.echo(json.dumps({"generation": report.model_dump(mode="json")}, indent=1))
            else:
                click.echo(render(report))
            return
        if src is None or not candidates:
            raise click.UsageError("Missing argument 'CANDIDATES...': eval compares SRC with at "
                                   "least one candidate (or two files, --generations)")
        if data is None:
            raise click.UsageError("Missing option '--data'")
        given = [n for n in GENERATE_ONLY
                 if ctx.get_parameter_source(n) is ParameterSource.COMMANDLINE]
        if generate is None and given:
            raise click.UsageError(f"--{given[0].replace('_', '-')} applies only with --generate")
        if generate is not None and len(candidates) != 1:
            raise click.UsageError("--generate compares SRC with one CANDIDATE; run one eval per "
                                   "candidate")
        # what kconvert.api's evaluate_candidates runs, without importing the rest of the API
        with phase("imports"):
            from kconvert.evaluate.decode import Sampling
            from kconvert.evaluate.probe import Probe
            from kconvert.evaluate.run import run_eval

        probe = None if generate is None else Probe(
            generate, Sampling(new_tokens, temperature, sample_seed), prompt_tokens,
            generate_batch_size, rule)
        report = run_eval(src, list(candidates), data, out, samples, seq_len, batch_size, seed,
                          device, dtype, tokenizer, quiet, echo=echo, gpu_memory=gpu_memory,
                          allow_short_data=allow_short_data, probe=probe, overwrite=overwrite)
        if as_json:
            click.echo(report.model_dump_json(indent=1))


@click.command("audit", cls=KconvertCommand)
@click.argument("ckpt", type=click.Path(file_okay=False))
@click.option("--source", default=None,
              help="The checkpoint CKPT was made from (directory or Hub repo id): compare "
                   "router rows, experts, tensors and files against it.")
@click.option("--plan", "plan_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Pruning plan JSON (manifests/plan.schema.json); default: the manifest's, "
                   "else inferred from router rows.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@device_option("Where decodes are compared: auto | cpu | cuda | cuda:N")
@gpu_memory_option()
@click.option("--revision", default=None, help="Hub revision when --source is a repo id.")
@click.option("--max-rel-mse", type=float, default=None,
              help="Bound on a re-encoded module's relative MSE against the source decode "
                   "[default: the manifest's per-layer maximum, else 0.05].")
@click.option("--chunk-mb", type=click.IntRange(1, 1024), default=AUDIT_CHUNK_MB,
              show_default=True, help="Bytes read per piece of a large tensor; pieces in "
                                      "flight hold about 8x this.")
@click.option("--serve", "serve", is_flag=False, flag_value="auto", default=None,
              metavar="ENGINE[,ENGINE]", callback=lambda _c, _p, v: _serve_engines(v),
              help="Also check what each serving engine's loader depends on (vllm, sglang, "
                   "trtllm, transformers; no value or auto: the engines that read CKPT's "
                   "format): READY / NOT READY per engine (docs/audit.md).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def audit(ckpt, source, plan_path, as_json, device, gpu_memory, revision, max_rel_mse, chunk_mb,
          serve, quiet):
    """Check that CKPT is what its config, manifest and plan say; exit 0 only if all pass.

    Exit status: 0 every check passed (and every --serve engine is READY), 1 some check
    failed, an engine is NOT READY or the audit could not run, 2 a usage error.
    """
    with json_failure(as_json, "audit", ckpt):
        from kconvert.api import audit as run_audit

        if revision is not None and source is None:
            raise click.UsageError("--revision applies only with --source (a Hub repo id)")
        report = run_audit(ckpt, source=source, plan=plan_path, device=device, revision=revision,
                           max_rel_mse=max_rel_mse, chunk_mb=chunk_mb, progress=not quiet,
                           gpu_memory=gpu_memory, serve=serve)
        if as_json:
            click.echo(json.dumps(report.to_json(), indent=1, default=str))
        else:
            click.echo(report.render())
        sys.exit(0 if report.passed and report.serve_ready else 1)


def _serve_engines(value: str | None) -> str | None:
    """--serve's value, refused as a usage error where it names an unknown engine."""
    from kconvert.audit.serve import parse_engines

    try:
        parse_engines(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--serve'") from None
    return value
