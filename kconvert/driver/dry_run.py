"""What a dry run prints: the work plan as a table, by role and format, in tensors and MB."""

from __future__ import annotations

from collections.abc import Callable

from kconvert.engine.work import WorkPlan, describe
from kconvert.formats.quant_config import output_format


def print_dry_run(plan: WorkPlan, echo: Callable[[str], None]) -> None:
    """The table of the work plan `plan`, then the output format, shards and tensors."""
    rows = describe(plan)
    echo(f"{'role':<15} {'source':<26} {'output':<26} {'tensors_in':>10} {'tensors_out':>11} "
         f"{'MB_in':>10} {'MB_out':>10}")
    for role, fmt, out, n_in, n_out, b_in, b_out in rows:
        echo(f"{role:<15} {fmt:<26} {out:<26} {n_in:>10} {n_out:>11} {b_in / 1e6:>10.1f} "
             f"{b_out / 1e6:>10.1f}")
    n_in, n_out, b_in, b_out = (sum(r[i] for r in rows) for i in (3, 4, 5, 6))
    echo(f"{'total':<69} {n_in:>10} {n_out:>11} {b_in / 1e6:>10.1f} {b_out / 1e6:>10.1f}")
    echo(f"output format: {output_format(plan.modules)}; {len(plan.shard_entries)} shards, "
         f"{len(plan.outputs)} tensors")
