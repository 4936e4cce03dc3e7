"""`kconvert audit CKPT [--source SRC] [--plan PLAN]`: prove a checkpoint is what it claims to be.

Every failure names the layer, the tensor (or file) and what differs. The checks come in
families, each a module of functions over one audit context (context.py: the checkpoint and
the source opened by kconvert.io.checkpoint and grouped into modules as a conversion groups
them, the manifest and its typed RunRecord, the plan), run in order by auditor.run_audit:

* structure (CKPT alone): index == shards, shard headers valid (kconvert.io.checkpoint's
  survey); no file left by an unfinished kconvert write; config consistent with the tensors
  (kconvert.checks.structure, the checks every conversion runs on its source).
* quant-config: every `quantization_config` agrees with the tensors (kconvert.checks).
* manifest.py: the manifest's tensor and file lists, file hashes, output format, the stages'
  recorded parameters, fused-set scales and per-layer counts; tensor hashes as they stream.
* source.py (--source): router rows and bias entries vs the plan's choice (or the inferred
  mapping), the config, every source tensor accounted for, non-weight files identical.
* scales.py: no NaN/Inf anywhere, scales of the right sign, fused sets sharing their scales.
* p48.py (when the run's record declares it): every chunk of the declared roles is p48.
* stream.py: the pass that reads every byte once and runs the checks on data (hashes,
  NaN/Inf, scale values, p48, byte and decode comparisons against the source; decode.py,
  worker.py).

The report (report.py) renders as a table or as JSON.
"""

from kconvert.audit.auditor import CHUNK, run_audit

__all__ = ["CHUNK", "run_audit"]
