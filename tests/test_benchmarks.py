"""The benchmarks' harness (benchmarks/harness.py, benchmarks/child_process.py), on the CPU:
what a result records and how it is named, the child runner measuring real children, the
shared arguments, and `python -m benchmarks` finding, importing and explaining (`NAME --help`)
every bench it lists; no bench takes a setting from the environment."""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import child_process, grouped_experts, harness
from benchmarks.__main__ import BENCHES
from conftest import ROOT

MB = 1 << 20
GIT = ["git", "-c", "user.name=bench", "-c", "user.email=bench@example.invalid"]


def git(tree: Path, *args: str) -> str:
    return subprocess.run([*GIT, *args], cwd=tree, check=True, capture_output=True,
                          text=True).stdout.strip()


def test_the_record_says_where_on_what_and_with_which_command():
    rec = harness.record("unit", gpu=False)
    assert rec["bench"] == "unit"
    assert rec["date"] == time.strftime("%Y-%m-%d")
    assert rec["argv"] == sys.orig_argv
    assert rec["machine"]["cpu_count"] == os.cpu_count()
    assert "torch" in rec["machine"]["packages"]
    assert rec["device"] == {"kind": "cpu", "name": "cpu", "count": 0}
    assert rec["source"]["kconvert_sha256"] == harness.kconvert_sha(ROOT)
    assert rec["source"]["git_commit"] == git(ROOT, "rev-parse", "HEAD")


def test_the_source_hash_follows_the_code_with_and_without_git(tmp_path):
    tree = tmp_path / "tree"
    (tree / "kconvert").mkdir(parents=True)
    (tree / "kconvert" / "a.py").write_text("A = 1\n")
    before = harness.source(tree)
    assert set(before) == {"tree", "kconvert_sha256"}  # no git here: the content hash alone
    assert harness.code_tag(before) == "src" + before["kconvert_sha256"][:8]
    git(tree, "init", "-q")
    git(tree, "add", "-A")
    git(tree, "commit", "-qm", "code")
    clean = harness.source(tree)
    assert clean["git_commit"] == git(tree, "rev-parse", "HEAD")
    assert clean["git_dirty"] is False
    assert harness.code_tag(clean) == clean["git_commit"][:7]
    (tree / "benchmarks" / "results").mkdir(parents=True)
    (tree / "benchmarks" / "results" / "new.json").write_text("{}")  # a result is not code
    assert harness.source(tree)["git_dirty"] is False
    (tree / "kconvert" / "a.py").write_text("A = 2\n")
    dirty = harness.source(tree)
    assert dirty["git_dirty"] is True
    assert dirty["kconvert_sha256"] != clean["kconvert_sha256"]
    assert harness.code_tag(dirty) == clean["git_commit"][:7] + "-dirty"


def test_results_are_named_by_bench_device_date_and_code(tmp_path):
    h100 = {"kind": "cuda", "name": "NVIDIA H100 80GB HBM3", "count": 1}
    assert harness.device_tag(h100) == "H100"
    assert harness.device_tag({**h100, "name": "NVIDIA H200", "count": 2}) == "H200x2"
    assert harness.device_tag({"kind": "cpu", "name": "cpu", "count": 0}) == "cpu"
    rec = {"bench": "convert", "date": "2026-11-27", "device": h100,
           "source": {"git_commit": "3f2a1c9d" + "0" * 32, "git_dirty": True,
                      "kconvert_sha256": "ab" * 8}}
    assert harness.result_name(rec) == "convert_H100_2026-11-27_3f2a1c9-dirty.json"
    assert harness.result_name(rec, "full") == "convert_H100_2026-11-27_3f2a1c9-dirty_full.json"
    assert harness.result_path(rec) == harness.OUT_DIR / harness.result_name(rec)
    named = tmp_path / "convert_H100_2026-11-27_3f2a1c9-dirty.json"
    assert harness.result_path(rec, out_dir=tmp_path) == named
    assert harness.result_path(rec, "given.json", out_dir=tmp_path) == Path("given.json")


