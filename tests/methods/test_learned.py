"""Learned compression (docs/learned.md): the p48 pattern set and its export, the straight-through
NVFP4 path against the encoder's bytes, the trainer on a small problem, and `sparsify --method
learned` end to end on the trained tiny MoE: the guard (recorded errors, and the one-shot bytes
where learning is worse), the same bytes twice on several threads, and sequential inputs."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

import kconvert
from conftest import ROOT
from helpers import checkpoint_tensors, write_input_ids
from kconvert.formats import EncodeSpec, Nvfp4Codec, nvfp4, p48
from kconvert.methods import expert_training as et
from kconvert.methods import learned
from kconvert.methods import pattern_masks as pm
from kconvert.testing.tiny_moe import corpus_ids, windows

TINY_MOE = ROOT / "tests" / "fixtures" / "tiny-moe-trained"


def test_the_six_p48_patterns_keep_two_pairs_each():
    masks = p48.patterns()
    pairs = masks.reshape(6, 4, 2)
    assert bool((pairs[..., 0] == pairs[..., 1]).all())  # whole pairs
    kept = {tuple(int(i) for i in row.nonzero().flatten()) for row in pairs[..., 0]}
    assert kept == set(itertools.combinations(range(4), 2))
    # every pattern's pair mask maps back to it; a chunk keeping 3 pairs is refused
    assert p48.pattern_of(pairs[..., 0].bool()).flatten().tolist() == list(range(6))
    with pytest.raises(ValueError):
        p48.pattern_of(torch.tensor([[True, True, True, False]]))


def test_initial_logits_favour_the_one_shot_pattern_and_export_it():
    w = torch.randn(3, 8, 32, generator=torch.Generator().manual_seed(0))
    keep = p48.top2_pairs(p48.pair_scores(w))
    logits = pm.initial_logits(keep)
    assert logits.shape == (3, 8, 4, 6)
    assert torch.equal(pm.hard_mask(logits) > 0, keep.repeat_interleave(2, -1))
    # the one-shot pattern +PRIOR, the 4 sharing one pair 0, the complement -PRIOR
    assert sorted(logits[0, 0, 0].tolist()) == pytest.approx(
        [-pm.PRIOR, 0, 0, 0, 0, pm.PRIOR])
    # at the first step's scale and temperature, without noise, the soft mask keeps its
    # elements more than half and its pruned ones less
    soft = pm.soft_mask(logits, 100.0, 2.0)
    assert torch.equal(soft > 0.5, keep.repeat_interleave(2, -1))


@pytest.mark.parametrize("rule", ["mse", "amax"])
def test_straight_through_rounds_as_the_encoder_writes(rule):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2, 16, 64, generator=g) * torch.rand(2, 16, 1, generator=g)
    amax = w.abs().amax((1, 2))
    enc = et.Encoding(16, rule, "compressed-tensors")
    gs = nvfp4.tensor_scale(amax).repeat_interleave(16).reshape(2, 16)
    values, codes = et.quantized(w, gs, enc)
    written = Nvfp4Codec.encode(w, EncodeSpec(rule=rule, group_size=16), amax=amax)
    assert torch.equal(codes, written.params["weight_scale"].view(torch.uint8))
    assert torch.equal(values, Nvfp4Codec.decode(written.params, None))
    # the training step's rounding, by arithmetic alone on the rule's codes: the same values
    assert torch.equal(et.block_codes(w, gs, enc), codes)
    assert torch.equal(et.grid_values(w, codes, gs, 16, "compressed-tensors", torch.float32),
                       values)


def test_expert_outputs_gradients_are_autograds_in_the_weights_layout():
    """expert_outputs' products (expert_training._Linear) against autograd's bmm in float64:
    the same gradients of the inputs and both matrices, and the matrices' gradients made in
    their own layout (contiguous), where autograd's bmm gives a transposed view that
    AccumulateGrad then copies."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 7, 12, generator=g, dtype=torch.float64, requires_grad=True)
    gate_up = torch.randn(2, 10, 12, generator=g, dtype=torch.float64, requires_grad=True)
    down = torch.randn(2, 12, 5, generator=g, dtype=torch.float64, requires_grad=True)

    def by_bmm(x, gate_up, down):
        a, b = torch.bmm(x, gate_up.transpose(1, 2)).chunk(2, dim=-1)
        return torch.bmm(torch.nn.functional.silu(a) * b, down.transpose(1, 2))

    got, want = (torch.autograd.grad(f(x, gate_up, down).square().sum(), (x, gate_up, down))
                 for f in (et.expert_outputs, by_bmm))
    for mine, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(mine, theirs)
    assert got[1].is_contiguous() and got[2].is_contiguous()
    assert not want[1].is_contiguous()  # what the copy was for


