"""What every command shares: the one error path, --device, and the option groups.

Only click is imported at start-up, so `kconvert --help` answers at once; each command imports
what it runs (torch and compressed-tensors take seconds). Every command reports errors the same
way (`KconvertCommand`): a usage error exits 2 (click's message), bad input is one line and
exit 1, an internal error keeps its traceback, says it is a bug, and exits 3.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import re
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator

import click
from click.core import ParameterSource

from kconvert import options
from kconvert.cli.declared import choice_option, setting_options
from kconvert.errors import KconvertError, Terminated, UsageError
from kconvert.options import (
    BATCH_SIZE,
    BLOCK_SCALE_RULES,
    CASTS,
    GPU_MEMORY_HELP,
    INPUT_SCALE,
    INPUT_SCALES,
    SEED,
    SEQ_LEN,
    SPARSEGPT_SAMPLES,
    parse_size,
)
from kconvert.plugins.methods import METHODS
from kconvert.plugins.pruning import COMPENSATIONS, CRITERIA, PRUNE, REPAIRS
from kconvert.version import __version__

DEVICE_SPEC = re.compile(r"auto|cpu|cuda(:\d+)?")


AUDIT_CHUNK_MB = 8  # kconvert.audit.CHUNK, in MiB (a test keeps the two equal)


# The choice lists of the stage options (kconvert.options, which imports no torch).
STORAGES = options.SPARSIFY_STORAGES
FORMATS = options.OUTPUT_FORMATS
ACTIVATIONS = options.ACTIVATIONS
# The stage kinds that take a method, in the order the plug-ins were registered.
METHOD_KINDS = tuple(dict.fromkeys(k for d in METHODS for k in d.kinds))


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


# Exit status: 0 done (audit: every check passed); 2 a usage error (click's own: an unknown or
# missing option, options that do not go together); 1 bad input, an I/O failure or a failed
# audit check; 3 an internal error (a bug in kconvert); 130 Ctrl-C, 143 SIGTERM.
EXIT_BAD_INPUT = 1
EXIT_BUG = 3
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT (128 + 2)
EXIT_TERMINATED = 143  # SIGTERM (128 + 15)

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


def _is_cuda_oom(exc: BaseException) -> bool:
    """torch.OutOfMemoryError, known without importing torch (a command that never imported it
    cannot have raised it)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(exc, torch.OutOfMemoryError)


def _cuda_oom_message(exc: BaseException, ctx: click.Context) -> str:
    from kconvert.gpu_budget import oom_message

    lower = " ".join(f"--{p.replace('_', '-')}" for p in ("batch_size", "samples")
                     if p in ctx.params)
    return oom_message(str(exc), ctx.info_name or "the command", None, lower)


def _log_verbosely(_ctx, _param, verbose: int) -> int:
    """-v: the steps of a run (`kconvert` loggers at INFO) on stderr; -vv: DEBUG too.
    Without it the `kconvert` loggers stay silent, so the default output does not change."""
    if verbose:
        logger = logging.getLogger("kconvert")
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("kconvert: %(levelname)s: %(message)s"))
        logger.handlers[:] = [handler]
        logger.setLevel(logging.INFO if verbose == 1 else logging.DEBUG)
    return verbose


