"""`kconvert audit CKPT [--source SRC] [--plan PLAN]`: the check families, in order, over one
audit context (kconvert.audit says what each family checks)."""

from __future__ import annotations

from pathlib import Path

import torch

from kconvert.audit import input_scales, manifest_checks, p48, scales, serve, source, stream
from kconvert.audit.context import AuditContext, open_side
from kconvert.audit.report import Report
from kconvert.checks.quant_config import check_quant_config
from kconvert.checks.structure import check_config, check_layers
from kconvert.checks.survey import survey_checkpoint
from kconvert.errors import KconvertError
from kconvert.gpu.devices import pick_device
from kconvert.io.checkpoint import open_checkpoint
from kconvert.pruning.plan import load_plan

CHUNK = 8 << 20  # default bytes per streamed piece of a plain tensor


def run_audit(ckpt: str | Path, source: str | None = None, plan: str | None = None,
              device: str | torch.device = "auto", revision: str | None = None,
              progress: bool = False, max_rel_mse: float | None = None, chunk: int = CHUNK,
              serve_engines: str | None = None) -> Report:
    """Audit CKPT on `device` (a torch device, or --device's spec for pick_device); returns
    the report (`report.passed`). `serve_engines`: --serve's value (None: not asked; "auto":
    the engines that read CKPT's formats), whose verdicts are `report.serve`. Raises
    KconvertError when it cannot (CKPT is not a directory, an unreadable plan or source, a bad
    --device)."""
    root = Path(ckpt)
    if not root.is_dir():
        raise KconvertError("CKPT is not a directory", file=str(root))
    report = Report(str(ckpt), source, plan)
    device_ = device if isinstance(device, torch.device) else pick_device(device)
    prune_plan = load_plan(plan) if plan else None
    # A source must be consistent: it is opened as a conversion opens it.
    src = open_side(open_checkpoint(source, revision), report, "source") if source else None
    try:
        opened = survey_checkpoint(root.resolve(), report)
        if opened is None:
            return report
        ctx = AuditContext(report, open_side(opened, report, "structure"), src, device_,
                           max_rel_mse, max(8, chunk // 8 * 8), progress, plan=prune_plan)
        try:
            _run_families(ctx)
            if serve_engines is not None:
                results = serve.check_engines(ctx.ckpt, serve.parse_engines(serve_engines))
                report.serve = serve.serve_json(results)
                report.serve_lines = serve.render_serve(results)
        finally:
            ctx.ckpt.close()
    finally:
        if src is not None:
            src.close()
    return report


def _run_families(ctx: AuditContext) -> None:
    r = ctx.report
    manifest_checks.load(ctx)
    config, modules = ctx.ckpt.ckpt.config, list(ctx.ckpt.modules.values())
    check_config(r, config)
    layers = check_layers(r, config, ctx.ckpt.tensors, modules)
    ctx.moe_layers = layers.moe
    for layer, columns in layers.rows.items():
        vars(r.row(layer)).update(columns)
    check_quant_config(r, config, modules, ctx.ckpt.root)
    manifest_checks.check_files(ctx)
    _before_stream(ctx)
    stream.run(ctx)
    p48.check_declared(ctx)
    scales.check_fused_sets(ctx)
    input_scales.check_input_scales(ctx)
    _after_stream(ctx)
    r.fill_scales_column()


def _before_stream(ctx: AuditContext) -> None:
    """What the manifest records, and the expert mapping the streaming pass compares under."""
    if ctx.manifest is not None:
        manifest_checks.check_recorded(ctx)
    if ctx.source is not None:
        source.map_experts(ctx)
        source.check_config(ctx)
    elif ctx.plan is not None:
        source.check_plan_alone(ctx)


def _after_stream(ctx: AuditContext) -> None:
    """What needs every tensor read: recorded scales and counts, the source's accounting."""
    recorded = ctx.manifest is not None
    if recorded:
        manifest_checks.check_after_stream(ctx)
    if ctx.source is None:
        return
    source.check_accounting(ctx)
    if recorded:
        manifest_checks.check_sources(ctx)
    source.check_other_files(ctx)