def test_the_largest_draw_stays_below_one():
    """The counter whose 24 hash bits are all ones (index 1,869,154 under seed 0, found by a
    search over 2^26 counters): its draw is the largest fp32 below 1, so the Gumbel noise and
    the masked weights over it are finite (a draw of exactly 1.0 gave +inf noise and NaN
    weights, and through the loss a NaN expert)."""
    u = pm.counter_uniform(torch.Size([1, 1_869_155]), torch.tensor([0]))
    assert float(u[0, -1]) == pm.BELOW_ONE < 1 and float(u.max()) == pm.BELOW_ONE
    w = torch.ones(1, 311_526, 8)  # its logits [1, 311526, 1, 6] hold counter 1,869,154
    masked = pm.masked_weights(w, torch.zeros(1, 311_526, 1, 6), torch.tensor([0]),
                               torch.tensor(100.0), torch.tensor(2.0), p48.patterns())
    assert bool(masked.isfinite().all())


def test_the_mask_gradients_by_hand_are_autograds():
    """The fused update's gradients of the weights and pattern logits (the masked weights'
    backward written out) equal autograd's through the Gumbel-softmax mask."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(2, 4, 32, generator=g)
    logits = torch.randn(2, 4, 4, 6, generator=g) / 10
    grad = torch.randn(2, 4, 32, generator=g)
    seed = torch.tensor([5, 7])
    scale, temperature = torch.tensor(150.0), torch.tensor(1.5)
    masks = p48.patterns()
    wa, la = w.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    (pm.masked_weights(wa, la, seed, scale, temperature, masks) * grad).sum().backward()
    d_w, d_logits = pm.mask_gradients(w, logits, grad, seed, scale, temperature, masks)
    torch.testing.assert_close(d_w, wa.grad)
    # fp32 rounding: the softmax's backward subtracts nearly equal sums
    torch.testing.assert_close(d_logits, la.grad, rtol=1e-4, atol=1e-4)
    assert float(d_logits.abs().max()) > 1e-3  # the logits are learning, not a zero check


def _problem(seed: int, sparse: bool) -> tuple[et.Experts, et.Encoding]:
    """Two small experts whose target is their own unquantized output."""
    g = torch.Generator().manual_seed(seed)
    h, inter, e, t = 32, 16, 2, 256
    w = {"gate_up": torch.randn(e, 2 * inter, h, generator=g) / 4,
         "down": torch.randn(e, h, inter, generator=g) / 4}
    x = [torch.randn(t, h, generator=g) for _ in range(e)]
    y = [et.expert_outputs(xi[None], w["gate_up"][i:i + 1], w["down"][i:i + 1])[0]
         for i, xi in enumerate(x)]
    gs = {n: nvfp4.tensor_scale(v.abs().amax((1, 2))).repeat_interleave(v.shape[1])
          .reshape(e, -1) for n, v in w.items()}
    keep = {n: p48.top2_pairs(p48.pair_scores(v)) for n, v in w.items()} if sparse else None
    start = {n: torch.where(keep[n].repeat_interleave(2, -1), v, 0.0) if sparse else v
             for n, v in w.items()}
    return (et.Experts(start, keep, gs, x, y, [torch.rand(t, generator=g) for _ in range(e)]),
            et.Encoding(16, "mse", "compressed-tensors"))


@pytest.mark.parametrize("sparse", [False, True])
def test_training_lowers_the_error_and_exports_valid_values(sparse):
    experts, enc = _problem(2, sparse)

    def error(values: dict) -> float:
        out = [et.expert_outputs(x[None], values["gate_up"][i:i + 1], values["down"][i:i + 1])
               for i, x in enumerate(experts.x)]
        return float(sum(et.relative_error(o, y[None], g[None]).sum()
                         for o, y, g in zip(out, experts.y, experts.g, strict=True)))

    start = {n: et.quantized(v, experts.gs[n], enc)[0] for n, v in experts.w.items()}
    settings = et.TrainSettings(steps=60, tokens=64, lr=2e-3, mask_lr=2e-3, seed=0)
    values, codes = et.train(experts, enc, settings,
                             [torch.Generator().manual_seed(e) for e in range(2)], torch.float32)
    assert error(values) < 0.97 * error(start)  # trained on the tokens it is judged on
    for n, v in values.items():
        again, again_codes = et.quantized(v, experts.gs[n], enc)  # on the grid already
        assert torch.equal(again, v) and torch.equal(again_codes, codes[n])
        if sparse:  # a valid p48 mask: exactly 2 pairs per chunk may be nonzero, pruned +0
            packed = Nvfp4Codec.encode(v, EncodeSpec(group_size=16), codes=codes[n],
                                       amax=experts.w[n].detach().abs().amax((1, 2))).params
            for b in range(v.shape[0]):
                assert p48.check_packed(packed["weight_packed"][b]).ok


def _calibration(tmp_path, sequences: int = 48):
    ids = windows(corpus_ids("train"), sequences, 256, torch.Generator().manual_seed(1))
    return write_input_ids(tmp_path / "calib.jsonl", ids.tolist())


def _sparsify(tmp_path, name: str, method: str, data, **options):
    out = tmp_path / name
    kconvert.sparsify(str(TINY_MOE), str(out), method=method, data=str(data), samples=48,
                      seq_len=256, device="cpu", **options)
    return out


def test_learned_p48_end_to_end_guarded_audited_and_the_same_twice(tmp_path):
    data = _calibration(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the same bytes must not depend on thread order
    try:
        a = _sparsify(tmp_path, "a", "learned", data, steps=12)
        b = _sparsify(tmp_path, "b", "learned", data, steps=12)
    finally:
        torch.set_num_threads(threads)
    ta, tb = checkpoint_tensors(a), checkpoint_tensors(b)
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    report = kconvert.audit(str(a), source=str(TINY_MOE), device="cpu")
    assert report.passed, report.render()
    obs = json.loads((a / "kconvert-manifest.json").read_text())["obs"]
    routed = {k: v for k, v in obs.items() if ".mlp.experts." in k}
    assert len(routed) == 3 * 24 * 3  # every routed matrix of the 3 MoE layers
    for name, r in routed.items():
        assert r["oneshot"] == "sparsegpt" and r["steps"] == 12
        if r["method"] == "learned":  # never written unless strictly better held out
            assert r["learned_error"] < r["oneshot_error"], name
        assert r["held_out_tokens"] >= 128 or r["method"] == "sparsegpt"


def test_the_guard_keeps_the_one_shot_bytes_where_learning_is_worse(tmp_path, monkeypatch):
    """Every refusal is clear by far: each of the 216 records' learned error is 320 times the
    one-shot's or more (measured)."""
    data = _calibration(tmp_path)
    oneshot = _sparsify(tmp_path, "sparsegpt", "sparsegpt", data)
    monkeypatch.setattr(learned.LearnedP48, "lr", 5.0)  # steps far too large: training hurts
    worse = _sparsify(tmp_path, "worse", "learned", data, steps=4)
    obs = json.loads((worse / "kconvert-manifest.json").read_text())["obs"]
    assert {r["method"] for r in obs.values()} == {"sparsegpt"}
    assert all(r["learned_error"] is None or r["learned_error"] > r["oneshot_error"]
               for r in obs.values())
    one, bad = checkpoint_tensors(oneshot), checkpoint_tensors(worse)
    experts = [k for k in one if ".mlp.experts." in k]
    assert experts and all(torch.equal(one[k], bad[k]) for k in experts)


