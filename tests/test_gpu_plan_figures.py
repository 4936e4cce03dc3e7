"""The GPU memory plan of fixed small shapes, term by term, against figures written here by
hand from docs/gpu-memory.md's terms and the bundled checkpoint's config (no kconvert function
computes an expected figure): GPTQ on experts, attention and the dense MLP with held-out
tokens (`quantize --method gptq --dry-run`, planned as a run plans it), and REAP's calibration
with router repair (`reap --data --repair router`, its plan captured where the command makes
it). And the layer prefetcher: what it builds ahead of the loop stays within its share.

The bundled checkpoint: hidden 128, moe_intermediate 64, dense intermediate 256, 16 routed
experts (top 4) and 1 shared, 4 heads, q_lora 64, kv_lora 32, qk_nope 16, qk_rope 8, v_head 16,
layers 0 dense and 1-2 MoE; BF16 compute (2 bytes an element)."""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import BUNDLED, ROOT
from helpers import cli_inproc, write_input_ids
from kconvert.calibrate import plan as calibrate_plan
from kconvert.calibrate import run
from kconvert.calibrate.load import build_layer
from kconvert.driver import run_plan
from kconvert.gpu.budget import GpuContext, GpuRequest
from kconvert.io.checkpoint import open_checkpoint

GIB = 1 << 30
MIB = 1 << 20
OVERHEAD = 512 * MIB
# One MoE layer's weights in elements: attention (q_a 128x64, q_b 64x(4x24), kv_a 128x40,
# kv_b 32x(4x32), o 64x128) = 31,744; 17 experts x 3 x 128 x 64 = 417,792; router 16 x 128.
LAYER_ELEMS = 8192 + 6144 + 5120 + 4096 + 8192 + 17 * 3 * 128 * 64 + 16 * 128
# A layer's decode beside it: every element at once (fewer than 2^28), fp32 + bf16 + packed.
DECODE = LAYER_ELEMS * (4 + 2 + 1)
# One micro-batch of 8 sequences of 16 tokens through an MoE layer, per token: residual copies
# 6 x 128 x 2; q, k, v and copies 2 x 4 heads x (3 x 24 + 2 x 16 + 16) x 2; the low-rank
# latents (64 + 32 + 8) x 2; router logits, scores, biased scores 3 x 4 x 16; the gathered
# routed inputs and ids 4 x (128 x 2 + 32 + 4); the routed output 4 x 128; the shared expert
# 2 x 2 x 64 x 2; one expert's worst case (4 x 64 + 128) x 2. Plus attention scores
# 8 x 4 heads x 16 x 16 x 6 bytes.
ACTIVATIONS = 128 * (1536 + 1920 + 208 + 192 + 1168 + 512 + 512 + 768) + 8 * 4 * 16 * 16 * 6


def _ids(n: int, length: int = 16) -> list[list[int]]:
    return [[(7 * i + j) % 500 for j in range(length)] for i in range(n)]


def test_gptq_plan_of_experts_attention_and_dense_mlp_with_held_out_tokens(tmp_path,
                                                                          monkeypatch):
    """64 sequences of 16 tokens: 1024 tokens, so every 8th is held out (128 of them)."""
    planned = []
    plan_gpu = run_plan.plan_gpu
    monkeypatch.setattr(run_plan, "plan_gpu", lambda *a, **k: planned.append(plan_gpu(*a, **k))
                        or planned[-1])
    data = write_input_ids(tmp_path / "d.jsonl", _ids(64))
    res = cli_inproc("quantize", BUNDLED, tmp_path / "out", "--method", "gptq", "--data", data,
                     "--samples", 64, "--seq-len", 16, "--targets",
                     "experts,attention,dense_mlp", "--device", "cpu", "--gpu-memory", "40GiB",
                     "--dry-run")
    assert res.exit_code == 0, res.output
    plan = planned[-1]
    assert (plan.budget, plan.batch_size, plan.hidden_on_device) == (40 * GIB, 8, True)
    assert plan.obs_matrices == 16  # every routed expert's gate+up in one OBS batch
    # input Grams: one fp32 [in, in] sum per fused set, two with held-out tokens (fit and
    # held out), and one step's rows (2 x 4096 x the widest input): attention's q_a+kv_a 128,
    # q_b 64, kv_b 32, o 64; the dense MLP's gate+up 128, down 256
    grams = 4 * (2 * (128 * 128 + 64 * 64 + 32 * 32 + 64 * 64 + 128 * 128 + 256 * 256)
                 + 2 * 4096 * 256)
    assert plan.footprint.resident == {
        "overhead": OVERHEAD,
        "hidden states": 1024 * 128 * 2,
        "layer weights": LAYER_ELEMS * 2,
        "captured layer inputs": 1024 * (128 * 2 + 4 * 3 * 8),
        "input Grams": grams,
    }
    # the engine's item: 16 experts x 3 x 128 x 64 elements, held as fp32 and its source bytes
    item = 16 * 3 * 128 * 64
    held = item * (4 + 2)
    # one OBS matrix, gate+up [128, 128] against RTN, 4 bytes an element: the Hessian, its
    # factor and temporaries (4 x k^2) and the held-out Hessian (k^2); the weights, their copy,
    # the result, RTN's values, the difference and its product with H (7 x rows x k)
    per_matrix = 4 * (5 * 128 * 128 + 7 * 128 * 128)
    phases = plan.footprint.phases
    assert phases["decoding a layer"] == {"decode": DECODE, "engine's current item": held}
    assert phases["running a micro-batch"] == {"activations": ACTIVATIONS,
                                               "engine's current item": held}
    assert phases["solving an OBS batch"] == {
        "OBS batch": 16 * per_matrix,
        # the busiest expert's routed inputs in fp32 and their copies: 8 x the mean share
        # (1024 x 4 / 16 tokens), 6 bytes per input
        "busiest expert's inputs": 1024 * 128 * 6,
        "engine's item and result": held + 4 * item,
    }


