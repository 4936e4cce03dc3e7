"""`--json` on the commands that read a checkpoint (audit, eval): a failure the command finds
itself, after click has parsed its options (a usage error it raises, an unreadable CKPT),
prints the failure object on stdout, as a conversion's failure and click's parsing errors do,
with the command's exit status; the one-line error still goes to stderr."""

from __future__ import annotations

import pytest

from conftest import BUNDLED
from helpers import cli_subprocess
from kconvert.driver.run_summary import RunSummary


@pytest.mark.parametrize("args, code, said", [
    (("audit", BUNDLED, "--revision", "main"), 2, "--revision applies only with --source"),
    (("audit", BUNDLED / "no-such-dir"), 1, "CKPT is not a directory"),
    (("eval", BUNDLED), 2, "Missing argument 'CANDIDATES...'"),
    (("eval", BUNDLED, BUNDLED, "--data", BUNDLED / "config.json", "--new-tokens", "4"), 2,
     "--new-tokens applies only with --generate"),
], ids=["audit-usage", "audit-bad-ckpt", "eval-usage", "eval-generate-only"])
def test_a_failure_inside_the_command_prints_the_failure_object(args, code, said):
    done = cli_subprocess(*args, "--json")
    assert done.returncode == code, done.stderr
    failure = RunSummary.model_validate_json(done.stdout)
    assert not failure.ok and failure.exit_code == code and failure.command == args[0]
    assert said in failure.error
    assert said in done.stderr and "Traceback" not in done.stderr