def test_the_shared_arguments_and_tiny_defaults():
    """--root, --out-dir, --keep-page-cache and --deadline-s where a bench asks for them;
    --tiny replaces the defaults it names, and what the command line gives still wins."""
    ap = harness.arguments("unit", "doc", root="/scratch", results=True, page_cache=True,
                           deadline_s=540)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--sizes", type=harness.comma_ints, default=[8, 64])
    tiny = {"seqs": 4, "root": Path("/tiny")}
    a = harness.parse(ap, [], tiny)
    assert (a.root, a.out_dir, a.keep_page_cache, a.deadline_s, a.seqs, a.sizes) == (
        Path("/scratch"), harness.OUT_DIR, False, 540, 256, [8, 64])
    a = harness.parse(ap, ["--tiny", "--root", "/r", "--sizes", "2,3"], tiny)
    assert (a.root, a.seqs, a.sizes) == (Path("/r"), 4, [2, 3])
    bare = harness.arguments("unit", "doc").parse_args([])
    assert not {"root", "out_dir", "keep_page_cache", "deadline_s"} & set(vars(bare))
    assert harness.drop_page_cache(keep=True) == "--keep-page-cache"


def test_the_child_runner_measures_the_childs_own_peak_rss():
    """A parent that holds 300 MiB: a bare fork+exec child's wait4 peak reads the parent's
    300 MiB (Linux carries it across exec); through the runner a child that holds nothing
    reads tens of MiB, and one that holds 200 MiB reads 200 MiB more."""
    held = bytearray(300 * MB)
    held[::4096] = b"\1" * len(held[::4096])
    naive = subprocess.Popen([sys.executable, "-c", "pass"])
    assert os.wait4(naive.pid, 0)[2].ru_maxrss * 1024 > 300 * MB  # the pollution
    small = child_process.run_child([sys.executable, "-c", "pass"])
    big = child_process.run_child([sys.executable, "-c", "x = bytearray(200 << 20); "
                             "x[::4096] = b'\\1' * len(x[::4096])"])
    del held
    assert small.rc == big.rc == 0
    assert small.peak_rss_bytes < 100 * MB
    assert 190 * MB < big.peak_rss_bytes - small.peak_rss_bytes < 260 * MB


def test_a_childs_own_report_agrees_with_the_runners_peak_rss():
    """A child that reports (child_process.report) its own peak RSS: it is the runner's figure."""
    code = ("from benchmarks.child_process import report; x = bytearray(150 << 20); "
            "x[::4096] = b'\\1' * len(x[::4096]); report({'held_mib': 150})")
    c = child_process.run_child([sys.executable, "-c", code], env=child_process.child_env())
    assert c.rc == 0 and c.result["held_mib"] == 150
    assert c.peak_gpu_reserved_bytes is None  # it never used CUDA
    assert abs(c.result["vmhwm_gb"] - c.peak_rss_gb) < 0.01
    assert c.peak_rss_bytes > 150 * MB


def test_the_child_runner_returns_status_output_and_result_line():
    code = ("import json, sys, time; print('hello'); print('warn', file=sys.stderr); "
            "time.sleep(0.3); print('RESULT ' + json.dumps({'n': 3})); sys.exit(3)")
    echoed: list[str] = []
    c = child_process.run_child([sys.executable, "-c", code], echo=echoed.append)
    assert c.rc == 3 and not c.timed_out
    assert c.stdout.splitlines() == ["hello", 'RESULT {"n": 3}']
    assert c.stderr == "warn\n"
    assert c.result == {"n": 3}
    assert sorted(echoed) == ["hello\n", "warn\n"]  # every line but the result
    assert c.lines[-1][0] - c.lines[0][0] > 0.25  # stamped as they came
    assert 0.3 < c.wall_s < 30
    assert 0 < c.lines[0][0] <= c.lines[-1][0] <= c.wall_s  # from the command's own start
    merged = child_process.run_child([sys.executable, "-c", code], merge=True)
    assert merged.stderr == "" and "warn" in merged.stdout
    signalled = child_process.run_child([sys.executable, "-c",
                                   "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"])
    assert signalled.rc == -15
    missing = child_process.run_child(["/nonexistent/command"])
    assert missing.rc not in (0, None) and "nonexistent" in missing.stderr


