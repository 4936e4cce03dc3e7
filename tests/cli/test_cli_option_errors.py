"""Bad options reach the user as one clear line and exit 2 (a value the model cannot take
exits 1), never a traceback, and no option is silently dropped: a value out of range, an option
alone where it acts only with another, two that exclude each other, one no stage of the recipe
takes.

Every command goes through the real click entry point (`kconvert.cli.main`) in-process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import BUNDLED
from helpers import (
    MANIFEST,
    assert_user_error,
    calibrated,
    cli_inproc,
    source_copy,
    write_input_ids,
)
from kconvert.errors import KconvertError


@pytest.fixture(scope="module")
def stats_dir(tmp_path_factory) -> Path:
    """Real `kconvert calibrate` statistics of the bundled fixture (for --stats)."""
    return calibrated(BUNDLED, tmp_path_factory.mktemp("stats"), 5)


# ------------------------------------------------------------------ reap: --keep / --prune-ratio

@pytest.mark.parametrize("command", ["reap", "run reap"])
def test_keep_and_prune_ratio_are_range_checked(command, stats_dir, tmp_path):
    """`--keep -3` used to exit 0 keeping 13 experts; `--keep 0` and `--prune-ratio 0.99`
    ended in a pydantic traceback. Each is now refused, naming the option, and nothing is
    written."""
    cases = [  # a value outside the option's range is a usage error (2), one the model
        (["--keep", "-3"], "--keep", 2),  # cannot take is bad input (1)
        (["--keep", "0"], "--keep", 2),
        (["--keep", "2"], "num_experts_per_tok=4", 1),  # the fixture's router picks 4
        (["--keep", "17"], "n_routed_experts=16", 1),
        (["--prune-ratio", "0.99"], "num_experts_per_tok=4", 1),  # keeps round(0.16) = 0
        (["--prune-ratio", "1"], "--prune-ratio", 2),
        (["--prune-ratio", "-0.5"], "--prune-ratio", 2),
    ]
    for i, (opts, said, code) in enumerate(cases):
        dst = tmp_path / f"out{i}"
        res = cli_inproc(*command.split(), BUNDLED, dst, "--stats", stats_dir, *opts, "--quiet")
        assert_user_error(res, said, code=code)
        assert not (dst / MANIFEST).exists()


def test_prune_ratio_without_n_routed_experts_names_config_and_key(stats_dir, tmp_path):
    src = source_copy(tmp_path)
    config = json.loads((src / "config.json").read_text())
    del config["n_routed_experts"]
    (src / "config.json").write_text(json.dumps(config))
    for command in (["reap"], ["run", "reap"]):
        res = cli_inproc(*command, src, tmp_path / "out", "--stats", stats_dir, "--prune-ratio",
                         "0.5", "--quiet")
        assert_user_error(res, "n_routed_experts", str(src / "config.json"))
        assert not (tmp_path / "out" / MANIFEST).exists()


@pytest.mark.parametrize(("key", "value", "said"), [
    ("num_experts_per_tok", None, "config.json has no num_experts_per_tok"),
    ("n_routed_experts", "16", "n_routed_experts is '16': input should be a valid integer"),
])
def test_reap_needs_integer_routing_keys(key, value, said, stats_dir, tmp_path):
    """Without num_experts_per_tok `reap --keep 1` used to write a model transformers refuses;
    a string n_routed_experts said "has 16, config says 16"."""
    src = source_copy(tmp_path)
    config = json.loads((src / "config.json").read_text())
    if value is None:
        del config[key]
    else:
        config[key] = value
    (src / "config.json").write_text(json.dumps(config))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"criterion": "manual", "layers": {
        str(layer): {"keep": [0]} for layer in (1, 2)}}))
    for args in (["--stats", stats_dir, "--keep", "1"], ["--plan", plan]):
        res = cli_inproc("reap", src, tmp_path / "out", *args, "--quiet")
        assert_user_error(res, said)
        assert not (tmp_path / "out" / MANIFEST).exists()


# ------------------------------------------------------------------ bad options

@pytest.mark.parametrize("readers", ["0", "-1"])
def test_readers_must_be_positive(readers, tmp_path):
    res = cli_inproc("int4-to-nvfp4", BUNDLED, tmp_path / "out", "--readers", readers, "--quiet")
    assert_user_error(res, "--readers", code=2)
    assert not (tmp_path / "out").exists()


def test_device_spec_is_checked_by_every_command(tmp_path):
    """`--device foo` used to reach torch.device() and end in a RuntimeError traceback."""
    data = write_input_ids(tmp_path / "d.jsonl", [list(range(16))])
    commands = [
        ["int4-to-nvfp4", BUNDLED, tmp_path / "a"],
        ["run", "int4-to-nvfp4", BUNDLED, tmp_path / "b"],
        ["calibrate", BUNDLED, "--data", data, "-o", tmp_path / "c"],
        ["audit", BUNDLED],
    ]
    for args in commands:
        for spec in ("foo", "cuda:x", "gpu"):
            assert_user_error(cli_inproc(*args, "--device", spec, "--quiet"), "--device", spec,
                              code=2)
    assert not any((tmp_path / d).exists() for d in "abc")


# ------------------------------------------------------------------ no option is silently dropped

@pytest.mark.parametrize(("opts", "stage"), [
    (["--keep", "4"], "prune"),
    (["--prune-ratio", "0.5"], "prune"),
    (["--storage", "pair-bitmask"], "sparsify"),
    (["--group-size", "32"], "sparsify"),
])
def test_run_refuses_options_no_stage_of_the_recipe_takes(opts, stage, tmp_path):
    """`run int4-to-nvfp4 ... --keep 4` used to keep every expert and exit 0."""
    res = cli_inproc("run", "int4-to-nvfp4", BUNDLED, tmp_path / "out", *opts, "--quiet")
    assert_user_error(res, opts[0], "int4-to-nvfp4", f"option of stage {stage}", code=2)
    assert not (tmp_path / "out").exists()


def test_run_refuses_a_setting_of_another_method_of_the_recipes_stage(tmp_path):
    """int4-to-nvfp4 quantizes by rtn: --hessian is its quantize stage's, but gptq's."""
    res = cli_inproc("run", "int4-to-nvfp4", BUNDLED, tmp_path / "out", "--hessian", "source",
                     "--quiet")
    assert_user_error(res, "--hessian serves --method gptq or learned",
                      "this quantize stage's method is rtn", code=2)
    assert not (tmp_path / "out").exists()


def test_options_that_only_act_with_another_are_refused_alone(stats_dir, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"criterion": "manual", "layers": {
        str(layer): {"keep": list(range(0, 16, 2))} for layer in (1, 2)}}))
    cases = [
        (["reap", BUNDLED, tmp_path / "a", "--plan", plan, "--samples", "8"], "--samples",
         "--data"),
        (["reap", BUNDLED, tmp_path / "b", "--plan", plan, "--keep", "6"], "--keep 6",
         "keeps 8"),
        (["reap", BUNDLED, tmp_path / "c", "--stats", stats_dir, "--keep", "8", "--seq-len",
          "64"], "--seq-len", "--data"),
        (["sparsify", BUNDLED, tmp_path / "d", "--seed", "3"], "--seed", "--data"),
        (["sparsify", BUNDLED, tmp_path / "e", "--stats", stats_dir], "--stats", "wanda"),
        (["run", "sparsify", BUNDLED, tmp_path / "f", "--data", plan], "--data", "sparsegpt"),
    ]
    for args, *said in cases:
        res = cli_inproc(*args, "--quiet")
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
        assert all(s in res.output for s in said), (said, res.output)
        assert not (args[2] / MANIFEST).exists()


def test_revision_with_a_local_source_is_an_error(tmp_path):
    """--revision used to be ignored for a local SRC."""
    for args in (["int4-to-nvfp4", BUNDLED, tmp_path / "out"],
                 ["audit", BUNDLED, "--source", BUNDLED]):
        res = cli_inproc(*args, "--revision", "v2", "--quiet")
        assert_user_error(res, "--revision v2", "local directory")
    assert not (tmp_path / "out" / MANIFEST).exists()
    res = cli_inproc("audit", BUNDLED, "--revision", "v2", "--quiet")
    assert res.exit_code == 2 and "--revision applies only with --source" in res.output


@pytest.mark.parametrize(("args", "said"), [
    (["int4-to-nvfp4", "{src}", "{out}", "--resume", "--overwrite"], "not both"),
    (["reap", "{src}", "{out}", "--stats", "{stats}", "--keep", "8", "--prune-ratio", "0.5"],
     "not both"),
    (["int4-to-nvfp4", "{src}", "{out}", "--targets", "bogus"], "unknown --targets"),
    (["run", "int4-to-nvfp4", "{src}", "{out}", "--keep", "8"], "option of stage prune"),
    (["int4-to-nvfp4", "{src}", "{out}", "--trust-complete"], "only with --resume"),
])
def test_options_that_do_not_go_together_are_usage_errors(args, said, stats_dir, tmp_path):
    """docs/commands.md's rule: a usage error exits 2 (these exited 1, or were ignored)."""
    out = tmp_path / "out"
    res = cli_inproc(*(a.format(src=BUNDLED, out=out, stats=stats_dir) for a in args), "--quiet")
    assert_user_error(res, said, code=2)
    assert not out.exists()


