"""The learned p48 mask's Triton kernels (kconvert.methods.pattern_masks_triton) against the
torch functions they replace on a GPU (kconvert.methods.pattern_masks, expert_training's
update): through Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py) or compiled on CUDA
tensors (TRITON_INTERPRET=0 on a GPU machine). The Gumbel draws bit for bit, the masked
weights and the six updated tensors to fp32 rounding, and a short training run's export."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from conftest import TRITON_DEVICE
from kconvert.formats import nvfp4, p48
from kconvert.methods import expert_training as et
from kconvert.methods import pattern_masks as pm
from kconvert.methods import pattern_masks_triton as kernels

if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it)",
                allow_module_level=True)

DEV = TRITON_DEVICE


@triton.jit
def draws_kernel(seed_ptr, out_ptr, n, BLOCK: tl.constexpr):
    e = tl.program_id(1).to(tl.int64)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + e * n + i, kernels.counter_uniform(i, tl.load(seed_ptr + e)),
             mask=i < n)


def kernel_draws(n: int, seed: torch.Tensor) -> torch.Tensor:
    out = torch.empty(len(seed), n, device=DEV)
    draws_kernel[(triton.cdiv(n, 1024), len(seed))](seed.to(DEV), out, n, BLOCK=1024)
    return out.cpu()


def test_the_draws_are_the_torch_generators_bit_for_bit():
    seed = torch.tensor([0, 1, 12345, (1 << 62) - 1, 7 << 40])
    torch.testing.assert_close(kernel_draws(4096, seed),
                               pm.counter_uniform(torch.Size([5, 4096]), seed), rtol=0, atol=0)


def test_the_largest_draw_stays_below_one_in_the_kernel():
    """Counter 1,869,154 under seed 0 hashes to the largest code (tests/methods/test_learned.py):
    held at the largest fp32 below 1, as the torch generator holds it."""
    got = kernel_draws(1_869_155, torch.tensor([0]))
    assert float(got[0, -1]) == pm.BELOW_ONE and float(got.max()) == pm.BELOW_ONE


def mask_problem(seed: int, experts: int = 3, rows: int = 5, cols: int = 1040
                 ) -> tuple[torch.Tensor, ...]:
    """Weights [E, R, K] whose chunk count per expert (650) is not a multiple of the kernels'
    block, logits, per-expert seeds, and a scale and temperature at which the sample is soft."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(experts, rows, cols, generator=g) / 8
    logits = torch.randn(experts, rows, cols // 8, 6, generator=g) / 10
    seeds = torch.randint(1 << 62, (experts,), generator=g)
    return w, logits, seeds, torch.tensor(20.0), torch.tensor(2.0), p48.patterns()


def on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEV) for t in tensors]


