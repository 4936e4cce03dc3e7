"""What the layer-streamed calibration test modules share: the token ids calibrated, the
transformers reference model of a dense checkpoint and its forward, and the streamed run.

References are independent of kconvert/calibrate.py: hidden states come from a whole-model
transformers DeepseekV3ForCausalLM forward; router decisions from that model's own
DeepseekV3TopkRouter (captured by a forward hook); expert outputs and activation statistics
from a per-token, per-expert loop over weights read straight from the safetensors files.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.utils import logging as hf_logging

from kconvert.calibrate.data import PAD_ID
from kconvert.calibrate.run import measure_stats as calibrate
from kconvert.calibrate.stats import CalibrationStats
from kconvert.io.checkpoint import open_checkpoint

hf_logging.set_verbosity_error()

N_SEQ, SEQ_LEN, BATCH = 3, 20, 2  # 3 sequences in batches of 2: a ragged last batch
MOE_LAYERS = (1, 2)
PROJS = ("gate_proj", "up_proj", "down_proj")


def token_ids(pad: bool) -> torch.Tensor:
    ids = torch.randint(0, 500, (N_SEQ, SEQ_LEN), generator=torch.Generator().manual_seed(3))
    if pad:
        ids[1, 13:] = PAD_ID  # right padding, as load_calibration_data writes it
    return ids


def load_reference(d: Path, dense: dict[str, torch.Tensor]) -> DeepseekV3ForCausalLM:
    """transformers' model of a dense checkpoint dir, checked to hold exactly `dense`."""
    cfg = DeepseekV3Config.from_pretrained(d)
    cfg.model_type = "deepseek_v3"  # transformers fuses per-expert tensors only for this type
    model, info = DeepseekV3ForCausalLM.from_pretrained(d, config=cfg, dtype=torch.float32,
                                                        output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    state, n = model.state_dict(), cfg.moe_intermediate_size
    for name, t in dense.items():
        parts = name.split(".")
        if ".mlp.experts." in name:
            layer, e, proj = int(parts[2]), int(parts[5]), parts[6]
            ex = model.model.layers[layer].mlp.experts
            held = {"gate_proj": ex.gate_up_proj[e, :n], "up_proj": ex.gate_up_proj[e, n:],
                    "down_proj": ex.down_proj[e]}[proj]
        else:
            held = state[name]
        assert torch.equal(held, t.float()), f"{name} not loaded into the reference model"
    return model.eval()


def reference_run(model, ids: torch.Tensor) -> tuple[list[torch.Tensor], dict]:
    """Hidden states after each layer (pre-final-norm) and, per MoE layer, the router's input
    and outputs (topk_weights, topk_indices) exactly as transformers computed them."""
    routers = {}
    hooks = [model.model.layers[L].mlp.gate.register_forward_hook(
        lambda _m, args, out, L=L: routers.__setitem__(L, (args[0].reshape(-1, args[0].shape[-1]),
                                                           out[1], out[2])))
        for L in MOE_LAYERS]
    captured = []
    hooks += [layer.register_forward_hook(lambda _m, _a, out: captured.append(out))
              for layer in model.model.layers]
    mask = (ids != PAD_ID).long()
    with torch.no_grad():
        model(ids.clamp(min=0), attention_mask=mask)
    for h in hooks:
        h.remove()
    return captured, routers


def streamed(ckpt_dir: Path, ids: torch.Tensor) -> tuple[CalibrationStats, list[torch.Tensor]]:
    outs: list[torch.Tensor] = []
    ckpt = open_checkpoint(str(ckpt_dir))
    try:
        stats = calibrate(ckpt, ids, "cpu", BATCH, dtype=torch.float32,
                          on_layer=lambda _L, h: outs.append(h.clone()))
    finally:
        ckpt.close()
    return stats, outs
