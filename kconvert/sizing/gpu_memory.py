"""`kconvert inspect`'s GPU memory section: each GPU command's plan (kconvert.gpu.budget) at
its default options on the checkpoint's shapes."""

from __future__ import annotations

from kconvert.calibrate.plan import forward
from kconvert.common.options import (
    BATCH_SIZE,
    EVAL_SAMPLES,
    REAP_SAMPLES,
    SEQ_LEN,
    SPARSEGPT_SAMPLES,
)
from kconvert.engine.execute import gpu_encode
from kconvert.evaluate.metrics import LOGIT_ELEMS
from kconvert.gpu.plan import GpuMemoryError, plan_conversion, plan_forward
from kconvert.gpu.shapes import Shapes
from kconvert.methods import obs_memory
from kconvert.model.arch import arch_of
from kconvert.pruning.repair import REPAIR_TOKENS, stream_bytes


def command_plans(text_config: dict, budget: int) -> dict[str, dict]:
    """Each GPU command's plan at its default options on a model of `text_config` (what
    `kconvert inspect` shows): peak bytes, micro-batch, hidden states' place, OBS batch, work
    item size; or the refusal."""
    s = Shapes.from_config(text_config)
    least = s.expert_set()
    obs_forward = forward(s, SPARSEGPT_SAMPLES, SEQ_LEN, BATCH_SIZE, capture=True)
    # every command but a plain quantize runs the model's forward
    forwards = {
        "calibrate": lambda: plan_forward(s, forward(s, REAP_SAMPLES, SEQ_LEN, BATCH_SIZE),
                                          budget, "calibrate"),
        "eval": lambda: plan_forward(s, forward(s, EVAL_SAMPLES, SEQ_LEN, BATCH_SIZE, models=2,
                                                logit_elems=LOGIT_ELEMS["cuda"]),
                                     budget, "eval"),
        "reap --data --repair router": lambda: plan_forward(
            s, forward(s, REAP_SAMPLES, SEQ_LEN, BATCH_SIZE,
                       repair_bytes=stream_bytes(s.hidden, 2, REPAIR_TOKENS)),
            budget, "reap"),
        "sparsify --method sparsegpt": lambda: plan_conversion(
            s, budget, "sparsify", least, obs_memory.gpu_work(s, obs_forward, shared=False,
                                                       against_rtn=False), encode=gpu_encode()),
        "quantize --method gptq": lambda: plan_conversion(
            s, budget, "quantize", least, obs_memory.gpu_work(s, obs_forward, shared=False,
                                                       against_rtn=True), encode=gpu_encode()),
    }
    makers = {**forwards,
              "quantize": lambda: plan_conversion(s, budget, "quantize", least,
                                                  encode=gpu_encode())}
    out = {}
    unsupported = arch_of(text_config).unsupported_forward()
    for name, make in makers.items():
        if unsupported is not None and name in forwards:
            out[name] = {"fits": False, "error": unsupported}
            continue
        try:
            plan = make()
        except GpuMemoryError as exc:
            out[name] = {"fits": False, "error": str(exc)}
            continue
        out[name] = {"fits": True, "peak_bytes": plan.footprint.peak,
                     "batch_size": plan.batch_size or None,
                     "hidden_on_device": plan.hidden_on_device if plan.batch_size else None,
                     "obs_matrices": plan.obs_matrices or None, "work_elems": plan.work_elems,
                     "lines": plan.lines(name)}
    return out
