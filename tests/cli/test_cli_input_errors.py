"""Bad input (a config, a source checkpoint, calibration data, a recipe file) reaches the user
as one clear line naming the file, never a traceback, and nothing is written.

Every command goes through the real click entry point (`kconvert.cli.main`) in-process.
"""

from __future__ import annotations

import json
import os
import struct

import pytest

from conftest import BUNDLED, ROOT
from helpers import MANIFEST, assert_user_error, cli_inproc, source_copy, write_input_ids
from kconvert.driver.recipes import load_recipe
from kconvert.errors import KconvertError

TRAINED = ROOT / "tests" / "fixtures" / "tiny-moe-trained"


# ------------------------------------------------------------------ bad input

def test_config_json_that_is_an_array(tmp_path):
    src = source_copy(tmp_path)
    (src / "config.json").write_text("[1, 2]")
    res = cli_inproc("int4-to-nvfp4", src, tmp_path / "out", "--quiet")
    assert_user_error(res, "config.json", "not an object")


def test_broken_symlink_in_source_is_found_before_anything_is_written(tmp_path):
    """It used to be found only when the non-weight files were copied, after every shard."""
    src = source_copy(tmp_path)
    os.symlink(src / "no-such-file", src / "special_tokens_map.json")
    dst = tmp_path / "out"
    res = cli_inproc("int4-to-nvfp4", src, dst, "--quiet")
    assert_user_error(res, str(src / "special_tokens_map.json"), "broken symlink")
    assert not dst.exists() or not any(dst.iterdir())
    # A symlinked directory is not walked into: its files would be lost without a word.
    (src / "special_tokens_map.json").unlink()
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "notes.txt").write_text("x")
    os.symlink(tmp_path / "extra", src / "extra")
    assert_user_error(cli_inproc("int4-to-nvfp4", src, dst, "--quiet"), str(src / "extra"),
                      "symlink to a directory")
    assert not dst.exists() or not any(dst.iterdir())


@pytest.mark.parametrize(("asked", "said"), [
    (["--compensate", "learned"], "learned compensation"),
    (["--repair", "bias"], "router repair"),
    (["--repair", "bias", "--compensate", "down"], "router repair and down compensation"),
])
def test_too_little_data_names_what_needs_it(asked, said, tmp_path):
    """One calibration sequence leaves none held out: the message names what was asked (it
    used to blame router repair for a compensation)."""
    data = write_input_ids(tmp_path / "d.jsonl", [[(7 * j) % 250 for j in range(16)]])
    res = cli_inproc("reap", TRAINED, tmp_path / "out", "--data", data, "--keep", 12,
                     "--samples", 1, "--seq-len", 16, "--device", "cpu", "--quiet", *asked)
    assert_user_error(res, f"kconvert: error: {said}: at least 2 calibration sequences")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ bad recipe files

def test_recipe_key_typo_is_an_error(tmp_path):
    """`block_scal = "amax"` used to be ignored (the default, mse, was used)."""
    recipe = tmp_path / "mine.toml"
    recipe.write_text('[[stages]]\nstage = "dequant"\n'
                      '[[stages]]\nstage = "quantize"\nblock_scal = "amax"\n')
    res = cli_inproc("run", recipe, BUNDLED, tmp_path / "out", "--quiet")
    assert_user_error(res, "'block_scal'", "quantize", "did you mean 'block_scale'")
    assert not (tmp_path / "out").exists()
    # A key of another stage kind names the stage that takes it.
    recipe.write_text('[[stages]]\nstage = "quantize"\ndtype = "F32"\n')
    with pytest.raises(KconvertError, match=r"'dtype'.*option of stage dequant"):
        load_recipe(str(recipe))
    recipe.write_text('name = "x"\nrequires_sourc = "int4-pack-quantized"\n'
                      '[[stages]]\nstage = "quantize"\n')
    with pytest.raises(KconvertError, match=r"'requires_sourc'.*did you mean 'requires_source'"):
        load_recipe(str(recipe))
    recipe.write_text('[[stages]]\nstage = "prune"\nkeep = 4\n')
    with pytest.raises(KconvertError, match=r"'keep' is not a recipe setting.*--keep"):
        load_recipe(str(recipe))


def test_bad_recipe_files_are_messages_before_anything_is_written(tmp_path):
    recipe = tmp_path / "r.toml"
    cases = [
        (b'name = "caf\xe9"\n[[stages]]\nstage = "quantize"\n', "not UTF-8"),
        (b'[[stages]]\nstage = "dequant"\n[[stages]]\nstage = "quantize"\n'
         b'block_scale = "foo"\n', "unknown block_scale 'foo'"),
        (b'[[stages]]\nstage = "quantize"\n[[stages]]\nstage = "dequant"\n',
         "dequant after quantize"),
    ]
    for text, said in cases:
        recipe.write_bytes(text)
        out = tmp_path / "out"
        res = cli_inproc("run", recipe, BUNDLED, out, "--quiet")
        assert_user_error(res, said, str(recipe) if said != "unknown block_scale 'foo'" else said)
        assert not list(out.glob("*.safetensors")) and not (out / MANIFEST).exists()


# ------------------------------------------------------------------ bad checkpoints

@pytest.mark.parametrize("model_type", ["kimi_k2", "llama"])
def test_a_llama_config_is_refused_by_conversions_and_failed_by_the_audit(model_type, tmp_path):
    """`architectures: [LlamaForCausalLM]` beside a Kimi model_type used to convert, and the
    audit passed such a checkpoint."""
    src = source_copy(tmp_path)
    config = json.loads((src / "config.json").read_text())
    config["architectures"], config["model_type"] = ["LlamaForCausalLM"], model_type
    (src / "config.json").write_text(json.dumps(config))
    res = cli_inproc("int4-to-nvfp4", src, tmp_path / "out", "--quiet")
    assert_user_error(res, "unsupported architecture ['LlamaForCausalLM']", "config.json")
    res = cli_inproc("audit", src, "--quiet")
    assert res.exit_code == 1 and "unsupported architecture" in res.output, res.output
    res = cli_inproc("audit", BUNDLED, "--source", src, "--quiet")
    assert_user_error(res, "unsupported architecture")


def test_shard_problems_name_the_tensor_and_what_the_path_is(tmp_path):
    """A header entry whose byte range is not its dtype x shape names that tensor (it used to
    name only the file); a shard that is a directory is not called missing."""
    src = source_copy(tmp_path)
    shard = src / "model-00002-of-000004.safetensors"
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    victim = sorted(k for k in header if k != "__metadata__")[3]
    header[victim]["shape"] = [header[victim]["shape"][0] + 1, *header[victim]["shape"][1:]]
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    shard.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])
    res = cli_inproc("int4-to-nvfp4", src, tmp_path / "out", "--quiet")
    assert_user_error(res, victim, shard.name)
    other = source_copy(tmp_path / "dir")
    target = other / "model-00003-of-000004.safetensors"
    target.unlink()
    target.mkdir()
    res = cli_inproc("int4-to-nvfp4", other, tmp_path / "out2", "--quiet")
    assert_user_error(res, "is a directory, not a file", target.name)
