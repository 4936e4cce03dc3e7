"""What a new user meets first: a fast `--help`, calibration that runs on the bundled fixture
from text and chat data offline, and consistent defaults, messages and file modes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import fields

import click
import pytest

from conftest import BUNDLED, ROOT
from helpers import cli_inproc, write_jsonl
from kconvert.cli import main
from kconvert.common import options
from kconvert.version import __version__

HELP_BOUND_S = 3.0  # generous: ~0.1 s measured on the 2-core test machine


def test_help_is_fast_and_imports_no_torch():
    """`kconvert --help` took ~10 s importing torch and compressed-tensors."""
    cmd = [sys.executable, "-X", "importtime", "-m", "kconvert.cli", "--help"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr
    assert "Commands:" in proc.stdout
    imported = {line.split("|")[-1].strip().split(".")[0]
                for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "click" in imported  # the import log is there and lists what was imported
    assert not imported & {"torch", "compressed_tensors", "transformers", "numba"}, imported
    assert wall < HELP_BOUND_S, f"--help took {wall:.2f} s"


def test_short_help_and_version():
    assert cli_inproc("-h").output == cli_inproc("--help").output
    res = cli_inproc("run", "-h")
    assert res.exit_code == 0 and "RECIPE SRC DST" in res.output
    res = cli_inproc("--version")
    assert res.exit_code == 0 and __version__ in res.output


def test_cli_choice_lists_are_the_implementation_lists():
    """cli.py cannot import the torch modules that own these lists; it must agree with them."""
    from kconvert.audit import auditor
    from kconvert.cli import base as cli
    from kconvert.cli import conversion_options
    from kconvert.formats import OUTPUT_CODECS, DenseCodec
    from kconvert.stages import sparsify

    assert tuple(OUTPUT_CODECS) == cli.FORMATS
    assert conversion_options.STORAGES == options.SPARSIFY_STORAGES
    assert cli.AUDIT_CHUNK_MB << 20 == auditor.CHUNK
    choices = {p.name: p.type.choices for p in main.commands["run"].params
               + main.commands["dequant"].params if isinstance(p.type, click.Choice)}
    assert tuple(map(int, choices["group_size"])) == sparsify.GROUP_SIZES
    assert set(choices["dtype"]) == set(DenseCodec.OUTPUT_DTYPES)


CONVERSION_COMMANDS = ("int4-to-nvfp4", "quantize", "dequant", "reap", "sparsify", "densify")


def test_cli_options_are_the_stage_kinds_options():
    """The command line declares its options without importing the stages (torch): by name,
    each conversion command's options are run controls or options of its recipe's stages (none
    is dropped), and every stage kind's command-line-only input option is offered."""
    from kconvert.driver.convert import RunControl
    from kconvert.driver.recipes import load_recipe
    from kconvert.stages import KINDS

    run_controls = {f.name for f in fields(RunControl)} | {"revision", "as_json"}
    offered = set()
    for name in (*CONVERSION_COMMANDS, "run"):
        command = main.commands[name]
        options = ({p.name for p in command.params if isinstance(p, click.Option)}
                   - {"help", "verbose"})
        assert run_controls <= options, name
        kinds = KINDS.values() if name == "run" else [KINDS[k] for k in load_recipe(name).kinds]
        takes = {o for kind in kinds for o in kind.options}
        assert options - run_controls <= takes, (name, options - run_controls - takes)
        offered |= options - run_controls
    assert {o for kind in KINDS.values() for o in kind.input_options} <= offered


# ------------------------------------------------------------------ calibration on the fixture

