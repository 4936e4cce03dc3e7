"""One exception type for everything a user can get wrong; the CLI turns it into exit code 1
(a UsageError, for options that do not go together, into click's usage error: exit 2)."""

from __future__ import annotations


class KconvertError(Exception):
    """A problem with the input, the output directory or the options, named precisely.

    `file` and `tensor` are kept separately so the message always says where the problem is,
    and tests can check that it does.
    """

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        self.file = file
        self.tensor = tensor
        where = ", ".join(
            part for part in (f"file {file}" if file else "", f"tensor {tensor}" if tensor else "")
            if part
        )
        super().__init__(f"{message} ({where})" if where else message)


class Terminated(KeyboardInterrupt):
    """SIGTERM (what `timeout`, Slurm and `docker stop` send), raised in the main thread while a
    command runs, so that the run stops as on Ctrl-C: its clean-up runs and the command line
    says how to continue."""


class UsageError(KconvertError):
    """Options that do not go together or are missing: the command line reports it as a usage
    error (exit code 2), like a misspelt option."""


def invalid_fields(exc: Exception, limit: int = 3) -> str:
    """A pydantic ValidationError as one line a user reads: each field's dotted path and what
    is wrong with it (the first `limit`), without pydantic's type tags and links."""
    errors = exc.errors() if hasattr(exc, "errors") else []
    if not errors:
        return str(exc)
    parts = []
    for e in errors[:limit]:
        msg = str(e["msg"]).removeprefix("Value error, ")
        parts.append(f"{'.'.join(map(str, e['loc']))}: {msg}" if e["loc"] else msg)
    more = len(errors) - limit
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")
