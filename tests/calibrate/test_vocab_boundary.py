"""The vocabulary's edge: a token id equal to vocab_size is the first one past it (ids run
0..vocab_size-1), refused when the data is read, naming file, line and id, before a layer is
read; and the embedding's own check refuses it where data reaches the forward pass another
way. The last id in the vocabulary is read."""

from __future__ import annotations

import pytest
import torch

from conftest import ROOT
from helpers import assert_user_error, cli_inproc, write_input_ids
from kconvert.calibrate import load
from kconvert.calibrate.data import load_calibration_data
from kconvert.calibrate.forward import embed
from kconvert.errors import KconvertError
from kconvert.io.checkpoint import open_checkpoint

TINY_MOE = ROOT / "tests" / "fixtures" / "tiny-moe-trained"
VOCAB = 258  # the trained tiny MoE's vocab_size


def test_an_id_equal_to_the_vocabulary_size_is_refused_before_a_layer_is_read(tmp_path,
                                                                              monkeypatch):
    def never(*_args, **_kwargs):
        raise AssertionError("a layer was read before the data was checked")

    monkeypatch.setattr(load, "read_layer", never)
    data = write_input_ids(tmp_path / "d.jsonl", [[1, 2, 3, 4], [5, VOCAB, 7, 8]])
    res = cli_inproc("calibrate", TINY_MOE, "--data", data, "-o", tmp_path / "stats",
                     "--samples", 2, "--seq-len", 4, "--device", "cpu", "--quiet")
    assert_user_error(res, f"line 2: token id {VOCAB} is beyond the model's vocabulary",
                      str(data))


def test_the_last_id_of_the_vocabulary_is_read(tmp_path):
    data = write_input_ids(tmp_path / "d.jsonl", [[1, VOCAB - 1, 3, 4]])
    ids = load_calibration_data(data, None, 1, 4, 0, vocab=VOCAB)
    assert ids.tolist() == [[1, VOCAB - 1, 3, 4]]
    with pytest.raises(KconvertError, match=f"token id {VOCAB} is beyond"):
        load_calibration_data(write_input_ids(tmp_path / "e.jsonl", [[1, VOCAB, 3, 4]]), None,
                              1, 4, 0, vocab=VOCAB)


def test_the_embedding_refuses_an_id_equal_to_its_rows():
    ckpt = open_checkpoint(str(TINY_MOE))
    try:
        last = embed(ckpt, torch.tensor([[VOCAB - 1]]), torch.float32)
        assert last.shape[-1] == ckpt.text_config["hidden_size"] and bool(last.any())
        with pytest.raises(KconvertError, match=f"token id {VOCAB} is outside the embedding"):
            embed(ckpt, torch.tensor([[0, VOCAB]]), torch.float32)
    finally:
        ckpt.close()
