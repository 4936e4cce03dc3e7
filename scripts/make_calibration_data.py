"""Calibration (or eval) data for the bundled checkpoints: a JSONL file of token ids, one
{"input_ids": [...]} a line, each a window of SEQ_LEN bytes of the Python standard library's
sources (the text the trained tiny MoEs learned; docs/tiny-moe.md). Byte ids (0-255, and 257 for
<eos> between files) are valid for tests/fixtures/tiny-moe-trained and tiny-moe-96 (vocabulary
258) and for the tiny Kimi fixtures (byte-level, 512), none of which needs a tokenizer then.

    python scripts/make_calibration_data.py OUT.jsonl [--samples 16] [--seq-len 256]
        [--split train|heldout] [--seed 0]

Calibrate on --split train (the default); evaluate on --split heldout (files the tiny MoEs never
saw). Then, e.g.:
    kconvert reap tests/fixtures/tiny-moe-trained /tmp/pruned --keep 12 --data OUT.jsonl \\
        --samples 16 --seq-len 256 --compensate down
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kconvert.testing.tiny_moe import corpus_ids, windows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--samples", type=int, default=16, help="lines (sequences) to write")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per line")
    ap.add_argument("--split", choices=("train", "heldout"), default="train")
    ap.add_argument("--seed", type=int, default=0, help="which windows")
    a = ap.parse_args()
    ids = windows(corpus_ids(a.split), a.samples, a.seq_len,
                  torch.Generator().manual_seed(a.seed))
    a.out.write_text("".join(json.dumps({"input_ids": row}) + "\n" for row in ids.tolist()))
    print(f"wrote {a.out}: {a.samples} lines of {a.seq_len} token ids ({a.split} split)")


if __name__ == "__main__":
    main()
