"""Copies to the host in the background (kconvert.gpu.host_copies): each batch lands in the
dict its submit names once waited for, the bytes as `Tensor.cpu()` makes them; on a GPU through
the pinned buffers, for tensors smaller than, equal to and larger than a buffer, of several
dtypes, a scalar and an empty one included."""

from __future__ import annotations

import pytest
import torch

from kconvert.gpu.host_copies import STAGE_BYTES, HostCopies


def tensors(device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    words = STAGE_BYTES // 4
    return {
        "bf16": torch.randn(3, 1000, generator=g, device=device).to(torch.bfloat16),
        "scalar": torch.rand((), generator=g, device=device),
        "empty": torch.empty(0, 7, device=device),
        "int32-one-stage": torch.randint(-2**31, 2**31 - 1, (words,), generator=g,
                                         device=device, dtype=torch.int32),
        "int32-beyond": torch.randint(-2**31, 2**31 - 1, (2 * words + 5,), generator=g,
                                      device=device, dtype=torch.int32),
        "view": torch.randn(4, 64, generator=g, device=device)[1],
    }


def check(device: torch.device) -> None:
    made = tensors(device)
    first, second = {}, {}
    with HostCopies(device) as copies:
        copies.submit(dict(list(made.items())[:3]), first)
        copies.submit(dict(list(made.items())[3:]), second)
        copies.wait()
    assert set(first) == {"bf16", "scalar", "empty"}
    assert set(second) == {"int32-one-stage", "int32-beyond", "view"}
    for name, host in {**first, **second}.items():
        want = made[name].cpu()
        assert host.device.type == "cpu" and host.dtype == want.dtype
        assert host.shape == want.shape, name
        assert torch.equal(host, want), name


def test_copies_land_where_named_on_a_cpu():
    check(torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned path needs a GPU")
def test_staged_copies_are_the_bytes_on_a_gpu():
    check(torch.device("cuda"))
