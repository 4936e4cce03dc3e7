"""ShardReader.read_ints (the INT4 weight_shape values a plan reads) against the tensors
safetensors wrote: every integer dtype unpacked from its bytes, a float one through torch,
and a file cut short after it was opened refused by name."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from kconvert.errors import KconvertError
from kconvert.io.shards import ShardReader

TENSORS = {
    "i8": torch.tensor([-3, 7], dtype=torch.int8),
    "u8": torch.tensor([0, 255], dtype=torch.uint8),
    "i16": torch.tensor([-30000, 12], dtype=torch.int16),
    "i32": torch.tensor([7168, 2048], dtype=torch.int32),
    "i64": torch.tensor([2**40, -5], dtype=torch.int64),
    "f32": torch.tensor([4096.0, 7168.0]),
}


def test_read_ints_are_the_tensors_values(tmp_path):
    path = tmp_path / "s.safetensors"
    save_file(TENSORS, str(path))
    reader = ShardReader(path)
    try:
        for name, t in TENSORS.items():
            got = reader.read_ints(reader.tensors[name])
            assert got == tuple(int(v) for v in t.tolist()), name
            assert all(type(v) is int for v in got), name
    finally:
        reader.close()


def test_a_file_cut_short_is_refused_by_name(tmp_path):
    path = tmp_path / "s.safetensors"
    save_file(TENSORS, str(path))
    reader = ShardReader(path)
    try:
        info = max(reader.tensors.values(), key=lambda i: i.end)
        os.truncate(path, info.start + 1)
        with pytest.raises(KconvertError, match="file ended early") as err:
            reader.read_ints(info)
        assert err.value.tensor == info.name
    finally:
        reader.close()
