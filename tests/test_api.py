"""The Python API: the same bytes as the command line for every command, the command line's
messages as exceptions, a light `import kconvert`, and docs/python-api.md's example, run."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

import kconvert
from conftest import ROOT
from helpers import audit_json, cli_inproc, write_input_ids
from kconvert.errors import KconvertError, UsageError

API_DOC = ROOT / "docs" / "python-api.md"


def shards(root) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.glob("*.safetensors"))}


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(json.dumps({"layers": {"1": {"keep": [0, 2, 4, 6, 8, 10]},
                                           "2": {"keep": [1, 3, 5, 7, 9, 11]}}}))
    return str(path)


@pytest.mark.parametrize("command,variant,options", [
    ("int4-to-nvfp4", "k2-int4-kimi", {"block_scale": "amax", "format": "modelopt"}),
    ("quantize", "bf16", {"targets": "experts,shared_experts"}),
    ("dequant", "k2-int4-kimi", {"dtype": "F32"}),
    ("reap", "k2-int4-kimi", {"plan": "PLAN"}),
    ("sparsify", "k2-int4-kimi", {"storage": "pair-bitmask", "group_size": 16}),
])
def test_api_writes_the_cli_bytes(command, variant, options, fixture_dir, tmp_path, plan):
    src = fixture_dir(variant)
    options = {k: (plan if v == "PLAN" else v) for k, v in options.items()}
    flags = [a for k, v in options.items() for a in (f"--{k.replace('_', '-')}", v)]
    res = cli_inproc(command, src, tmp_path / "cli", *flags, "--device", "cpu", "--quiet")
    assert res.exit_code == 0, res.output
    function = getattr(kconvert, command.replace("-", "_"))
    result = function(str(src), str(tmp_path / "api"), device="cpu", **options)
    assert shards(tmp_path / "api") == shards(tmp_path / "cli")
    cli_manifest = json.loads((tmp_path / "cli" / "kconvert-manifest.json").read_text())
    assert result.summary == cli_manifest["summary"]
    assert result.output == tmp_path / "api" and result.manifest.tensors.keys() == \
        cli_manifest["tensors"].keys()
    if command == "sparsify":  # densify and run_recipe on what sparsify wrote
        res = cli_inproc("densify", tmp_path / "api", tmp_path / "cli-dense", "--device", "cpu",
                         "--quiet")
        assert res.exit_code == 0, res.output
        kconvert.densify(str(tmp_path / "api"), str(tmp_path / "api-dense"), device="cpu")
        assert shards(tmp_path / "api-dense") == shards(tmp_path / "cli-dense")
        kconvert.run_recipe("densify", str(tmp_path / "api"), str(tmp_path / "run-dense"),
                            device="cpu")
        assert shards(tmp_path / "run-dense") == shards(tmp_path / "cli-dense")
        report = kconvert.audit(str(tmp_path / "api-dense"), device="cpu")
        code, cli_report = audit_json(tmp_path / "api-dense")
        assert report.passed and code == 0
        assert cli_report == json.loads(json.dumps(report.to_json(), default=str))


def test_calibrate_api_is_the_cli(fixture_dir, tmp_path):
    data = write_input_ids(tmp_path / "data.jsonl", ([(7 * i + j) % 500 for j in range(16)]
                                                     for i in range(4)))
    src = fixture_dir("k2-int4-kimi")
    res = cli_inproc("calibrate", src, "--data", data, "-o", tmp_path / "cli", "--samples", 4,
                     "--seq-len", 16, "--device", "cpu", "--dtype", "float32", "--quiet")
    assert res.exit_code == 0, res.output
    stats = kconvert.calibrate(str(src), str(data), str(tmp_path / "api"), samples=4,
                               seq_len=16, device="cpu", dtype="float32")
    assert stats.moe_layers
    for name in ("stats.safetensors", "act_stats.json"):
        assert (tmp_path / "api" / name).read_bytes() == (tmp_path / "cli" / name).read_bytes()


def test_errors_are_the_cli_messages(fixture_dir, tmp_path):
    src = str(fixture_dir("k2-int4-kimi"))
    cases = [
        (lambda: kconvert.reap(src, str(tmp_path / "a"), keep=8), UsageError,
         ["reap", src, str(tmp_path / "a"), "--keep", "8"]),
        (lambda: kconvert.run_recipe("dequant", src, str(tmp_path / "b"), block_scale="amax"),
         UsageError, ["run", "dequant", src, str(tmp_path / "b"), "--block-scale", "amax"]),
        (lambda: kconvert.int4_to_nvfp4(src + "-missing", str(tmp_path / "c")), KconvertError,
         ["int4-to-nvfp4", src + "-missing", str(tmp_path / "c")]),
    ]
    for call, kind, argv in cases:
        with pytest.raises(kind) as caught:
            call()
        res = cli_inproc(*argv)
        code = 2 if kind is UsageError else 1  # click's usage error; bad input
        assert res.exit_code == code and str(caught.value) in res.output, (res.output, caught)
    with pytest.raises(UsageError, match="unknown option 'blocksize'"):
        kconvert.int4_to_nvfp4(src, str(tmp_path / "d"), blocksize="amax")


def test_import_kconvert_is_light():
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", "import kconvert; "
                           "kconvert.KconvertError; kconvert.__version__"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    imported = {line.split("|")[-1].strip().split(".")[0]
                for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "kconvert" in imported and not imported & {"torch", "click", "safetensors"}
    assert set(kconvert.API) <= set(dir(kconvert.api))
    for name in kconvert.API:
        assert getattr(kconvert, name).__doc__


def test_the_documented_example_runs(tmp_path, monkeypatch, capsys):
    code = re.search(r"```python\n(.*?)```", API_DOC.read_text(), re.S).group(1)
    monkeypatch.chdir(ROOT)
    exec(compile(code.replace("/tmp/", f"{tmp_path}/"), "docs/python-api.md", "exec"), {})
    out = capsys.readouterr().out
    assert "routed_experts" in out and "wrote" in out
    assert "--keep applies only with --data or --stats or --plan" in out


def test_api_keywords_are_the_command_lines_stage_options():
    """The conversions' keywords (kconvert.api.OPTIONS, made from the stage kinds and their
    plug-ins' declarations) are exactly `kconvert run`'s stage options: none is listed by hand,
    so none goes missing (the methods' settings included)."""
    from kconvert.api import OPTIONS
    from kconvert.cli import main
    from kconvert.cli.conversion_options import RUN_CONTROL_OPTIONS

    given = {p.name for p in main.commands["run"].params if p.name not in ("recipe", "src", "dst")}
    stage_options = given - set(RUN_CONTROL_OPTIONS) - {"as_json", "verbose"}
    assert set(OPTIONS) - {"dtype"} == stage_options  # dequant's --dtype: its own command's
    assert {"activations", "allow_short_data", "hessian", "input_scale", "steps",
            "tokens"} <= set(OPTIONS)
