"""Calibration data: input_ids, text and chat lines packed into sequences, and bad lines
named."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from helpers import write_jsonl
from kconvert.calibrate.data import PAD_ID, load_calibration_data
from kconvert.errors import KconvertError

# ------------------------------------------------------------------- 5. data

def test_input_ids_used_exactly_and_packed(tmp_path):
    exact = list(range(100, 108))  # exactly seq_len: one sequence by itself
    docs = [[1, 2, 3], list(range(4, 15)), [20]]  # 15 tokens: packed into 8 + 7 (+1 pad)
    data = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": r} for r in [exact, *docs]])
    ids = load_calibration_data(data, None, samples=10, seq_len=8, seed=0)
    assert ids.dtype == torch.long and ids.shape == (3, 8)
    rows = ids.tolist()
    assert exact in rows
    packed = [r for r in rows if r != exact]
    assert packed[-1][-1] == PAD_ID and PAD_ID not in packed[0] + packed[-1][:-1]
    stream = [t for r in packed for t in r if t != PAD_ID]  # nothing added, nothing lost
    assert stream in [list(itertools.chain(*p)) for p in itertools.permutations(docs)]
    # Deterministic in the seed; the seed changes the order; samples caps the count.
    again = load_calibration_data(data, None, samples=10, seq_len=8, seed=0)
    assert torch.equal(ids, again)
    orders = {tuple(map(tuple, load_calibration_data(data, None, 10, 8, s).tolist()))
              for s in range(6)}
    assert len(orders) > 1
    two = load_calibration_data(data, None, samples=2, seq_len=8, seed=0)
    assert two.shape == (2, 8) and PAD_ID not in two.tolist()[0] + two.tolist()[1]


def _tokenizer_dir(tmp_path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[BOS]", "hello", "world", "the", "cat", "sat", "user", "assistant"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A",
                                                       special_tokens=[("[BOS]", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="[BOS]", unk_token="[UNK]")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    d = tmp_path / "tok"
    fast.save_pretrained(str(d))
    return d


def test_text_and_messages_lines(tmp_path):
    tok_dir = _tokenizer_dir(tmp_path)
    rows = [{"text": "hello world the cat"}, {"messages": [
        {"role": "user", "content": "hello cat"}, {"role": "assistant", "content": "sat"}]}]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    ids = load_calibration_data(data, tok_dir, samples=4, seq_len=4, seed=0)
    stream = [t for t in ids.reshape(-1).tolist() if t != PAD_ID]
    text = [1, 2, 3, 4, 5]  # the tokenizer's own [BOS] is kept for text
    chat = [7, 2, 5, 8, 6]  # "user hello cat assistant sat", the template's tokens only
    assert stream in (text + chat, chat + text)
    with pytest.raises(KconvertError, match="no tokenizer"):
        load_calibration_data(data, None, samples=4, seq_len=4, seed=0)


def test_bad_data_lines(tmp_path):
    for body, match in (("{\"input_ids\": [1, 2]}\nnot json\n", "line 2 is not JSON"),
                        ("{\"ids\": [1]}\n", "none of input_ids"),
                        ("{\"input_ids\": [1, -2]}\n", "non-negative"),
                        ("\n\n", "empty")):
        (tmp_path / "d.jsonl").write_text(body)
        with pytest.raises(KconvertError, match=match):
            load_calibration_data(tmp_path / "d.jsonl", None, samples=1, seq_len=4, seed=0)


def test_a_bad_line_is_named_in_file_order_whatever_the_shuffle(tmp_path):
    """Lines are shuffled before use, but the error names the first bad line of the file, and
    a bad line beyond what --samples takes is an error too (the file is bad, whichever lines a
    seed would take)."""
    good = [json.dumps({"input_ids": [1, 2, 3, 4]})] * 9
    body = [*good[:4], "not json", *good[4:7], '{"input_ids": [1, -2]}', *good[7:]]
    (tmp_path / "d.jsonl").write_text("\n".join(body) + "\n")
    for seed in range(6):  # seeds that put either bad line first in the shuffled order
        with pytest.raises(KconvertError, match="line 5 is not JSON"):
            load_calibration_data(tmp_path / "d.jsonl", None, samples=1, seq_len=4, seed=seed)


def test_a_token_id_equal_to_the_vocabulary_size_is_refused(tmp_path):
    """ids run 0..vocab-1: vocab itself is one past the embedding's last row."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [0, 511, 3, 4]},
                                              {"input_ids": [1, 2, 512, 4]}])
    with pytest.raises(KconvertError, match=r"line 2: token id 512 is beyond the model's "
                                            r"vocabulary \(vocab_size 512"):
        load_calibration_data(data, None, samples=1, seq_len=4, seed=0, vocab=512)
    ids = load_calibration_data(data, None, samples=2, seq_len=4, seed=0, vocab=513)
    assert int(ids.max()) == 512
