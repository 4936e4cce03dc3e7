"""A shard several ranks write into (GPTQ and SparseGPT under torchrun) is finished by its
owner only when every rank that writes into it reported its part: with a part missing the
run stops naming the shard, which stays unfinished (neither renamed into place nor recorded
as done), and a later --resume writes it again; with every part it is finished and its record
holds every part's tensors and modules."""

from __future__ import annotations

import json

import pytest

from kconvert.engine.sink import finish_parts
from kconvert.errors import KconvertError
from kconvert.io.lock import STATE_DIR

SHARD = "model-00002-of-00003.safetensors"


def _part(rank: int) -> dict:
    name = f"model.layers.1.mlp.experts.{rank}.down_proj.weight_packed"
    return {"tensors": {name: {"rank": rank}}, "modules": {name.rsplit(".", 1)[0]: rank}}


@pytest.fixture
def partial(tmp_path):
    """DST with the shard's partial file every writer wrote into."""
    path = tmp_path / STATE_DIR / "partial" / SHARD
    path.parent.mkdir(parents=True)
    path.write_bytes(b"every rank's tensors")
    return tmp_path


@pytest.mark.parametrize("reported", [[0], [1], []])
def test_a_shard_with_a_part_missing_stays_unfinished(partial, reported):
    with pytest.raises(KconvertError, match=f"{len(reported)} of the 2 ranks that write into "
                                            "the shard reported their part") as exc:
        finish_parts(partial, SHARD, [_part(r) for r in reported], 2)
    assert SHARD in str(exc.value)
    assert not (partial / SHARD).exists()
    assert (partial / STATE_DIR / "partial" / SHARD).is_file()
    assert not (partial / STATE_DIR / "done" / f"{SHARD}.json").exists()


def test_a_shard_with_every_part_is_finished_with_every_parts_record(partial):
    record = finish_parts(partial, SHARD, [_part(0), _part(1)], 2)
    assert (partial / SHARD).read_bytes() == b"every rank's tensors"
    assert not (partial / STATE_DIR / "partial" / SHARD).exists()
    assert record == {"tensors": {**_part(0)["tensors"], **_part(1)["tensors"]},
                      "modules": {**_part(0)["modules"], **_part(1)["modules"]}}
    assert json.loads((partial / STATE_DIR / "done" / f"{SHARD}.json").read_text()) == record
