"""What every command shares: the one error path, --device and --gpu-memory.

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

from kconvert.common import options
from kconvert.common.options import (
    GPU_MEMORY_HELP,
    parse_size,
)
from kconvert.errors import KconvertError, Terminated, UsageError
from kconvert.version import __version__

DEVICE_SPEC = re.compile(r"auto|cpu|cuda(:\d+)?")


AUDIT_CHUNK_MB = 8  # kconvert.audit.CHUNK, in MiB (a test keeps the two equal)


# The choice lists of the stage options (kconvert.common.options, which imports no torch).
FORMATS = options.OUTPUT_FORMATS


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
    from kconvert.gpu.budget import oom_message

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

    def make_context(self, info_name, args, parent=None, **extra) -> click.Context:
        """click's parsing, and where it finds a usage error (a bad choice, size or range, an
        unknown option) on a command given --json, that error as the failure JSON on stdout
        before click prints its usage message on stderr: every failure prints one object."""
        as_json = "--json" in args and any(p.name == "as_json" for p in self.params)
        try:
            return super().make_context(info_name, list(args), parent, **extra)
        except click.UsageError as exc:
            if as_json:
                from kconvert.driver.run_summary import RunSummary

                click.echo(RunSummary.failed(
                    info_name or self.name or "", "", False, exc.format_message(), 0.0, [], 0,
                    exit_status(exc)).model_dump_json())
            raise

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
            ctx.exit(exit_status(exc))
        except OSError as exc:
            if exc.errno == errno.EPIPE:  # output piped into `head`: click ends quietly
                raise
            click.echo(f"kconvert: error: {_os_error_message(exc, ctx)}", err=True)
            ctx.exit(exit_status(exc))
        except Exception as exc:
            if _is_cuda_oom(exc):  # outside a planned step: still the user's to lower
                click.echo(f"kconvert: error: {_cuda_oom_message(exc, ctx)}", err=True)
            else:
                traceback.print_exc()
                click.echo(BUG_REPORT.format(version=__version__), err=True)
            ctx.exit(exit_status(exc))
        except KeyboardInterrupt as exc:
            hint = ("; nothing unfinished was marked complete: the same command with --resume "
                    "keeps every finished shard") if "resume" in ctx.params else ""
            terminated = isinstance(exc, Terminated)
            click.echo(f"\nkconvert: {'terminated (SIGTERM)' if terminated else 'interrupted'}"
                       f"{hint}", err=True)
            ctx.exit(EXIT_TERMINATED if terminated else EXIT_INTERRUPTED)


def exit_status(exc: Exception) -> int:
    """The exit status a command ends with when `exc` reaches KconvertCommand (the module's
    docstring): also what a failure's --json says."""
    if isinstance(exc, UsageError):
        return click.UsageError.exit_code
    if isinstance(exc, click.ClickException):
        return exc.exit_code
    if isinstance(exc, (KconvertError, OSError)) or _is_cuda_oom(exc):
        return EXIT_BAD_INPUT
    return EXIT_BUG


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
    """--gpu-memory SIZE in bytes: past the command line it is bytes (kconvert.gpu.budget)."""
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


def given_options(ctx: click.Context) -> list[str]:
    """The options set on the command line (or from the environment), by destination name."""
    given = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    return [p.name for p in ctx.command.params
            if isinstance(p, click.Option) and ctx.get_parameter_source(p.name) in given]


def echo_unless_quiet(quiet: bool) -> Callable[[str], None]:
    return (lambda _message: None) if quiet else click.echo
