"""Bad options and bad input reach the user as one clear line and exit 2, never a traceback,
and no option is silently dropped; an internal error keeps its traceback and says it is a bug.

Every command goes through the real click entry point (`kconvert.cli.main`) in-process.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path

import pytest

from conftest import BUNDLED, ROOT
from helpers import assert_user_error, cli_inproc, small_fs, source_copy, write_input_ids
from kconvert.driver.recipes import load_recipe
from kconvert.errors import KconvertError

MANIFEST = "kconvert-manifest.json"
TRAINED = ROOT / "tests" / "fixtures" / "tiny-moe-trained"


@pytest.fixture(scope="module")
def stats_dir(tmp_path_factory) -> Path:
    """Real `kconvert calibrate` statistics of the bundled fixture (for --stats)."""
    root = tmp_path_factory.mktemp("stats")
    data = write_input_ids(root / "ids.jsonl", ([(5 * i + j) % 500 for j in range(16)]
                                                for i in range(4)))
    res = cli_inproc("calibrate", BUNDLED, "--data", data, "-o", root / "stats", "--samples", 4,
                     "--seq-len", 16, "--device", "cpu", "--quiet")
    assert res.exit_code == 0, res.output
    return root / "stats"


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


# ------------------------------------------------------------------ bad input, bad options

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


# ------------------------------------------------------------------ errors the environment causes

@pytest.mark.parametrize(("code", "advice"), [
    (errno.ENOSPC, "free space"),
    (errno.EDQUOT, "quota"),
    (errno.EROFS, "writable"),
    (errno.EACCES, "writable"),
    (errno.ENOENT, "check the path"),
])
def test_os_errors_are_one_line_naming_the_file(code, advice, tmp_path, monkeypatch):
    """A full disk, a read-only or unwritable DST, a vanished file: exit 2, one line that
    names the file and what to do. The OSError is injected where the conversion runs, since
    these tests run as root (chmod cannot make a directory unwritable for root) and cannot
    mount a small file system."""
    import kconvert.driver.convert

    dst = tmp_path / "out"
    shard = dst / "model-00002-of-000004.safetensors"

    def fail(*_args, **_kwargs):
        raise OSError(code, os.strerror(code), str(shard))

    monkeypatch.setattr(kconvert.driver.convert, "convert", fail)
    res = cli_inproc("int4-to-nvfp4", BUNDLED, dst, "--quiet")
    assert_user_error(res, str(shard), os.strerror(code), errno.errorcode[code], advice)
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    if code == errno.ENOSPC:
        assert "--resume" in res.output


def test_full_and_read_only_file_systems_are_messages(tmp_path):
    """Real ENOSPC and EROFS: calibrate's statistics on a 16 KiB tmpfs (safetensors reports the
    full disk as a SafetensorError, not an OSError) and on a read-only one, and a conversion
    into a read-only DST; each command in a process of its own that sees the tmpfs."""
    data = write_input_ids(tmp_path / "d.jsonl", [list(range(16))])
    calibrate = ["calibrate", BUNDLED, "--data", data, "--seq-len", 16, "--samples", 1,
                 "--device", "cpu", "--quiet", "-o"]
    with small_fs(tmp_path / "full", "size=16k") as full:
        res = full.kconvert(*calibrate, full.path / "stats")
        assert_user_error(res, str(full.path / "stats"), "ENOSPC", "free space")
    with small_fs(tmp_path / "ro", "ro,size=16k") as ro:
        res = ro.kconvert(*calibrate, ro.path / "stats")
        assert_user_error(res, str(ro.path / "stats"), "read-only")
        res = ro.kconvert("int4-to-nvfp4", BUNDLED, ro.path / "out", "--quiet")
        assert_user_error(res, str(ro.path / "out"))


def test_os_error_without_a_file_name_names_the_output(tmp_path, monkeypatch):
    """write() on a full disk raises ENOSPC with no file name: the message names DST."""
    import kconvert.driver.convert

    def fail(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(kconvert.driver.convert, "convert", fail)
    res = cli_inproc("int4-to-nvfp4", BUNDLED, tmp_path / "out", "--quiet")
    assert_user_error(res, str(tmp_path / "out"), "free space")


def test_dst_below_a_regular_file_is_a_message(tmp_path):
    """A real OSError (ENOTDIR) from the file system, not an injected one."""
    (tmp_path / "file").write_text("x")
    res = cli_inproc("int4-to-nvfp4", BUNDLED, tmp_path / "file" / "out", "--quiet")
    assert_user_error(res, str(tmp_path / "file"))


def test_ctrl_c_says_how_to_continue(tmp_path, monkeypatch):
    """Ctrl-C used to print click's "Aborted!" alone: a conversion says --resume keeps its
    finished shards, and exits 130 as a shell reports SIGINT."""
    import kconvert.driver.convert

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(kconvert.driver.convert, "convert", interrupted)
    res = cli_inproc("int4-to-nvfp4", BUNDLED, tmp_path / "out", "--quiet")
    assert res.exit_code == 130 and isinstance(res.exception, SystemExit), res.output
    assert "kconvert: interrupted" in res.stderr and "--resume" in res.stderr
    assert "Aborted!" not in res.output and "Traceback" not in res.output


def test_internal_error_keeps_traceback_and_says_it_is_a_bug(tmp_path, monkeypatch):
    import kconvert.driver.convert

    def fail(*_args, **_kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(kconvert.driver.convert, "convert", fail)
    res = cli_inproc("int4-to-nvfp4", BUNDLED, tmp_path / "out", "--quiet")
    assert res.exit_code == 3 and isinstance(res.exception, SystemExit), res.output
    assert "Traceback" in res.stderr and "ZeroDivisionError" in res.stderr
    assert "bug in kconvert" in res.stderr and "report" in res.stderr


def test_kconvert_error_is_one_line_on_stderr(tmp_path, monkeypatch):
    import kconvert.audit.auditor

    def fail(*_args, **_kwargs):
        raise KconvertError("something the user can fix", file="x.json")

    monkeypatch.setattr(kconvert.audit.auditor, "run_audit", fail)
    res = cli_inproc("audit", tmp_path)
    assert_user_error(res)
    assert res.stderr == "kconvert: error: something the user can fix (file x.json)\n"


# ------------------------------------------------------------------ no option is silently dropped

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


def test_api_block_scale_is_checked_before_anything_is_written(tmp_path):
    import kconvert

    with pytest.raises(KconvertError, match="unknown block_scale 'foo'"):
        kconvert.int4_to_nvfp4(str(BUNDLED), str(tmp_path / "out"), block_scale="foo",
                               device="cpu")
    assert not (tmp_path / "out").exists()


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
