"""Calibration data: JSONL of token ids, text or chats, packed into fixed-length sequences."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

from kconvert.errors import KconvertError

PAD_ID = -1


def load_calibration_data(path: str | Path, tokenizer_dir: str | Path | None, samples: int,
                          seq_len: int, seed: int) -> torch.LongTensor:
    """Calibration sequences [n, seq_len] (n <= samples) from a JSONL file.

    Each line is an object with one of:
      "input_ids": a list of token ids, used exactly as given (no special tokens added);
      "text":      tokenized by AutoTokenizer.from_pretrained(tokenizer_dir,
                   trust_remote_code=True) with the tokenizer's own special tokens;
      "messages":  a chat, tokenized with the tokenizer's chat template.
    Lines are taken in an order shuffled by `seed`. A line of exactly `seq_len` input_ids is
    one sequence by itself; every other line is appended to a packing stream that is cut into
    `seq_len` pieces (a long document continues in the next sequence). Once `samples`
    sequences exist the rest is not tokenized. If the data runs out first, the stream's
    remainder becomes a last sequence right-padded with PAD_ID, which calibration never counts.
    """
    path = Path(path)
    if samples < 1 or seq_len < 1:
        raise KconvertError(f"--samples {samples} and --seq-len {seq_len} must be positive")
    try:
        lines = [(n, ln) for n, ln in enumerate(path.read_text().splitlines(), 1) if ln.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise KconvertError(f"cannot read calibration data: {exc}", file=str(path)) from exc
    if not lines:
        raise KconvertError("calibration data is empty", file=str(path))
    random.Random(seed).shuffle(lines)

    tokenizer = None
    seqs: list[np.ndarray] = []
    stream = np.empty(0, dtype=np.int64)
    for lineno, line in lines:
        if len(seqs) >= samples:
            break
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise KconvertError(f"line {lineno} is not JSON: {exc}", file=str(path)) from exc
        if not isinstance(obj, dict):
            raise KconvertError(f"line {lineno} is not a JSON object", file=str(path))
        if "input_ids" in obj:
            ids = _token_ids(obj["input_ids"], line)
            if ids is None:
                raise KconvertError(f"line {lineno}: input_ids must be a list of non-negative "
                                    "integers", file=str(path))
            if len(ids) == seq_len:
                seqs.append(ids)
                continue
        elif "text" in obj or "messages" in obj:
            if tokenizer is None:
                tokenizer = _load_tokenizer(tokenizer_dir)
            ids = np.asarray(_tokenize(tokenizer, obj, where), dtype=np.int64)
        else:
            raise KconvertError(f"line {lineno} has none of input_ids, text, messages",
                                file=str(path))
        stream = np.concatenate([stream, ids])
        pieces = min(len(stream) // seq_len, samples - len(seqs))
        seqs.extend(stream[i * seq_len:(i + 1) * seq_len] for i in range(pieces))
        stream = stream[pieces * seq_len:]
    if len(seqs) < samples and len(stream):
        seqs.append(np.concatenate([stream, np.full(seq_len - len(stream), PAD_ID)]))
    if not seqs:
        raise KconvertError("calibration data holds no tokens", file=str(path))
    return torch.from_numpy(np.stack(seqs).astype(np.int64, copy=False))


def _token_ids(ids, line: str) -> np.ndarray | None:
    """A JSON list of non-negative integers as int64, converted in bulk (no Python loop over
    the tokens); None when it is anything else."""
    if not isinstance(ids, list):
        return None
    if not ids:
        return np.empty(0, dtype=np.int64)
    # JSON true/false would pass as 1/0 in bulk: only a line that spells them is checked id
    # by id.
    if ("true" in line or "false" in line) and any(isinstance(i, bool) for i in ids):
        return None
    try:
        arr = np.asarray(ids)
    except (ValueError, OverflowError):  # ragged nesting, integers beyond int64
        return None
    if arr.ndim != 1 or arr.dtype.kind not in "iu" or (arr < 0).any():
        return None
    return arr.astype(np.int64, copy=False)


def _load_tokenizer(tokenizer_dir):
    if tokenizer_dir is None:
        raise KconvertError("calibration data has text or messages but no tokenizer was given")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=True)
    except Exception as exc:  # any loading failure is the user's to fix
        raise KconvertError(f"cannot load the tokenizer: {exc}", file=str(tokenizer_dir)) from exc


def _tokenize(tokenizer, obj: dict, where: str) -> list[int]:
    try:
        if "text" in obj:
            if not isinstance(obj["text"], str):
                raise TypeError("text must be a string")
            ids = tokenizer(obj["text"])["input_ids"]
        else:
            ids = tokenizer.apply_chat_template(obj["messages"], tokenize=True,
                                                add_generation_prompt=False)
            if not isinstance(ids, list):  # a BatchEncoding in transformers 5
                ids = ids["input_ids"]
    except KconvertError:
        raise
    except Exception as exc:
        raise KconvertError(f"cannot tokenize: {exc}", file=where) from exc
    return [int(i) for i in ids]