class KconvertCommand(click.Command):
    """A command whose errors reach the user as one line: KconvertError, OSError and a CUDA
    out-of-memory error exit 1 without a traceback (a UsageError: click's usage message,
    exit 2); anything else is a bug, reported as one, exit 3. Every command takes
    -v/--verbose (logging)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.params.append(click.Option(
            ["-v", "--verbose"], count=True, expose_value=False, is_eager=True,
            callback=_log_verbosely,
            help="Log the steps of the run to stderr (-vv: details too)."))

    def invoke(self, ctx: click.Context):
        with _sigterm_interrupts():
            return self._invoke(ctx)

    def _invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except UsageError as exc:
            raise click.UsageError(str(exc), ctx) from exc
        except KconvertError as exc:
            click.echo(f"kconvert: error: {exc}", err=True)
            ctx.exit(EXIT_BAD_INPUT)
        except OSError as exc:
            if exc.errno == errno.EPIPE:  # output piped into `head`: click ends quietly
                raise
            click.echo(f"kconvert: error: {_os_error_message(exc, ctx)}", err=True)
            ctx.exit(EXIT_BAD_INPUT)
        except Exception as exc:
            if _is_cuda_oom(exc):  # outside a planned step: still the user's to lower
                click.echo(f"kconvert: error: {_cuda_oom_message(exc, ctx)}", err=True)
                ctx.exit(EXIT_BAD_INPUT)
            traceback.print_exc()
            click.echo(BUG_REPORT.format(version=__version__), err=True)
            ctx.exit(EXIT_BUG)
        except KeyboardInterrupt as exc:
            hint = ("; nothing unfinished was marked complete: the same command with --resume "
                    "keeps every finished shard") if "resume" in ctx.params else ""
            terminated = isinstance(exc, Terminated)
            click.echo(f"\nkconvert: {'terminated (SIGTERM)' if terminated else 'interrupted'}"
                       f"{hint}", err=True)
            ctx.exit(EXIT_TERMINATED if terminated else EXIT_INTERRUPTED)


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """While a command runs in the main thread, SIGTERM raises Terminated there, as Ctrl-C
    raises KeyboardInterrupt: clean-up runs (a spill removed, the lock released) and the
    command says how to continue. A second SIGTERM ends the process at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(_signum, _frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Terminated

    before = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


class KconvertGroup(click.Group):
    command_class = KconvertCommand


def _device_spec(_ctx, _param, value: str) -> str:
    if not DEVICE_SPEC.fullmatch(value):
        raise click.BadParameter(f"{value!r} is not auto, cpu, cuda or cuda:N")
    return value


def device_option(help_text: str = "auto | cpu | cuda | cuda:N"):
    return click.option("--device", default="auto", show_default=True, callback=_device_spec,
                        help=help_text)


def _gpu_memory(_ctx, _param, value: str | None) -> int | None:
    """--gpu-memory SIZE in bytes: past the command line it is bytes (kconvert.gpu_budget)."""
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


def gpu_memory_option(help_text: str = GPU_MEMORY_HELP):
    """--gpu-memory SIZE: every command that may run on a GPU takes it."""
    return click.option("--gpu-memory", default=None, metavar="SIZE", callback=_gpu_memory,
                        help=help_text)


def apply_options(options: list) -> Callable:
    def decorate(f):
        for option in reversed(options):
            f = option(f)
        return f

    return decorate


# The options of the commands that write a converted checkpoint. An option's destination is
# its long name with `_` for `-`: the run controls are kconvert.convert.RunControl's fields
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


# The destinations of RUN_OPTIONS: kconvert.convert.RunControl's fields and --revision (and
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
    click.option("--input-scale", type=click.Choice(INPUT_SCALES), default=None,
                 help="NVFP4 W4A4 routed experts' input scales: expert (each its own "
                      "calibrated amax), layer-max (the layer's largest, gate/up and down "
                      "apart: what FlashInfer backends run, ModelOpt 0.45's export), one "
                      "(1.0 without --act-stats: Kimi-K3 NVFP4, FlashInfer's unified MoE API) "
                      f"[default: {INPUT_SCALE}]."),
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


def given_options(ctx: click.Context) -> list[str]:
    """The options set on the command line (or from the environment), by destination name."""
    given = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    return [p.name for p in ctx.command.params
            if isinstance(p, click.Option) and ctx.get_parameter_source(p.name) in given]


def echo_unless_quiet(quiet: bool) -> Callable[[str], None]:
    return (lambda _message: None) if quiet else click.echo
