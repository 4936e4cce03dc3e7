"""Calibration data: JSONL of token ids, text or chats, packed into fixed-length sequences.

Checked as it is read, so that a data-driven command fails before any model work: a token id
beyond the model's vocabulary names its file, line and id; text without a tokenizer says so;
data that cannot fill --samples sequences of --seq-len tokens says what it holds (an error, or
with the command's --allow-short-data a warning, and the command records what it used).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kconvert.errors import KconvertError

PAD_ID = -1

# Files one of which a tokenizer directory holds (transformers' tokenizer files; Kimi ships
# tokenizer_config.json with tiktoken.model).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                   "tiktoken.model", "vocab.json")
ALLOW_SHORT = "--allow-short-data"


def shortfall(allow: bool, echo: Callable[[str], None]) -> Callable[[str], None]:
    """`short` for load_calibration_data: data that cannot fill --samples x --seq-len is an
    error, or with --allow-short-data (`allow`) a warning line through `echo`."""
    def refuse(message: str) -> None:
        raise KconvertError(f"{message}; lower --samples or --seq-len, give more data, or pass "
                            f"{ALLOW_SHORT} to run on what it holds")

    def warn(message: str) -> None:
        echo(f"kconvert: warning: {message}; running on what it holds ({ALLOW_SHORT})")

    return warn if allow else refuse


def load_calibration_data(path: str | Path, tokenizer_dir: str | Path | None, samples: int,
                          seq_len: int, seed: int, *, vocab: int | None = None,
                          short: Callable[[str], None] | None = None) -> torch.LongTensor:
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
    remainder becomes a last sequence right-padded with PAD_ID, which calibration never counts,
    and `short` (if given) is called with what the data holds (`shortfall`).
    `vocab`: the model's vocabulary size; a token id at or beyond it is an error naming the
    file, line and id.
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
    # Every line is checked in file order before the shuffle, so an error names the first bad
    # line of the file; text is tokenized later, only as far as the samples need.
    parsed = [_parse_line(lineno, line, path, vocab) for lineno, line in lines]
    first_text = next((lineno for lineno, _, ids in parsed if ids is None), None)
    tokenizer = None if first_text is None else _load_tokenizer(tokenizer_dir, first_text, path)
    random.Random(seed).shuffle(parsed)

    seqs: list[np.ndarray] = []
    stream = np.empty(0, dtype=np.int64)
    for lineno, obj, ids in parsed:
        if len(seqs) >= samples:
            break
        if ids is None:
            ids = np.asarray(_tokenize(tokenizer, obj, f"{path}:{lineno}"), dtype=np.int64)
            _check_vocab(ids, vocab, lineno, path)
        if "input_ids" in obj and len(ids) == seq_len:
            seqs.append(ids)
            continue
        stream = np.concatenate([stream, ids])
        pieces = min(len(stream) // seq_len, samples - len(seqs))
        seqs.extend(stream[i * seq_len:(i + 1) * seq_len] for i in range(pieces))
        stream = stream[pieces * seq_len:]
    full = len(seqs)
    if len(seqs) < samples and len(stream):
        seqs.append(np.concatenate([stream, np.full(seq_len - len(stream), PAD_ID)]))
    if not seqs:
        raise KconvertError("calibration data holds no tokens", file=str(path))
    if full < samples and short is not None:
        rest = f" and one of {len(stream)}" if len(stream) else ""
        short(f"{path} holds {full * seq_len + len(stream)} tokens in {len(lines)} line(s): "
              f"{full} full sequence(s) of {seq_len} tokens{rest}, fewer than --samples "
              f"{samples} x --seq-len {seq_len}")
    return torch.from_numpy(np.stack(seqs).astype(np.int64, copy=False))


def _parse_line(lineno: int, line: str, path: Path,
                vocab: int | None) -> tuple[int, dict, np.ndarray | None]:
    """(line number, its object, its token ids: None where text or messages still need the
    tokenizer), or the error that names the line."""
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
        _check_vocab(ids, vocab, lineno, path)
        return lineno, obj, ids
    if "text" in obj or "messages" in obj:
        return lineno, obj, None
    raise KconvertError(f"line {lineno} has none of input_ids, text, messages", file=str(path))


def _check_vocab(ids: np.ndarray, vocab: int | None, lineno: int, path: Path) -> None:
    if vocab is not None and len(ids) and int(ids.max()) >= vocab:
        raise KconvertError(f"line {lineno}: token id {int(ids.max())} is beyond the "
                            f"model's vocabulary (vocab_size {vocab}: ids 0..{vocab - 1})",
                            file=str(path))


def real_tokens(ids: torch.Tensor) -> int:
    """The tokens of calibration sequences that are not padding."""
    return int((ids != PAD_ID).sum())


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


def _load_tokenizer(tokenizer_dir, lineno: int, path: Path):
    if tokenizer_dir is None or not any((Path(tokenizer_dir) / f).is_file()
                                        for f in TOKENIZER_FILES):
        where = f"{tokenizer_dir} has no tokenizer ({', '.join(TOKENIZER_FILES)})" \
            if tokenizer_dir is not None else "no tokenizer was given"
        raise KconvertError(f"line {lineno} has text or messages, which need a tokenizer, and "
                            f"{where}; give token ids (input_ids) instead, or a tokenizer "
                            "directory (--tokenizer, where the command takes it)", file=str(path))
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