def test_the_masked_weights_are_the_torch_functions():
    args = mask_problem(0)
    want = pm.masked_weights(*args)
    got = kernels.masked_weights(*on_device(*args)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # soft masks: most weights neither kept whole nor zeroed, so the sample is what is compared
    ratio = (want / args[0]).flatten()
    assert float(((ratio > 0.01) & (ratio < 0.99)).float().mean()) > 0.5


def test_the_update_is_the_torch_update():
    w, logits, seeds, scale, temperature, masks = mask_problem(1)
    g = torch.Generator().manual_seed(2)
    grad = (torch.randn(w.shape, generator=g) / 100).to(torch.bfloat16)
    state = tuple(torch.rand(t.shape, generator=g) / s for t in (w, w, logits, logits)
                  for s in (1e3,))
    step = torch.tensor([1e-3, 2e-3, 5e-4]).reshape(-1, 1, 1)
    rest = (torch.tensor(4e-3), torch.tensor(0.5), torch.tensor(0.6))  # mask step, c1, c2
    want = [t.clone() for t in (w, logits, *state)]
    et.update_masked(want[0], want[1], grad, seeds, scale, temperature, masks,
                      tuple(want[2:]), step, *rest)
    got = on_device(w, logits, *state)
    kernels.update_masked(got[0], got[1], *on_device(grad, seeds, scale, temperature, masks),
                          tuple(got[2:]), *on_device(step, *rest), betas=et.ADAM_BETAS,
                          eps=et.ADAM_EPS)
    for name, mine, theirs, start in zip(("w", "logits", "m w", "v w", "m logits", "v logits"),
                                         got, want, (w, logits, *state), strict=True):
        assert not torch.equal(theirs, start), name  # every tensor was updated
        torch.testing.assert_close(mine.cpu(), theirs, rtol=1e-5, atol=1e-7, msg=name)


def test_a_layout_the_kernels_do_not_index_is_refused():
    w, logits, seeds, scale, temperature, masks = on_device(*mask_problem(3))
    strided = w.transpose(1, 2).contiguous().transpose(1, 2)  # w's shape, not its layout
    with pytest.raises(ValueError, match="contiguous"):
        kernels.masked_weights(strided, logits, seeds, scale, temperature, masks)
    with pytest.raises(ValueError, match="logits"):
        kernels.masked_weights(w, logits[..., :5], seeds, scale, temperature, masks)
    with pytest.raises(ValueError, match="one seed and step per expert"):
        kernels.masked_weights(w, logits, seeds[:1], scale, temperature, masks)
    state = tuple(torch.zeros_like(t) for t in (w, w, logits, logits))
    grad = torch.zeros_like(w)
    mask_step, c1, c2 = on_device(torch.tensor(1e-3), torch.tensor(0.5), torch.tensor(0.5))
    # a scalar step (the kernel reads one per expert), and a moment of the logits in the
    # weights' shape
    for step, moments in ((mask_step, state), (torch.ones(3, device=DEV), state[:3] + state[:1])):
        with pytest.raises(ValueError, match="state of their shapes"):
            kernels.update_masked(w, logits, grad, seeds, scale, temperature, masks, moments,
                                  step, mask_step, c1, c2, betas=et.ADAM_BETAS, eps=et.ADAM_EPS)


def test_training_with_the_kernels_exports_the_torch_passes_values(monkeypatch):
    """Two small experts trained 20 steps with the kernels as the mask's passes, and with the
    torch functions (compiled on a GPU): the same exported values and block codes."""
    g = torch.Generator().manual_seed(4)
    h, inter, e, t = 32, 16, 2, 128
    w = {"gate_up": torch.randn(e, 2 * inter, h, generator=g) / 4,
         "down": torch.randn(e, h, inter, generator=g) / 4}
    gs = {n: nvfp4.tensor_scale(v.abs().amax((1, 2))).repeat_interleave(v.shape[1])
          .reshape(e, -1) for n, v in w.items()}
    keep = {n: p48.top2_pairs(p48.pair_scores(v)) for n, v in w.items()}
    x = [torch.randn(t, h, generator=g) for _ in range(e)]
    y = [et.expert_outputs(xi[None], w["gate_up"][i:i + 1], w["down"][i:i + 1])[0]
         for i, xi in enumerate(x)]
    gw = [torch.rand(t, generator=g) for _ in range(e)]
    enc = et.Encoding(16, "mse", "compressed-tensors")
    settings = et.TrainSettings(steps=20, tokens=32, lr=2e-3, mask_lr=2e-3, seed=0)

    def run() -> tuple[dict, dict]:
        experts = et.Experts({n: v.clone().to(DEV) for n, v in w.items()},
                             {n: v.to(DEV) for n, v in keep.items()},
                             {n: v.to(DEV) for n, v in gs.items()}, on_device(*x),
                             on_device(*y), on_device(*gw))
        return et.train(experts, enc, settings,
                        [torch.Generator(device=DEV).manual_seed(i) for i in range(e)],
                        torch.float32)

    monkeypatch.setattr(et, "MASK_KERNEL", False)
    want_values, want_codes = run()
    monkeypatch.setattr(et, "mask_passes", lambda device_type: et.kernel_passes())
    got_values, got_codes = run()
    for n in w:
        torch.testing.assert_close(got_values[n], want_values[n], rtol=0, atol=0)
        assert torch.equal(got_codes[n], want_codes[n])
        assert not torch.equal(want_values[n], et.quantized(w[n].to(DEV), gs[n].to(DEV),
                                                            enc)[0])  # it trained