def test_sequential_inputs_are_recorded_and_change_later_layers(tmp_path):
    data = _calibration(tmp_path)
    source = _sparsify(tmp_path, "source", "learned", data, steps=4)
    sequential = _sparsify(tmp_path, "sequential", "learned", data, steps=4,
                           hessian="sequential")
    options = json.loads((sequential / "kconvert-manifest.json").read_text())[
        "options"]["sparsify"]
    assert options["hessian"] == "sequential" and options["method"] == "learned"
    a, b = checkpoint_tensors(source), checkpoint_tensors(sequential)
    first = [k for k in a if ".layers.1.mlp.experts." in k]
    later = [k for k in a if ".layers.3.mlp.experts." in k]
    assert all(torch.equal(a[k], b[k]) for k in first)  # layer 1's inputs are the source's
    assert any(not torch.equal(a[k], b[k]) for k in later)


def test_work_items_never_split_an_expert_for_a_method_that_trains_whole_experts():
    """With items of one matrix's size, a method whose unit is the expert still gets each routed
    expert's gate, up and down in one item; a per-matrix method's items split them."""
    from conftest import BUNDLED
    from kconvert.engine.stage import Stage
    from kconvert.engine.work import TransformItem, build_work_plan
    from kconvert.io.checkpoint import open_checkpoint
    from kconvert.model.names import Role

    class Claim(Stage):
        name = "claim"

        def __init__(self, unit: str):
            self.transform = type("T", (), {"unit": unit})()

        def claim(self, m):
            if m.tn.role is Role.ROUTED_EXPERT:
                m.out_codec, m.group_size, m.transform = Nvfp4Codec, 16, self.transform
                m.stages.append(self.name)

    ckpt = open_checkpoint(str(BUNDLED))
    try:
        for unit, whole in (("expert", True), ("matrix", False)):
            plan = build_work_plan(ckpt, [Claim(unit)], 1)  # every set over the item size
            experts = [{(m.tn.layer, m.tn.expert) for s in it.sets for m in s}
                       for it in plan.items if isinstance(it, TransformItem)]
            seen = [e for part in experts for e in part]
            assert (len(seen) == len(set(seen))) == whole, unit
    finally:
        ckpt.close()


