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
    ap.add_argument("--text", action="store_true",
                    help="write each window as a text line (--seq-len bytes), which every "
                         "command tokenizes with the checkpoint's own tokenizer (the "
                         "Kimi-routed proxy's BPE: tests/fixtures/kimi-proxy)")
    a = ap.parse_args()
    ids = windows(corpus_ids(a.split), a.samples, a.seq_len,
                  torch.Generator().manual_seed(a.seed))
    if a.text:  # <eos> between files becomes a line break; a cut character is dropped
        rows = [{"text": bytes(b if b < 256 else 10 for b in row).decode("utf-8", "ignore")}
                for row in ids.tolist()]
    else:
        rows = [{"input_ids": row} for row in ids.tolist()]
    a.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    kind = "text lines of" if a.text else "lines of"
    print(f"wrote {a.out}: {a.samples} {kind} {a.seq_len} {'bytes' if a.text else 'token ids'}"
          f" ({a.split} split)")


if __name__ == "__main__":
    main()
