"""`kconvert audit CKPT [--source SRC] [--plan PLAN]`: prove a checkpoint is what it claims to be.

Every failure names the layer, the tensor (or file) and what differs. The checks come in
families, each a module of functions over one audit context (context.py: the checkpoint and
the source opened by kconvert.io.checkpoint and grouped into modules as a conversion groups
them, the manifest and its typed RunRecord, the plan), run in order by auditor.run_audit:

* structure (CKPT alone): index == shards, shard headers valid (kconvert.io.checkpoint's
  survey); no file left by an unfinished kconvert write; config consistent with the tensors
  (kconvert.checks.structure, the checks every conversion runs on its source).
* quant-config: every `quantization_config` agrees with the tensors (kconvert.checks).
* manifest_checks.py: the manifest's tensor and file lists, file hashes, output format, the stages'
  recorded parameters, fused-set scales and per-layer counts; tensor hashes as they stream.
* source.py (--source): router rows and bias entries vs the plan's choice (or the inferred
  mapping), the config, every source tensor accounted for, non-weight files identical.
* scales.py: no NaN/Inf anywhere, scales of the right sign, fused sets sharing their scales.
* p48.py (when the run's record declares it): every chunk of the declared roles is p48.
* serve.py (--serve ENGINE): what each serving engine's loader depends on (serve_checks.py),
  READY / NOT READY per engine.
* stream.py: the pass that reads every byte once and runs the checks on data (hashes,
  NaN/Inf, scale values, p48, byte and decode comparisons against the source; decode.py,
  worker.py).

The report (report.py) renders as a table or as JSON.
"""

from kconvert.audit import auditor
from kconvert.audit.auditor import CHUNK, run_audit
from kconvert.audit.report import Report
from kconvert.common.callable_package import callable_package


def audit(ckpt: str, *, source: str | None = None, plan: str | None = None,
          device: str = "auto", revision: str | None = None, max_rel_mse: float | None = None,
          chunk_mb: int = CHUNK >> 20, progress: bool = False,
          gpu_memory: str | int | None = None, serve: str | None = None) -> Report:
    """`kconvert audit CKPT` in the Python API (kconvert.audit(...)): the report
    (`report.passed`, `report.render()`, `report.to_json()`); a failed check is in the report,
    not an exception. `gpu_memory` caps its GPU memory (kconvert.gpu.budget). `serve`:
    "vllm,sglang"-like engines (or "auto") whose loaders' checks run too
    (kconvert.audit.serve; `report.serve`, `report.serve_ready`)."""
    from kconvert.gpu.budget import GpuRequest, size_option
    from kconvert.gpu.devices import pick_device

    gpu = GpuRequest(pick_device(device), size_option(gpu_memory)).context
    with gpu.enforced("audit", "--chunk-mb"):
        # Through the module, so that a test can stand in for auditor.run_audit.
        return auditor.run_audit(ckpt, source, plan, gpu.device, revision, progress=progress,
                                 max_rel_mse=max_rel_mse, chunk=chunk_mb << 20,
                                 serve_engines=serve)


callable_package(__name__, audit)

__all__ = ["CHUNK", "audit", "run_audit"]