def test_reap_calibration_with_router_repair_plans_its_stream(tmp_path, monkeypatch):
    """reap --data --repair router on 4 sequences of 16 tokens, with a 40 GiB budget (a CPU
    run given one, so that the command plans as on a GPU)."""
    monkeypatch.setattr(GpuRequest, "context", property(
        lambda self: GpuContext(self.device, 40 * GIB, 40 * GIB)))
    planned = []
    forward_plan = calibrate_plan.forward_plan
    monkeypatch.setattr(calibrate_plan, "forward_plan",
                        lambda *a, **k: planned.append(forward_plan(*a, **k)) or planned[-1])
    data = write_input_ids(tmp_path / "d.jsonl", _ids(4))
    res = cli_inproc("reap", BUNDLED, tmp_path / "out", "--data", data, "--samples", 4,
                     "--seq-len", 16, "--keep", 8, "--repair", "router", "--device", "cpu",
                     "--quiet")
    assert res.exit_code == 0, res.output
    (plan,) = planned
    assert (plan.batch_size, plan.hidden_on_device) == (8, True)
    assert plan.footprint.resident == {
        "overhead": OVERHEAD,
        "hidden states": 64 * 128 * 2,
        "layer weights": LAYER_ELEMS * 2,
        # the repaired model's stream: per calibration token (64, fewer than its 32768) its
        # hidden state in BF16 and 4 fp32 vectors (MoE input, target, candidates' moments)
        "repair stream": 64 * 128 * (2 + 4 * 4),
    }
    assert plan.footprint.phases == {"decoding a layer": {"decode": DECODE},
                                     "running a micro-batch": {"activations": ACTIVATIONS}}


@pytest.mark.parametrize("share", ["none", "a dense layer", "unbounded"])
def test_the_prefetcher_builds_ahead_only_within_its_share(monkeypatch, share):
    """Calibration of the trained tiny MoE with the prefetcher's share set: a layer is built on
    the prefetch thread only while its decoded bytes fit the share; the rest are built when
    the loop asks for them. What the thread holds built never exceeds the share."""
    ahead: list[int] = []  # decoded bytes of each layer built on the prefetch thread
    sizes: list[int] = []

    def build(raw, *args, **kwargs):
        sizes.append(raw.decoded_nbytes)
        if threading.current_thread().name.startswith("kconvert-prefetch"):
            ahead.append(raw.decoded_nbytes)
        return build_layer(raw, *args, **kwargs)

    monkeypatch.setattr(run, "build_layer", build)
    src = ROOT / "tests" / "fixtures" / "tiny-moe-trained"
    ids = torch.tensor(_ids(2), dtype=torch.long)
    ckpt = open_checkpoint(str(src))
    try:
        probe = []
        monkeypatch.setattr(run, "build_layer", lambda raw, *a, **k: probe.append(
            raw.decoded_nbytes) or build_layer(raw, *a, **k))
        run.measure_stats(ckpt, ids, "cpu", 2, dtype=torch.float32, prefetch=False)
        limit = {"none": 0, "a dense layer": min(probe), "unbounded": None}[share]
        monkeypatch.setattr(run, "build_layer", build)
        run.measure_stats(ckpt, ids, "cpu", 2, dtype=torch.float32, prefetch_bytes=limit)
    finally:
        ckpt.close()
    assert sizes == probe  # every layer built once, in order, ahead or not
    # exactly the layers that fit were built ahead (the MoE layers are larger than the dense)
    assert ahead == [n for n in probe if limit is None or n <= limit], (ahead, limit)
    assert min(probe) < max(probe)
