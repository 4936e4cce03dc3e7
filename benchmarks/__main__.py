"""`python -m benchmarks` lists the benchmarks, one line each; `python -m benchmarks NAME
[ARGS]` runs NAME with ARGS (`python -m benchmarks NAME --help` where it takes options)."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# name -> module: speed and memory on the device machine, then quality and figures.
BENCHES = {name: f"benchmarks.{name}" for name in (
    "convert", "ab", "audit", "calibrate", "cpu_engine", "cpu_matrix", "eval", "gpu_memory",
    "grouped_experts", "learned", "learned_batches", "learned_compensation", "multi_gpu",
    "obs", "overhead", "plan", "repair", "sparsegpt_batch", "sparsify",
    "stream", "torchrun", "trace")} | {name: f"benchmarks.quality.{name}" for name in (
    "eval_pipelines", "reap_quality", "repair_quality", "guard_kl", "mxfp4_quality",
    "obs_layer_error", "learned_quality", "learned_sweep", "input_scales",
    "exact_cast", "compensation_sweep", "quality_lab", "defaults_sweep")}


def summary(module: str, width: int = 78) -> str:
    """The first sentence of the module's docstring (read without importing it), cut to
    `width` characters."""
    path = HERE.parent.joinpath(*module.split(".")).with_suffix(".py")
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = " ".join(doc.split("\n\n")[0].split()).split(". ")[0].rstrip(".")
    return first if len(first) <= width else first[:width - 3].rstrip() + "..."


def listing() -> str:
    lines = ["python -m benchmarks NAME [ARGS]; NAME one of:"]
    for group, prefix in (("speed and memory (most with a --tiny CPU check)", "benchmarks."),
                          ("quality and figures (CPU)", "benchmarks.quality.")):
        lines += ["", f"{group}:"]
        lines += [f"  {name:<16} {summary(module)}" for name, module in BENCHES.items()
                  if module.rsplit(".", 1)[0] + "." == prefix]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(listing())
        return 0
    if argv[0] not in BENCHES:
        print(f"no benchmark {argv[0]!r}\n\n{listing()}", file=sys.stderr)
        return 2
    return importlib.import_module(BENCHES[argv[0]]).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
