"""Layer-streamed calibration: REAP saliency, expert frequencies and activation statistics.

The calibration tokens are embedded once (only the embedding rows they use are read), then the
decoder layers are streamed: for L = 0..num_hidden_layers-1 only layer L's tensors are read and
decoded (INT4, NVFP4, FP8-block or BF16, through `kconvert.formats`) to the compute dtype, the
layer runs over the hidden states of every calibration token, statistics are accumulated, and
the outputs become layer L+1's inputs. While layer L runs, layer L+1 is read on a thread
(`prefetch.py`), never more than one layer ahead: layer L's weights are freed before L+2 is read.

Exact forward. The layer is transformers' own `DeepseekV3DecoderLayer` (MLA attention with its
YaRN rope, RMSNorms, residuals, dense MLP below `first_k_dense_replace`), built from the
checkpoint's text config read as "deepseek_v3" and loaded with layer L's tensors. Only the MoE
block is ours, and only its routed experts (grouped matrix products): the router is transformers'
`DeepseekV3TopkRouter` (selection on sigmoid(logits) + e_score_correction_bias with the group
limits, weights = sigmoid at the chosen experts, renormalised when norm_topk_prob, times
routed_scaling_factor) and the shared expert is `DeepseekV3MLP`. Each routed expert sees only
the tokens routed to it (tokens are gathered per expert, never every expert on every token).

Statistics, per MoE layer L and routed expert j, over real (non-padding) routed tokens X_j:
  count      |X_j|                                           (`layers.L.count`, int64)
  gate_sum   sum g_j(x)                                      (`layers.L.gate_sum`)
  reap_sum   sum g_j(x) * ||f_j(x)||_2                       (`layers.L.reap_sum`)
  ean_sum    sum ||f_j(x)||_2                                (`layers.L.ean_sum`)
  ean_sq_sum sum ||f_j(x)||_2^2                              (`layers.L.ean_sq_sum`)
  saliency   reap_sum / count, 0 for a never-routed expert   (`layers.L.saliency`, REAP)
where f_j(x) = down(act(gate x) * up x) is the expert's raw output before gating and g_j(x) is
the weight the model really multiplies it by: the sigmoid score renormalised over the top-k
and times routed_scaling_factor (GATE_WEIGHT). Per linear of every decoder layer (attention,
dense MLP, shared and routed experts), over the inputs that linear actually sees (for a routed
expert: its routed tokens; for down_proj: act(gate x) * up x):
  input_amax     max |x|                                     (`<key>.input_amax`, 0-dim)
  input_sq_sum   per input column sum x^2 (Wanda's ||X_j||^2) (`<key>.input_sq_sum`)
  block_amax_hist  counts of log2(amax) of its blocks of 16     (`<key>.block_amax_hist`,
                 int64 [512]; kconvert.calibrate.block_amax: --input-scale headroom)
with <key> = `layers.L.experts.E.{proj}`, `layers.L.shared_experts.{proj}`, `layers.L.mlp.{proj}`
(dense) or `layers.L.self_attn.{proj}`; `stats.json` maps every key to its checkpoint module.

Padding: an input id of PAD_ID (-1), or a 0 in `attention_mask`, marks a padding position.
Padding is never counted in any statistic, is never routed to an expert, and real tokens never
attend to it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kconvert.common.callable_package import callable_package
from kconvert.common.options import BATCH_SIZE, REAP_SAMPLES, SEED, SEQ_LEN

if TYPE_CHECKING:
    from kconvert.calibrate.stats import CalibrationStats


def calibrate_to(src: str, data: str, output: str, *, samples: int = REAP_SAMPLES,
                 seq_len: int = SEQ_LEN, batch_size: int = BATCH_SIZE, seed: int = SEED,
                 device: str = "auto", dtype: str = "bfloat16", tokenizer: str | None = None,
                 revision: str | None = None, overwrite: bool = False,
                 progress: Callable[[str], None] | None = None,
                 gpu_memory: str | int | None = None,
                 allow_short_data: bool = False,
                 warn: Callable[[str], None] | None = None) -> CalibrationStats:
    """`kconvert calibrate SRC --data FILE -o OUTPUT` in the Python API
    (kconvert.calibrate(...)): the statistics, also written to OUTPUT (stats.safetensors,
    stats.json, act_stats.json). `gpu_memory` ('40GiB' or bytes) is the GPU memory budget
    (kconvert.gpu.budget; default: what the card has free less a safety margin). Data that
    cannot fill `samples` sequences of `seq_len` tokens is an error, or with
    `allow_short_data` a warning, to `warn` (default: `progress`)."""
    from kconvert.calibrate.startup import phase
    from kconvert.gpu.budget import size_option

    with phase("imports"):
        from kconvert.calibrate.run import run_calibration

    return run_calibration(src, data, output, samples, seq_len, batch_size, seed, device,
                           dtype, tokenizer, revision, overwrite,
                           progress=progress or (lambda _message: None),
                           gpu_memory=size_option(gpu_memory),
                           allow_short_data=allow_short_data, warn=warn)


callable_package(__name__, calibrate_to)