def test_the_child_runner_kills_the_whole_command_at_its_timeout(tmp_path):
    pid_file = tmp_path / "pid"
    c = child_process.run_child(["sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], timeout=1)
    assert c.timed_out and c.rc is None and c.peak_rss_bytes is None
    assert c.wall_s < 30
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # gone, or a zombie no one has reaped yet
        stat = Path(f"/proc/{grandchild}/stat")
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] in "ZX":
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the command's own child {grandchild} still runs after the timeout")


def test_the_child_runner_hands_the_commands_pid_to_its_watcher():
    seen: list[int] = []

    class Own:
        def __init__(self, pid: int) -> None:
            seen.append(pid)
            deadline = time.monotonic() + 10  # the pid may not have exec'd the command yet
            while b"sleep" not in (cmdline := Path(f"/proc/{pid}/cmdline").read_bytes()):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            self.cmdline = cmdline

        def finish(self) -> dict:
            return {"cmdline": self.cmdline}

    c = child_process.run_child([sys.executable, "-c", "import time; time.sleep(2)"], watch=Own)
    assert b"time.sleep(2)" in c.watched["cmdline"]  # the command's pid, not the launcher's
    assert len(seen) == 1


def test_the_timer_sums_spans_and_times_each_call():
    timer = harness.Timer(deadline_s=60)
    for _ in range(2):
        with timer.span("nap"):
            time.sleep(0.05)
    assert timer("sum", sum, [1, 2]) == 3
    assert 0.1 <= timer.seconds["nap"] < 5
    times, out = timer.each(3, time.sleep, 0.01)
    assert len(times) == 3 and all(t >= 0.01 for t in times) and out is None
    assert not timer.late() and timer.late(need_s=120)


def test_a_bench_run_on_the_cpu_writes_its_result_with_the_record(tmp_path):
    """grouped_experts --tiny end to end: the loop, grouped_mm and padded bmm agree, and the
    file it writes carries the record."""
    out = tmp_path / "grouped.json"
    grouped_experts.main(["--tiny", str(out)])
    res = json.loads(out.read_text())
    assert res["record"]["bench"] == "grouped_experts"
    assert res["record"]["device"]["kind"] == "cpu"
    assert res["loop_s"] > 0 and res["grouped_s"] > 0
    assert res["grouped_max_abs_diff"] < 1e-4 and res["bmm_max_abs_diff"] < 1e-4


def test_every_bench_is_listed_imports_and_has_a_main():
    """A module of the package with a main() is a bench `python -m benchmarks` must list;
    each listed one imports (kconvert's internals they call included)."""
    package = ROOT / "benchmarks"
    with_main = {".".join(p.relative_to(ROOT).with_suffix("").parts)
                 for p in package.rglob("*.py") if p.name != "__main__.py"
                 and any(isinstance(n, ast.FunctionDef) and n.name == "main"
                         for n in ast.parse(p.read_text()).body)}
    assert with_main == set(BENCHES.values())
    for module in BENCHES.values():
        assert callable(importlib.import_module(module).main), module
    listing = subprocess.run([sys.executable, "-m", "benchmarks"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
    assert all(f"  {name} " in listing for name in BENCHES)


def test_every_bench_explains_its_arguments(capsys):
    """`python -m benchmarks NAME --help` prints NAME's usage and options and runs nothing."""
    for name, module in BENCHES.items():
        with pytest.raises(SystemExit) as done:
            importlib.import_module(module).main(["--help"])
        assert done.value.code == 0, name
        out = capsys.readouterr().out
        assert out.startswith(f"usage: python -m benchmarks {name} "), (name, out[:200])
        assert "-h, --help" in out, name
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "sparsify", "--help"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "--seqs SEQS" in proc.stdout, proc.stderr


# What the benches may still read from the environment: where CUDA and Python look, the
# external anchor script's place, and Triton's own interpreter switch; no setting of a bench.
ENVIRONMENT = {"CUDA_VISIBLE_DEVICES", "PYTHONPATH", "ANCHOR_SCRIPT", "TRITON_INTERPRET"}
READ_ENV = re.compile(r"""(?:environ\.get\(|environ\[|getenv\()\s*["'](\w+)["']""")


def test_no_bench_takes_a_setting_from_the_environment(tmp_path):
    read = {m for p in (ROOT / "benchmarks").rglob("*.py")
            for m in READ_ENV.findall(p.read_text())}
    assert "CUDA_VISIBLE_DEVICES" in read  # the pattern finds what is there
    assert read <= ENVIRONMENT, read - ENVIRONMENT
    planted = tmp_path / "bench.py"
    planted.write_text('seqs = int(os.environ.get("SEQS", 256))\nroot = os.getenv("ROOT")\n')
    assert set(READ_ENV.findall(planted.read_text())) == {"SEQS", "ROOT"}


def test_the_trace_summary_counts_each_second_each_stage_and_the_disk():
    """benchmarks.trace's summary of known spans: union and busy seconds, each second's share
    of every stage (reads summed over reader threads), the disk's rates from its sectors."""
    from benchmarks import inprocess, trace

    assert inprocess.intervals_union([(0, 2), (1, 3), (5, 6)]) == 4
    assert trace.covered([(0.5, 2.5), (0, 1)], 1, 2) == 1
    t0 = 100.0
    events = [("phase", {"name": "execute", "start": 100.2, "end": 103.0, "thread": "MainThread"}),
              ("read", {"start": 100.5, "end": 101.5, "thread": "kconvert-read_0"}),
              ("read", {"start": 100.5, "end": 101.0, "thread": "kconvert-read_1"}),
              ("compute", {"start": 101.5, "end": 102.5, "kind": "transform",
                           "thread": "MainThread"}),
              ("compute", {"start": 102.5, "end": 102.6, "kind": "transform",
                           "thread": "MainThread"}),
              ("compute", {"start": 102.6, "end": 102.8, "kind": "transform",
                           "thread": "MainThread"}),
              ("shard-done", {"shard": "a"})]
    gb = 1e9 / trace.SECTOR
    disk = [(100.0, 0, 0), (101.0, int(2 * gb), 0), (102.0, int(3 * gb), int(gb))]
    got = trace.summarise(events, disk, t0, 103.0)
    assert got["phases"] == {"execute": [0.2, 3.0]}
    assert got["stages"]["read@kconvert-read"] == {"n": 2, "busy_s": 1.5, "union_s": 1.0}
    assert got["stages"]["compute@MainThread"]["n"] == 3
    assert got["first_transform_s"] == 1.0 and got["median_transform_s"] == 0.15
    cols = got["seconds_cols"]
    first, second = (dict(zip(cols, row, strict=True)) for row in got["seconds"][:2])
    assert first["disk_read_gb_s"] == 2.0 and first["disk_write_gb_s"] == 0
    assert second["disk_read_gb_s"] == 1.0 and second["disk_write_gb_s"] == 1.0
    assert first["read@kconvert-read"] == 1.0  # 0.5 + 0.5 on two reader threads
    assert second["read@kconvert-read"] == 0.5 and second["compute@MainThread"] == 0.5
    assert len(got["seconds"]) == 4


def test_the_trace_child_times_a_real_conversion(tmp_path):
    """`trace _child` on the bundled checkpoint: the command's phases in order, every item's
    read, compute and write seen, a row per second of its wall."""
    from conftest import BUNDLED

    proc = subprocess.run([sys.executable, "-m", "benchmarks", "trace", "_child", str(BUNDLED),
                           str(tmp_path / "out"), "cpu"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(next(ln for ln in proc.stdout.splitlines()
                          if ln.startswith("RESULT "))[len("RESULT "):])
    assert got["torch_imported_before"] is False  # the command's imports are inside its wall
    phases = got["phases"]
    assert phases["open_source"][0] <= phases["build_work_plan"][0] <= phases["execute"][0]
    assert phases["execute"][0] < phases["execute"][1]
    assert phases["execute"][1] <= got["wall"]
    items = got["stages"]["compute@MainThread"]["n"]
    assert items > 1
    assert got["stages"]["read@kconvert-read"]["n"] == items
    assert got["stages"]["write@kconvert-writer"]["n"] == items
    # a row per started second; the wall is rounded to 0.01 s, so one row fewer at an edge
    assert int(got["wall"]) <= len(got["seconds"]) <= int(got["wall"]) + 1
    assert (tmp_path / "out" / "kconvert-manifest.json").is_file()


def test_the_trace_runs_a_given_checkpoint_with_more_options(tmp_path):
    """--src converts that checkpoint (no set is built) and --options reach every run's
    command: a valid block-scale rule runs, a wrong one fails as the command fails."""
    from benchmarks import trace
    from conftest import BUNDLED

    for rule in ("amax", "nonsense"):
        out = tmp_path / rule
        trace.main([f"{rule}={ROOT},cpu", "--src", str(BUNDLED), "--options",
                    f"--block-scale {rule}", "--keep-page-cache", "--root", str(tmp_path),
                    "--out-dir", str(out)])
        (written,) = out.glob("trace_*.json")
        got = json.loads(written.read_text())["results"][0]
        assert got["src"] == str(BUNDLED) and got["options"] == ["--block-scale", rule]
        if rule == "amax":
            assert got["rc"] == 0 and got["stages"]["compute@MainThread"]["n"] > 1
        else:
            assert "error" in got and "nonsense" in got["error"]
    assert not (tmp_path / "src").exists()


def test_obs_precision_part_on_a_cpu():
    """`obs --parts precision` on the CPU, which has no TF32: each TF32 row is fp32's to the
    last code, and bf16's operands move codes and the error, so the part tells them apart."""
    from benchmarks.obs_precision import precision_part

    got = precision_part(torch.device("cpu"), (256, 128), 200, 2)
    rows = got["runs"]
    assert len(rows) == 2 * 2 * 2 * 3 and got["held_out_tokens"] == 25
    for r in rows:
        exact = r["loop"] != "bf16"
        assert (r["codes_differ"] == 0 and r["held_err_vs_fp32"] == 1.0) is exact, r
        assert r["u_finite"] and r["held_err_vs_rtn"] > 0


def test_learned_batches_on_a_cpu_finds_no_expert_that_depends_on_its_batch(tmp_path):
    """On a CPU an expert's learned values do not depend on the experts trained beside it nor
    on the batch's count (on an H200 the count changes them, which is why a GPU pads every
    batch to one count: docs/obs.md)."""
    out = tmp_path / "lb.json"
    from benchmarks import learned_batches

    learned_batches.main(["--tiny", str(out)])
    res = json.loads(out.read_text())
    per_expert = 3 * 32 * 16  # the --tiny experts' gate, up and down values
    compared = {"A again against A": 16, "B against A": 12, "C against A": 4,
                "D against C": 8, "E against A": 12}
    for method in ("nvfp4", "p48"):
        assert {k: v["values"] for k, v in res[method].items() if k != "seconds"} == {
            k: n * per_expert for k, n in compared.items()}
        assert all(res[method][k]["differing"] == [] for k in compared), res[method]
    assert res["router_rows"]["differing"] == {
        "32x24": {"first rows of a call": [0] * 6, "last rows of a call of 16384": 0}}
