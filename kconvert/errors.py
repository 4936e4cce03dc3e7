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


class UsageError(KconvertError):
    """Options that do not go together or are missing: the command line reports it as a usage
    error (exit code 2), like a misspelt option."""
