"""What `kconvert eval` opens and writes, checked before any work: the models (a candidate
that is not there is named as the candidate) and the report's directory (an earlier report is
replaced only with --overwrite, as calibrate's statistics are)."""

from __future__ import annotations

from pathlib import Path

from kconvert.errors import KconvertError
from kconvert.evaluate.probe import CANDIDATE_FILE, SOURCE_FILE
from kconvert.evaluate.report import FIGURE_FILE, REPORT_FILE
from kconvert.io.checkpoint import Checkpoint, is_repo_id, open_checkpoint

# What `eval -o DIR` writes: any of them already there is an earlier report.
WRITTEN = (REPORT_FILE, FIGURE_FILE, SOURCE_FILE, CANDIDATE_FILE)


def refuse_earlier_report(out: Path, overwrite: bool) -> None:
    """Refuse a DIR that holds an earlier report unless `overwrite`."""
    earlier = [name for name in WRITTEN if (out / name).exists()]
    if earlier and not overwrite:
        raise KconvertError("the directory already holds an eval report; pass --overwrite",
                            file=str(out / earlier[0]))


def open_model(path: str, candidate: bool) -> Checkpoint:
    """SRC or a candidate, opened."""
    if candidate and not Path(path).exists() and not is_repo_id(path):
        raise KconvertError("candidate directory does not exist", file=path)
    return open_checkpoint(path)