def test_calibrate_text_and_messages_on_the_bundled_fixture_offline(tmp_path):
    """The bundled fixture's tokenizer used to fail ("no attribute 'DeepseekV3Config'"), so
    `text`/`messages` lines could not be tried. Offline, with an empty Hugging Face cache."""
    text = write_jsonl(tmp_path / "text.jsonl", [
        {"text": "Kimi converts a trillion parameters, shard by shard."},
        {"text": "Ünïcödé and digits 0123456789 encode as bytes."}])
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [
        {"role": "user", "content": "What is NVFP4?"},
        {"role": "assistant", "content": "A 4-bit float with FP8 block scales."}]}])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf-home")}
    runs = [["calibrate", str(BUNDLED), "--data", str(data), "-o", str(tmp_path / data.stem),
             "--samples", "2", "--seq-len", "16", "--device", "cpu", "--quiet"]
            for data in (text, chat)]
    # One fresh process for both runs (the imports cost seconds), through the real entry point.
    driver = ("import json, sys\nfrom kconvert.cli import main\n"
              "sys.exit(max(main(a, standalone_mode=False) or 0 for a in json.loads(sys.argv[1])))")
    proc = subprocess.run([sys.executable, "-c", driver, json.dumps(runs)], capture_output=True,
                          text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    for data in (text, chat):
        meta = json.loads((tmp_path / data.stem / "stats.json").read_text())
        assert meta["tokens"] == 2 * 16  # the lines hold more than 2 x 16 tokens together


@pytest.mark.parametrize("variant", ["k2-int4-kimi", "k25-int4", "bf16"])
def test_every_fixture_variant_has_a_tokenizer_that_matches_its_config(variant, fixture_dir):
    from transformers import AutoTokenizer

    src = fixture_dir(variant)
    tok = AutoTokenizer.from_pretrained(str(src), trust_remote_code=True)
    config = json.loads((src / "config.json").read_text())
    assert (tok.bos_token_id, tok.eos_token_id) == (config["bos_token_id"],
                                                      config["eos_token_id"])
    text = "héllo, wörld"
    assert tok(text)["input_ids"] == list(text.encode())  # byte-level: id == byte
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
    ids = chat if isinstance(chat, list) else chat["input_ids"]
    user = tok.convert_tokens_to_ids("<|im_user|>")
    assert ids == [user, *b"hi", config["eos_token_id"]]  # <|im_user|>hi<|im_end|>
    assert max(tok.get_vocab().values()) < config.get("text_config", config)["vocab_size"]


def test_calibrate_messages_modes_and_summary(tmp_path):
    """"1 sequences" was printed; stats.safetensors was written 0600 beside 0644 JSON files."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": list(range(16))}])
    out = tmp_path / "stats"
    res = cli_inproc("calibrate", BUNDLED, "--data", data, "-o", out, "--samples", "2", "--seq-len",
                     "16", "--device", "cpu", "--allow-short-data")
    assert res.exit_code == 0, res.output
    assert ("kconvert: warning: " + str(data) + " holds 16 tokens in 1 line(s): 1 full "
            "sequence(s) of 16 tokens, fewer than --samples 2 x --seq-len 16") in res.output
    assert "wrote " in res.output and "16 tokens, 2 MoE layers" in res.output
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes == dict.fromkeys(["stats.safetensors", "stats.json", "act_stats.json"],
                                  0o666 & ~umask)


# ------------------------------------------------------------------ --samples defaults

def test_samples_default_is_per_use_and_documented(tmp_path):
    """SparseGPT through `run` used 1024 sequences by default, through `sparsify` 128."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": list(range(i, i + 16))}
                                         for i in range(2)])
    dst = tmp_path / "out"
    args = ["run", "sparsify", BUNDLED, dst, "--method", "sparsegpt", "--data", data,
            "--seq-len", "16", "--device", "cpu", "--quiet"]
    res = cli_inproc(*args)  # the 2 sequences here cannot fill the default, which it names
    assert res.exit_code == 1 and "fewer than --samples 128 x --seq-len 16" in res.output
    res = cli_inproc(*args, "--allow-short-data")
    assert res.exit_code == 0, res.output
    manifest = json.loads((dst / "kconvert-manifest.json").read_text())
    used = manifest["options"]["sparsify"]["data"]
    assert (used["samples"], used["tokens"]) == (2, 32)  # what was used, not asked

    def help_of(command: str) -> str:
        return " ".join(cli_inproc(command, "--help").output.split())

    assert "With --data: sequences. [default: 128;" in help_of("sparsify")
    assert "With --data: sequences. [default: 1024;" in help_of("reap")
    assert ("[default: 1024 for a prune stage's REAP calibration, 128 for SparseGPT and GPTQ]"
            in help_of("run"))
    assert "With --data: sequences. [default: 128;" in help_of("quantize")


def test_the_calibration_data_script_feeds_the_bundled_checkpoints(tmp_path):
    """No calibration data shipped and no command made any (the trained tiny MoE has no
    tokenizer): scripts/make_calibration_data.py writes token ids both bundled kinds read."""
    data = tmp_path / "calib.jsonl"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_calibration_data.py"),
                           str(data), "--samples", "2", "--seq-len", "16"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(ln)["input_ids"] for ln in data.read_text().splitlines()]
    assert len(rows) == 2 and all(len(r) == 16 for r in rows)
    for src in (BUNDLED, ROOT / "tests" / "fixtures" / "tiny-moe-trained"):
        res = cli_inproc("calibrate", src, "--data", data, "-o", tmp_path / src.name,
                         "--samples", "2", "--seq-len", "16", "--device", "cpu", "--quiet")
        assert res.exit_code == 0, res.output
