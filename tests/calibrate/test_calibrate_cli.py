"""`kconvert calibrate` from the command line: its output files, --overwrite, and errors
that name what to look at."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import cli_inproc, edit_tensor, set_at, source_copy, write_jsonl

# ------------------------------------------------------------------- CLI

def test_cli(fixture_dir, tmp_path):
    src = fixture_dir("bf16")
    rows = [{"input_ids": [(7 * i + j) % 500 for j in range(16)]} for i in range(5)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    out = tmp_path / "stats"
    args = [str(src), "--data", str(data), "-o", str(out), "--samples", "3", "--seq-len", "16",
            "--batch-size", "2", "--seed", "1", "--device", "cpu", "--dtype", "float32"]
    res = cli_inproc("calibrate", *args)
    assert res.exit_code == 0, res.output
    meta = json.loads((out / "stats.json").read_text())
    assert (meta["samples"], meta["seq_len"], meta["tokens"], meta["seed"]) == (3, 16, 48, 1)
    assert meta["routing"] == ("sigmoid+bias selection, renormalised sigmoid weights x "
                               "routed_scaling_factor")
    assert (out / "act_stats.json").is_file() and (out / "stats.safetensors").is_file()
    res = cli_inproc("calibrate", *args)
    assert res.exit_code == 1 and "--overwrite" in res.output
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"input_ids": [600] * 16}])  # vocab is 512
    res = cli_inproc("calibrate", args[0], "--data", bad, "-o", tmp_path / "s2", "--seq-len", 16)
    assert res.exit_code == 1 and "line 1: token id 600 is beyond the model's vocabulary" \
        in res.output


@pytest.mark.parametrize(("index", "value", "said"), [
    ((0, 0), float("nan"), "the source weights hold NaN or Inf"),
    # a row of the largest finite BF16 values: the sum over the row overflows
    ((0, slice(None)), 3e38, "the activations overflowed; its largest value, "
                             f"{torch.tensor(3e38, dtype=torch.bfloat16).item():.4g}, is in the "
                             "tensor named here"),
])
def test_non_finite_hidden_states_name_the_file_and_tensor(tmp_path, index, value, said):
    """A NaN in a layer's weights, or a finite value so large that the layer's output
    overflows: the error names the shard and the tensor to look at, not only the layer."""
    src = source_copy(tmp_path)
    name = "model.layers.1.self_attn.o_proj.weight"
    edit_tensor(src / "model-00002-of-000004.safetensors", name, set_at(index, value))
    data = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [7 * j % 500 for j in range(16)]}])
    res = cli_inproc("calibrate", src, "--data", data, "-o", tmp_path / "stats", "--samples", 1,
                     "--seq-len", 16, "--device", "cpu", "--quiet")
    assert res.exit_code == 1, res.output
    assert "non-finite hidden states after decoder layer 1" in res.output
    assert said in res.output
    assert f"(file model-00002-of-000004.safetensors, tensor {name})" in res.output
