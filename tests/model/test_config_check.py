"""A malformed config.json is refused by every command and by the audit in one line naming the
key and its value, before any work (kconvert.model.config_check): no traceback, no output
directory, nothing copied into an output that a loader would then read."""

from __future__ import annotations

import pytest

from helpers import assert_user_error, cli_inproc, edit_json, source_copy, write_input_ids


def _set(key: str, value: object):
    return lambda c: c.update({key: value})


def _drop(key: str):
    return lambda c: c.pop(key)


BAD = {  # the edit -> what the error says
    "hidden_size string": (_set("hidden_size", "128"), "config.json's hidden_size is '128'"),
    "experts float": (_set("n_routed_experts", 16.0),
                      "config.json's n_routed_experts is 16.0"),
    "top-k word": (_set("num_experts_per_tok", "four"),
                   "config.json's num_experts_per_tok is 'four'"),
    "top-k zero": (_set("num_experts_per_tok", 0), "config.json's num_experts_per_tok is 0: "
                                                   "input should be greater than 0"),
    "top-k above experts": (_set("num_experts_per_tok", 17),
                            "num_experts_per_tok 17 is more than its n_routed_experts 16"),
    "no vocab": (_drop("vocab_size"), "config.json has no vocab_size"),
    "no heads": (_drop("num_attention_heads"), "config.json has no num_attention_heads"),
    "rope string": (_set("rope_scaling", "yarn"), "config.json's rope_scaling is 'yarn'"),
    "layers bool": (_set("num_hidden_layers", True), "config.json's num_hidden_layers is True"),
}


def _commands(src, tmp_path) -> dict[str, list]:
    data = write_input_ids(tmp_path / "d.jsonl", [[(5 * i + j) % 500 for j in range(16)]
                                                  for i in range(2)])
    cpu = ["--device", "cpu", "--quiet"]
    return {
        "inspect": ["inspect", src],
        "calibrate": ["calibrate", src, "--data", data, "--samples", 2, "--seq-len", 16,
                      "-o", tmp_path / "stats", *cpu],
        "int4-to-nvfp4": ["int4-to-nvfp4", src, tmp_path / "out", *cpu],
        "dequant": ["dequant", src, tmp_path / "out", *cpu],
        "audit": ["audit", src],
    }


@pytest.mark.parametrize("case", BAD)
@pytest.mark.parametrize("command", ["inspect", "calibrate", "int4-to-nvfp4", "dequant",
                                     "audit"])
def test_a_malformed_config_is_one_error_line_before_any_work(tmp_path, case, command):
    src = source_copy(tmp_path)
    edit, said = BAD[case]
    edit_json(src / "config.json", edit)
    res = cli_inproc(*_commands(src, tmp_path)[command])
    assert_user_error(res, said, "config.json")
    assert "Traceback" not in res.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "stats").exists()


def test_an_output_whose_config_was_edited_fails_its_audit(tmp_path):
    """The audit reads the output's config through the same check: a value a loader cannot
    use is a failure, not a pass."""
    src = source_copy(tmp_path)
    out = tmp_path / "out"
    assert cli_inproc("int4-to-nvfp4", src, out, "--device", "cpu", "--quiet").exit_code == 0
    edit_json(out / "config.json", _set("num_experts_per_tok", "four"))
    res = cli_inproc("audit", out, "--source", src)
    assert res.exit_code == 1 and "num_experts_per_tok is 'four'" in res.output


def test_calibrate_refuses_layers_beyond_the_config(tmp_path):
    """Shards holding a decoder layer past num_hidden_layers (and the MTP layers the config
    counts) would be skipped silently by the layer-streamed forward."""
    src = source_copy(tmp_path)
    edit_json(src / "config.json", _set("num_hidden_layers", 2))
    cmd = _commands(src, tmp_path)["calibrate"]
    assert_user_error(cli_inproc(*cmd), "the shards hold decoder layers [2] beyond the "
                      "config's num_hidden_layers=2 (and num_nextn_predict_layers=0)",
                      "tensor model.layers.2.")
    # now layer 2 is the config's MTP layer, which calibration runs: without an MTP layer's
    # own tensors it is refused, named, rather than skipped
    edit_json(src / "config.json", _set("num_nextn_predict_layers", 1))
    assert_user_error(cli_inproc(*cmd), "layer 2, the config's multi-token-prediction layer 1 "
                      "(num_nextn_predict_layers), has no embed_tokens, enorm, hnorm, eh_proj",
                      "tensor model.layers.2.")
