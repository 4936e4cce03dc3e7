"""The inputs of the multi-token-prediction layers (DeepSeek-V3's num_nextn_predict_layers;
docs/mtp.md), so that the calibration forward runs each of them like a decoder layer and every
data-driven command (REAP's criteria, GPTQ, SparseGPT, Wanda's statistics) sees it.

MTP layer k (k = 1..n, stored as layer num_hidden_layers + k - 1) predicts token i+k+1 at
position i from

    x_i = eh_proj([enorm(E(t_{i+k})); hnorm(h_i)])

with E the layer's own embedding copy, and h the previous stage's output: the main model's
last hidden state after its final norm for k = 1, MTP layer k-1's output after that. This is
vLLM's `deepseek_mtp.py` (`DeepSeekMultiTokenPredictorLayer.forward`: the embedding zeroed at
position 0, the embedding first in the concatenation) fed the target model's output hidden
states, as its speculative decoding and SGLang's `deepseek_nextn.py` feed it. Position i is a
real token of layer k where tokens i and i+k both are.
"""

from __future__ import annotations

import torch
from torch import nn

from kconvert.calibrate.data import PAD_ID
from kconvert.calibrate.forward import embed, final_tensor, rms_norm
from kconvert.errors import KconvertError
from kconvert.io.checkpoint import Checkpoint
from kconvert.io.shards import TensorInfo
from kconvert.model.names import Role, parse_name

# What an MTP layer's input is computed from, besides the decoder layer it holds.
INPUT_TENSORS = ("embed_tokens", "enorm", "hnorm", "eh_proj")


def decoder_tensors(tensors: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """A layer's tensors without those only an MTP layer holds: the decoder layer's."""
    return {n: i for n, i in tensors.items() if parse_name(n).role is not Role.MTP}


def mtp_valid(valid: torch.Tensor, step: int) -> torch.Tensor:
    """[num_seqs, seq_len]: position i is real for MTP layer `step` where tokens i and
    i + step are."""
    out = torch.zeros_like(valid)
    out[:, :-step] = valid[:, :-step] & valid[:, step:]
    return out


def into_mtp_input(ckpt: Checkpoint, cfg, tensors: dict[str, TensorInfo], step: int,
                   hidden: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor,
                   batch_size: int, device: torch.device, dtype: torch.dtype) -> None:
    """Replace `hidden` [num_seqs, seq_len, hidden] (the previous stage's output; on the
    device or in host memory) in place by MTP layer `step`'s input, `batch_size` sequences at
    a time on `device`. `tensors`: the MTP layer's; `ids` the sequences' tokens, `valid` the
    layer's real positions (mtp_valid)."""
    own = {}
    for name, info in tensors.items():
        tn = parse_name(name)
        if tn.role is Role.MTP and tn.proj in INPUT_TENSORS:
            own[tn.proj] = (name, info)
    missing = [t for t in INPUT_TENSORS if t not in own]
    if missing:
        first = next(iter(tensors.values()))
        raise KconvertError(f"layer {parse_name(first.name).layer}, the config's "
                            f"multi-token-prediction layer {step} (num_nextn_predict_layers), "
                            f"has no {', '.join(missing)}", file=first.file.name,
                            tensor=first.name)

    def read(what: str) -> torch.Tensor:
        info = own[what][1]
        return ckpt.reader_for(info).read(info).to(device, dtype)

    eps = cfg.rms_norm_eps
    enorm, hnorm, eh_proj = rms_norm(read("enorm"), eps), rms_norm(read("hnorm"), eps), read(
        "eh_proj")
    final = rms_norm(final_tensor(ckpt, Role.NORM, (cfg.hidden_size,)).to(device, dtype), eps)
    # the token i + step at position i; none (PAD_ID: a zero embedding) at position 0, as vLLM
    # masks it, and where position i is not real
    ahead = torch.full_like(ids, PAD_ID)
    ahead[:, :-step] = ids[:, step:]
    ahead[:, 0] = PAD_ID
    ahead[~valid] = PAD_ID
    with torch.no_grad():
        for start in range(0, hidden.shape[0], batch_size):
            rows = slice(start, min(start + batch_size, hidden.shape[0]))
            h = hidden[rows].to(device)
            if step == 1:
                h = final(h)
            e = embed(ckpt, ahead[rows], dtype, device, tensor=own["embed_tokens"][0])
            x = nn.functional.linear(torch.cat([enorm(e), hnorm(h)], dim=-1), eh_proj)
            hidden[rows].copy_(x, non_blocking=True)