def test_api_block_scale_is_checked_before_anything_is_written(tmp_path):
    import kconvert

    with pytest.raises(KconvertError, match="unknown block_scale 'foo'"):
        kconvert.int4_to_nvfp4(str(BUNDLED), str(tmp_path / "out"), block_scale="foo",
                               device="cpu")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("args", "said"), [
    (["sparsify", "--format", "quark-mxfp4"], "--format quark-mxfp4 has no form for block size 16"),
    (["sparsify", "--method", "sparsegpt", "--data", "BAD", "--format", "quark-mxfp4"],
     "--format quark-mxfp4 has no form for block size 16"),
    (["quantize", "--method", "gptq", "--data", "BAD", "--format", "mxfp4-pack-quantized"],
     "--method gptq writes NVFP4"),
])
def test_option_conflicts_are_usage_errors_before_the_data(args, said, tmp_path):
    bad = write_input_ids(tmp_path / "bad.jsonl", [[1, 2, 100000]])
    cmd, *rest = args
    rest = [str(bad) if a == "BAD" else a for a in rest]
    res = cli_inproc(cmd, BUNDLED, tmp_path / "out", *rest, "--device", "cpu", "--quiet")
    assert_user_error(res, said, code=2)
    assert "token id" not in res.output
    assert not (tmp_path / "out").exists()