def test_experts_with_too_few_tokens_keep_the_one_shot_result(tmp_path):
    """Two short sequences leave every expert of the bundled checkpoint fewer held-out tokens
    than the guard needs: nothing is trained, every record says so, the bytes are SparseGPT's."""
    from conftest import BUNDLED

    data = write_input_ids(tmp_path / "d.jsonl", [list(range(i, i + 32)) for i in range(2)])
    outs = {}
    for method in ("sparsegpt", "learned"):
        outs[method] = tmp_path / method
        kconvert.sparsify(str(BUNDLED), str(outs[method]), method=method, data=str(data),
                          samples=2, seq_len=32, device="cpu")
    obs = json.loads((outs["learned"] / "kconvert-manifest.json").read_text())["obs"]
    assert obs and all(r["method"] == "sparsegpt" and r["learned_error"] is None
                       and r["held_out_tokens"] < 128 for r in obs.values())
    one, learned_out = checkpoint_tensors(outs["sparsegpt"]), checkpoint_tensors(outs["learned"])
    assert one.keys() == learned_out.keys()
    assert all(torch.equal(one[k], learned_out[k]) for k in one)


def test_an_experts_result_does_not_depend_on_the_experts_beside_it():
    """Each expert draws from its own generator (tokens, and the seed of its Gumbel noise), so
    training it alone or in a batch of two (another GPU budget's batch) writes the same values."""
    both, enc = _problem(5, True)
    alone, _ = _problem(5, True)
    for field in ("w", "keep", "gs"):
        setattr(alone, field, {n: v[1:].clone() for n, v in getattr(alone, field).items()})
    alone.x, alone.y, alone.g = both.x[1:], both.y[1:], both.g[1:]
    settings = et.TrainSettings(steps=8, tokens=32, lr=2e-2, mask_lr=1e-2, seed=0)
    together = et.train(both, enc, settings,
                        [torch.Generator().manual_seed(s) for s in (10, 11)], torch.float32)
    single = et.train(alone, enc, settings, [torch.Generator().manual_seed(11)], torch.float32)
    for n in ("gate_up", "down"):
        assert torch.equal(together[0][n][1], single[0][n][0]), n
        assert torch.equal(together[1][n][1], single[1][n][0]), n


