"""`kconvert eval` through the command line: its files, K2.5/K2.6 prefixes, bad input, the
committed schema."""

from __future__ import annotations

import json

import pytest

from conftest import BUNDLED, ROOT
from helpers import (
    assert_user_error,
    cli_inproc,
    edit_tensor,
    set_at,
    snapshot,
    source_copy,
    write_input_ids,
)
from kconvert.evaluate.report import EvalReport

TINY_MOE = ROOT / "tests" / "fixtures" / "tiny-moe-trained"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval-data") / "d.jsonl"
    return write_input_ids(path, ([(7 * i + 3 * j) % 250 for j in range(16)] for i in range(3)))


def test_committed_eval_schema_is_current():
    committed = json.loads((ROOT / "manifests" / "eval.schema.json").read_text())
    assert committed == EvalReport.model_json_schema(), (
        "regenerate: python -m kconvert.evaluate.report > manifests/eval.schema.json")


def test_cli_self_eval_in_bf16_writes_json_figure_and_table(data, tmp_path):
    out = tmp_path / "ev"
    res = cli_inproc("eval", TINY_MOE, TINY_MOE, "--data", data, "--seq-len", 16, "--samples", 3,
                     "--batch-size", 2, "--device", "cpu", "-o", out, "--quiet")
    assert res.exit_code == 0, res.output
    assert "KL mean" in res.output and "top-1" in res.output
    report = EvalReport.model_validate_json((out / "eval.json").read_text())
    raw = json.loads((out / "eval.json").read_text())["candidates"][0]
    assert raw["logits"]["kl_mean"] == 0 and raw["logits"]["top1_agreement"] == 1.0
    assert raw["logits"]["nll_source"] == raw["logits"]["nll_candidate"]
    assert {k: v["rel_err"] for k, v in raw["layers"].items()} == dict.fromkeys("0123", 0.0)
    assert report.dtype == "bfloat16" and report.tokens == 48 and report.samples == 3
    assert (out / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(out.glob(".*"))  # no temporary file left behind


def test_k25_and_k26_wrappers_are_their_language_model(fixture_dir, data, tmp_path):
    """k25-int4 and k26-int4 hold k2-int4-kimi's language model under `language_model.`
    (and a vision tower): as candidates of it they are the same model; against the BF16
    master weights the INT4 rounding shows."""
    k2 = fixture_dir("k2-int4-kimi")
    out = tmp_path / "ev"
    res = cli_inproc("eval", k2, fixture_dir("k25-int4"), fixture_dir("k26-int4"),
                     fixture_dir("bf16"), "--data", data, "--seq-len", 16, "--samples", 3,
                     "--dtype", "float32", "--device", "cpu", "-o", out, "--quiet")
    assert res.exit_code == 0, res.output
    k25, k26, bf16 = json.loads((out / "eval.json").read_text())["candidates"]
    for same in (k25, k26):
        assert same["logits"]["kl_mean"] == 0 and same["logits"]["top1_agreement"] == 1
        assert all(e["rel_err"] == 0 for e in same["layers"].values())
    assert bf16["logits"]["kl_mean"] > 0
    assert bf16["layers"]["0"]["rel_err"] == 0  # layer 0 is dense BF16 in both
    assert all(bf16["layers"][str(L)]["rel_err_local"] > 0 for L in (1, 2))  # INT4 experts


@pytest.mark.parametrize(("dims", "said"), [
    ({"hidden": 64}, "hidden_size is 64 but the source's is 128"),
    ({"vocab": 1024}, "vocab_size is 1024 but the source's is 512"),
    ({"moe_layers": 1}, "num_hidden_layers is 2 but the source's is 3"),
])
def test_a_candidate_of_another_shape_is_refused(dims, said, fixture_dir, data, tmp_path):
    cand = fixture_dir("bf16", **dims)
    res = cli_inproc("eval", fixture_dir("bf16"), cand, "--data", data, "--seq-len", 16,
                     "--samples", 3, "--device", "cpu", "-o", tmp_path / "ev", "--quiet")
    assert_user_error(res, said, str(cand))
    assert res.output.count(str(cand)) == 2, res.output  # once in the text, once as the file
    assert not (tmp_path / "ev").exists()


def test_a_candidate_of_a_smaller_vocabulary_is_named_for_it(fixture_dir, tmp_path):
    """Token ids past the candidate's vocabulary used to fail its embedding first, blaming the
    ids; the vocabulary is what differs."""
    src, cand = fixture_dir("bf16", vocab=1024), fixture_dir("bf16")
    data = write_input_ids(tmp_path / "d.jsonl", ([(97 * i + 31 * j) % 1000 for j in range(16)]
                                                  for i in range(2)))
    res = cli_inproc("eval", src, cand, "--data", data, "--seq-len", 16, "--samples", 2,
                     "--device", "cpu", "-o", tmp_path / "ev", "--quiet")
    assert_user_error(res, "vocab_size is 512 but the source's is 1024", str(cand))


def test_empty_data_and_bad_ids_are_refused(fixture_dir, tmp_path):
    src = fixture_dir("bf16")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    assert_user_error(cli_inproc("eval", src, src, "--data", empty), "eval data is empty",
                      str(empty))
    big = write_input_ids(tmp_path / "big.jsonl", [[1, 2, 600]])
    assert_user_error(cli_inproc("eval", src, src, "--data", big, "--device", "cpu", "--quiet"),
                      "line 1: token id 600 is beyond the model's vocabulary (vocab_size 512: "
                      "ids 0..511)", str(big))
    one = write_input_ids(tmp_path / "one.jsonl", [[5]])
    res = cli_inproc("eval", src, src, "--data", one, "--seq-len", 1, "--samples", 1,
                     "--device", "cpu")
    assert_user_error(res, "no position with a next token")


def test_a_candidate_is_required(fixture_dir, data):
    res = cli_inproc("eval", fixture_dir("bf16"), "--data", data)
    assert res.exit_code == 2 and "CANDIDATES" in res.output


def test_python_api_eval_gives_the_cli_report(fixture_dir, data, tmp_path):
    """kconvert.eval returns the numbers `kconvert eval -o` writes, and writes them too."""
    import kconvert

    src, cand = TINY_MOE, fixture_dir("k2-int4-kimi")
    res = cli_inproc("eval", cand, cand, "--data", data, "--seq-len", 8, "--samples", 2, "--device",
                     "cpu", "--dtype", "float32", "-o", tmp_path / "cli", "--quiet")
    assert res.exit_code == 0, res.output
    got = kconvert.eval(str(cand), [str(cand)], str(data), str(tmp_path / "api"), samples=2,
                        seq_len=8, device="cpu", dtype="float32")
    for made in (got.model_dump(mode="json"),
                 json.loads((tmp_path / "api" / "eval.json").read_text())):
        written = json.loads((tmp_path / "cli" / "eval.json").read_text())
        assert made["candidates"] == written["candidates"]
    with pytest.raises(kconvert.KconvertError, match=r"hidden size|vocab|layers"):
        kconvert.eval(str(src), [str(cand)], str(data), samples=2, seq_len=8, device="cpu")


def test_non_finite_hidden_states_name_the_candidate_file_and_tensor(data, tmp_path):
    """A NaN in a candidate's weights: the error says it is the candidate, and names its
    shard and tensor, not only the layer."""
    cand = source_copy(tmp_path)
    name = "model.layers.1.self_attn.o_proj.weight"
    edit_tensor(cand / "model-00002-of-000004.safetensors", name, set_at((0, 0), float("nan")))
    res = cli_inproc("eval", BUNDLED, cand, "--data", data, "--seq-len", 16, "--samples", 3,
                     "--device", "cpu", "--quiet")
    assert_user_error(res, f"candidate {cand}: non-finite hidden states after decoder layer 1",
                      "the source weights hold NaN or Inf",
                      f"(file model-00002-of-000004.safetensors, tensor {name})")


def test_an_error_starts_its_own_line_after_the_progress_bar(data, tmp_path):
    """The bar's line is ended before the error is printed (it used to be left open, and the
    error line was appended to it on a terminal)."""
    cand = source_copy(tmp_path)
    edit_tensor(cand / "model-00002-of-000004.safetensors",
                "model.layers.1.self_attn.o_proj.weight", set_at((0, 0), float("nan")))
    res = cli_inproc("eval", BUNDLED, cand, "--data", data, "--seq-len", 16, "--samples", 3,
                     "--device", "cpu")
    assert_user_error(res, "non-finite hidden states")
    assert "eval:" in res.output  # the bar was drawn
    lines = res.output.split("\n")  # not splitlines: a bar's "\r" redraws the same line
    assert next(line for line in lines if "kconvert: error:" in line).startswith(
        "kconvert: error:"), res.output


def test_an_earlier_report_is_replaced_only_with_overwrite(data, tmp_path):
    out = tmp_path / "ev"
    args = ("eval", TINY_MOE, TINY_MOE, "--data", data, "--seq-len", 8, "--samples", 1,
            "--device", "cpu", "-o", out, "--quiet")
    assert cli_inproc(*args).exit_code == 0
    before = snapshot(out)
    res = cli_inproc(*args)
    assert_user_error(res, "already holds an eval report; pass --overwrite",
                      str(out / "eval.json"))
    assert sum("kconvert: error:" in line for line in res.output.splitlines()) == 1
    assert snapshot(out) == before
    (out / "eval.json").unlink()
    (out / "eval.png").write_bytes(b"an earlier figure")
    assert_user_error(cli_inproc(*args), "pass --overwrite", str(out / "eval.png"))
    res = cli_inproc(*args, "--overwrite")
    assert res.exit_code == 0, res.output
    assert (out / "eval.json").is_file()
    assert (out / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_missing_candidate_is_called_the_candidate(data, tmp_path):
    missing = tmp_path / "nowhere"
    res = cli_inproc("eval", TINY_MOE, missing, "--data", data, "--device", "cpu")
    assert_user_error(res, f"candidate directory does not exist (file {missing})")
    assert "source" not in res.output, res.output
