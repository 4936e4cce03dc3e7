"""`kconvert eval` against a whole-model transformers computation (issue 14, acceptance 1 and 2).

The trained tiny MoE and three candidates made from it by kconvert (NVFP4, 16 of 24 experts
kept, p48 magnitude + NVFP4) are evaluated layer-streamed in fp32. The oracle loads each model
whole into transformers' DeepseekV3ForCausalLM (quantized candidates through `dequant --dtype
F32`, which decodes them exactly) and computes every number from its logits and hidden states
in float64 with code written here.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from conftest import ROOT
from kconvert.driver.convert import RunControl, convert
from kconvert.driver.recipes import load_recipe
from kconvert.evaluate.run import evaluate
from kconvert.io.checkpoint import open_checkpoint
from kconvert.pruning.plan import parse_plan
from kconvert.stages.prune import prune_stage
from kconvert.testing.tiny_moe import heldout_ids, load_kimi_checkpoint

SRC = ROOT / "tests" / "fixtures" / "tiny-moe-trained"
TOL = 1e-5


def _convert(src, dst, recipe: str, options: dict | None = None, prepare=None):
    convert(str(src), str(dst), load_recipe(recipe), options or {}, RunControl(quiet=True),
            prepare=prepare)
    return dst


@pytest.fixture(scope="module")
def candidates(tmp_path_factory):
    """name -> (candidate directory, the same model as a dense F32/BF16 directory)."""
    tmp = tmp_path_factory.mktemp("eval-candidates")
    nvfp4 = _convert(SRC, tmp / "nvfp4", "quantize")
    p48 = _convert(SRC, tmp / "p48", "sparsify", {"method": "magnitude"})
    layers = {str(layer): {"keep": sorted(random.Random(layer).sample(range(24), 16))}
              for layer in (1, 2, 3)}
    plan = parse_plan({"criterion": "random", "layers": layers})
    pruned = _convert(SRC, tmp / "pruned", "reap",
                      prepare=lambda ckpt: {"prune": prune_stage(plan, ckpt)})
    return {
        "nvfp4": (nvfp4, _convert(nvfp4, tmp / "nvfp4-f32", "dequant", {"dtype": "F32"})),
        "pruned": (pruned, pruned),
        "p48": (p48, _convert(p48, tmp / "p48-f32", "dequant", {"dtype": "F32"})),
    }


@pytest.fixture(scope="module")
def ids():
    return heldout_ids(4 * 64, seed=3, window=64).reshape(4, 64)


def _eval(src, cands, ids, dtype=torch.float32):
    opened = [open_checkpoint(str(p)) for p in (src, *cands)]
    try:
        return evaluate(opened[0], opened[1:], ids, "cpu", 3, dtype=dtype,
                        labels=[str(c) for c in cands])
    finally:
        for ckpt in opened:
            ckpt.close()


@torch.no_grad()
def _whole(model_dir, ids, replace_input: tuple[int, torch.Tensor] | None = None):
    """(logits, hidden states after every decoder layer) of the whole model; with
    replace_input (L, h), decoder layer L runs on h instead of its real input."""
    model = load_kimi_checkpoint(model_dir, torch.float32)
    model.config.tie_last_hidden_states = False  # hidden_states[-1]: the last layer, not normed
    handle = None
    if replace_input is not None:
        layer, h = replace_input

        def swap(_module, args, kwargs):
            if args:
                return (h, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": h}

        handle = model.model.layers[layer].register_forward_pre_hook(swap, with_kwargs=True)
    try:
        out = model(ids, output_hidden_states=True)
    finally:
        if handle is not None:
            handle.remove()
    return out.logits.double(), [h.double() for h in out.hidden_states[1:]]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def source_whole(ids):
    return _whole(SRC, ids)


@pytest.fixture(scope="module")
def report(candidates, ids):
    return _eval(SRC, [c for c, _ in candidates.values()], ids)


@pytest.mark.parametrize("name", ["nvfp4", "pruned", "p48"])
def test_eval_equals_whole_model_transformers(name, candidates, ids, source_whole, report):
    cand_dir, dense_dir = candidates[name]
    result = next(c for c in report.candidates if c.candidate == str(cand_dir))
    logits_s, hidden_s = source_whole
    logits_c, hidden_c = _whole(dense_dir, ids)

    logp_s = torch.log_softmax(logits_s, -1).reshape(-1, logits_s.shape[-1])
    logp_c = torch.log_softmax(logits_c, -1).reshape(-1, logits_c.shape[-1])
    kl = (logp_s.exp() * (logp_s - logp_c)).sum(-1)
    entropy_s = -(logp_s.exp() * logp_s).sum(-1)
    top5_s, top5_c = logp_s.topk(5, -1).indices.tolist(), logp_c.topk(5, -1).indices.tolist()
    overlap = sum(len(set(a) & set(b)) for a, b in zip(top5_s, top5_c, strict=True))
    targets = ids[:, 1:, None]
    expected = {
        "kl_mean": float(kl.mean()),
        "kl_p99": float(torch.quantile(kl, 0.99)),
        # over the tenth of positions where the source is least sure
        "kl_high_entropy": float(kl[entropy_s.topk(math.ceil(0.1 * len(kl))).indices].mean()),
        "top1_agreement": float((logp_s.argmax(-1) == logp_c.argmax(-1)).double().mean()),
        "top5_overlap": overlap / (5 * len(top5_s)),
        "nll_source": -float(logp_s.reshape(*ids.shape, -1)[:, :-1].gather(-1, targets).mean()),
        "nll_candidate": -float(
            logp_c.reshape(*ids.shape, -1)[:, :-1].gather(-1, targets).mean()),
    }
    got = result.logits.model_dump()
    assert expected["kl_mean"] > 1e-4 and expected["top1_agreement"] < 1  # a real difference
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=TOL), key
    assert got["ppl_candidate"] == pytest.approx(torch.tensor(got["nll_candidate"]).exp().item())

    n_layers = len(hidden_s)
    assert sorted(result.layers, key=int) == [str(L) for L in range(n_layers)]
    for layer in range(n_layers):
        acc = _rel(hidden_c[layer], hidden_s[layer])
        assert result.layers[str(layer)].rel_err == pytest.approx(acc, abs=TOL), layer
        # Local error: the candidate's whole model with layer L fed the source's input.
        source_input = (source_whole[1][layer - 1] if layer else None)
        if source_input is None:  # layer 0's input is the embedding, the same in both
            local = acc
        else:
            _, swapped = _whole(dense_dir, ids, (layer, source_input.float()))
            local = _rel(swapped[layer], hidden_s[layer])
        assert result.layers[str(layer)].rel_err_local == pytest.approx(local, abs=TOL), layer
    assert result.layers[str(n_layers - 1)].rel_err > 0


def test_candidates_keep_their_order_and_expert_counts(candidates, report):
    assert [c.candidate for c in report.candidates] == [str(c) for c, _ in candidates.values()]
    assert [c.n_routed_experts for c in report.candidates] == [24, 16, 24]
    assert report.tokens == 256 and report.scored_tokens == 4 * 63


def test_self_eval_is_exactly_zero(ids):
    """Acceptance 2: KL 0, top-1 1.0, equal NLLs, zero errors (bf16: test_cli.py)."""
    report = _eval(SRC, [SRC], ids)
    (c,) = report.candidates
    assert c.logits.kl_mean == 0 and c.logits.kl_p99 == 0
    assert c.logits.top1_agreement == 1.0 and c.logits.top5_overlap == 1.0
    assert c.logits.nll_source == c.logits.nll_candidate > 0
    assert all(e.rel_err == 0 and e.rel_err_local == 0 for e in c.layers.values())


def test_padding_is_never_measured(candidates, ids):
    """A row padded after k tokens measures exactly what its k-token prefix measures alone
    (attention is causal, so the padding cannot change the prefix)."""
    k = 40
    padded = ids[:2].clone()
    padded[1, k:] = -1
    nvfp4 = candidates["nvfp4"][0]
    a = _eval(SRC, [nvfp4], padded)
    b_full, b_prefix = _eval(SRC, [nvfp4], ids[:1]), _eval(SRC, [nvfp4], ids[1:2, :k].clone())
    assert a.tokens == 64 + k and a.scored_tokens == 63 + k - 1
    (ca,), (cf,), (cp,) = a.candidates, b_full.candidates, b_prefix.candidates
    for key in ("nll_source", "nll_candidate"):
        expected = (getattr(cf.logits, key) * 63 + getattr(cp.logits, key) * (k - 1)) / (62 + k)
        assert getattr(ca.logits, key) == pytest.approx(expected, abs=1e-6), key
    expected_top1 = (cf.logits.top1_agreement * 64 + cp.logits.top1_agreement * k) / (64 + k)
    assert ca.logits.top1_agreement == pytest.approx(expected_top1, abs=1e-9)