@pytest.mark.parametrize("command", ["sparsify", "quantize"])
def test_a_run_that_could_judge_no_expert_says_so_and_what_data_it_needs(tmp_path, command):
    """Two sequences of 32 tokens give no expert of the trained tiny MoE (top-4 of 24) the
    1024 routed tokens learning needs: the closing numbers say nothing was learned and why,
    and a warning names the tokens it takes (1024 x 24 / 4) beside what the data gave."""
    from helpers import MANIFEST, cli_subprocess
    from kconvert.driver.run_summary import RunSummary

    data = write_input_ids(tmp_path / "d.jsonl", [list(range(i, i + 32)) for i in range(2)])
    out = tmp_path / "out"
    done = cli_subprocess(command, TINY_MOE, out, "--method", "learned", "--data", data,
                          "--samples", "2", "--seq-len", "32", "--steps", "2", "--device",
                          "cpu", "--json")
    assert done.returncode == 0, done.stderr
    summary = RunSummary.model_validate_json(done.stdout)
    obs = json.loads((out / MANIFEST).read_text())["obs"]
    routed = [r for r in obs.values() if "oneshot" in r]
    assert routed and all(r["learned_error"] is None for r in routed)
    assert {k: summary.summary[k] for k in ("learned_matrices", "learned_of_matrices",
                                            "learned_too_few_tokens", "learned_refused")} == {
        "learned_matrices": 0, "learned_of_matrices": len(routed),
        "learned_too_few_tokens": len(routed), "learned_refused": 0}
    [warning] = [m for m in summary.messages if "learned nothing" in m]
    assert f"{learned.MIN_ROUTED_TOKENS} routed tokens" in warning
    assert f"at least {learned.MIN_ROUTED_TOKENS * 24 // 4} calibration tokens" in warning
    assert "gave 64 (--samples 2 x --seq-len 32)" in warning
    assert warning in done.stderr


def test_the_learned_counts_add_up_where_some_experts_learn(tmp_path):
    """With 48 x 256 tokens most experts have enough to train and judge: the summary's counts
    are the manifest records' (learned, kept for too few tokens, refused), some learned, no
    warning, and the closing line says them."""
    data = _calibration(tmp_path)
    result = kconvert.sparsify(str(TINY_MOE), str(tmp_path / "out"), method="learned",
                               data=str(data), samples=48, seq_len=256, device="cpu", steps=4)
    obs = json.loads((tmp_path / "out" / "kconvert-manifest.json").read_text())["obs"]
    routed = [r for r in obs.values() if "oneshot" in r]
    wrote = sum(r["method"] == "learned" for r in routed)
    few = sum(r["oneshot_error"] is None for r in routed)
    s = result.summary
    assert (s["learned_matrices"], s["learned_too_few_tokens"]) == (wrote, few)
    assert s["learned_of_matrices"] == len(routed) == wrote + few + s["learned_refused"]
    assert wrote > 0
    assert f"learned {wrote} of {len(routed)} matrices" in result.summary_line()
    assert not [m for m in result.messages if "learned nothing" in m]
