"""Helpers shared by the tests: the command line in this process (click's runner) and in a
subprocess, a conversion in-process exactly as the command line calls it, snapshots of a
directory, edits of a source checkpoint, safetensors headers read straight from the bytes
(independently of kconvert), and pieces of the tiny model computed as the tests need them (a
MoE block from the plan's routing, an OBS problem, a built decoder layer, logits compared, a
repair). A real small file system (a tmpfs) is tests/tmpfs.py's."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from click.testing import CliRunner, Result
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import BUNDLED
from kconvert.cli import main
from kconvert.driver.convert import RunControl, convert
from kconvert.driver.recipes import load_recipe

CLI = [sys.executable, "-m", "kconvert.cli"]


INDEX = "model.safetensors.index.json"


MANIFEST = "kconvert-manifest.json"


# Shards of the bundled tiny fixture (layer 0 dense, layers 1-2 MoE with 16 INT4 experts).
S1, S2, S3, S4 = (f"model-0000{i}-of-000004.safetensors" for i in (1, 2, 3, 4))


def cli_inproc(*args) -> Result:
    """`kconvert ARGS` through its click entry point in this process (each argument str()-ed):
    exit_code, output (stdout and stderr as a terminal shows them), stdout, stderr. Every
    command turns its errors into an exit status; an exception that escapes that is a bug of
    the command line and is raised here, not read as exit status 1."""
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def cli_subprocess(*args, timeout: float = 300, env: dict[str, str] | None = None
                   ) -> subprocess.CompletedProcess:
    """`kconvert ARGS` as a shell runs it: a fresh interpreter (environment `env`, else this
    one's), the real exit status."""
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def assert_user_error(res: Result | subprocess.CompletedProcess, *said: str, code: int = 1
                      ) -> None:
    """A command refused as the user's error, from cli_inproc or a subprocess: exit `code` (1
    bad input, 2 click's usage error) through the command line's own exit, no traceback, and
    the message says each of `said`."""
    if isinstance(res, subprocess.CompletedProcess):
        status, output = res.returncode, res.stdout + res.stderr
    else:
        assert isinstance(res.exception, SystemExit), res.exception
        status, output = res.exit_code, res.output
    assert status == code, (status, output)
    assert "Traceback" not in output, output
    for words in said:
        assert words in output, (words, output)


def audit_json(ckpt: Path, *args) -> tuple[int, dict]:
    """`kconvert audit CKPT --json ARGS` on the CPU through cli_inproc: the exit status (0 every
    check passed, 1 some check failed; any other fails the test) and the JSON report."""
    res = cli_inproc("audit", ckpt, "--json", "--quiet", "--device", "cpu", *args)
    assert res.exit_code in (0, 1), res.output
    return res.exit_code, json.loads(res.stdout)


def assert_audit_passes(ckpt: Path, *args) -> dict:
    """audit_json of a checkpoint that must pass every check: its report, else its failures
    as the test's message."""
    code, report = audit_json(ckpt, *args)
    assert code == 0 and report["passed"], report["failures"]
    return report


def run_inproc(recipe: str, src: Path, dst: Path, block_scale: str | None = None,
               targets: str | None = None, **run) -> object:
    """convert() as the CLI calls it: the stage settings it gives (None: the recipe's)."""
    settings = {"block_scale": block_scale, "targets": targets}
    run = {"quiet": True, "device": "cpu", **run}
    return convert(str(src), str(dst), load_recipe(recipe), settings, RunControl(**run),
                   echo=lambda *a, **k: None)


def write_jsonl(path: Path, rows: Iterable[dict]) -> Path:
    """A JSON-lines file at `path`, one row a line (calibration and eval data)."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_input_ids(path: Path, rows: Iterable[Sequence[int] | torch.Tensor]) -> Path:
    """Token-id data at `path` as calibrate, eval and --data read it: one {"input_ids": [...]}
    a line."""
    return write_jsonl(path, ({"input_ids": r.tolist() if isinstance(r, torch.Tensor) else list(r)}
                              for r in rows))


def calibrated(src: Path, root: Path, stride: int) -> Path:
    """Real `kconvert calibrate` statistics of `src` in root/stats, on 4 sequences of 16 token
    ids ((stride * i + j) % 500), for --stats."""
    data = write_input_ids(root / "ids.jsonl", ([(stride * i + j) % 500 for j in range(16)]
                                                for i in range(4)))
    res = cli_inproc("calibrate", src, "--data", data, "-o", root / "stats", "--samples", 4,
                     "--seq-len", 16, "--device", "cpu", "--quiet")
    assert res.exit_code == 0, res.output
    return root / "stats"


def source_copy(tmp_path: Path) -> Path:
    """A copy of the bundled fixture at tmp_path / "src", to edit or to watch for writes."""
    return Path(shutil.copytree(BUNDLED, tmp_path / "src"))


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under root (hidden ones too): files -> sha256, directories -> 'dir'."""
    out = {}
    if not root.exists():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = "dir"
        for f in filenames:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
    return out


def file_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file, by name. Copies: a tensor safetensors returns is
    backed by the mapped file, so it would change with an edit of the file in place, or fault
    once the file is rewritten shorter."""
    with safe_open(str(path), "pt") as fh:
        return {k: fh.get_tensor(k).clone() for k in fh.keys()}


def shard_files(d: Path) -> list[Path]:
    """The safetensors files of the checkpoint in directory d: those its index names, else
    its one model.safetensors."""
    index = d / INDEX
    if index.is_file():
        return [d / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [d / "model.safetensors"]


def checkpoint_tensors(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in directory d, by name (file_tensors of its shards)."""
    return {name: t for path in shard_files(d) for name, t in file_tensors(path).items()}


def edit_tensor(path: Path, name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Tensor `name` of the safetensors file at `path` replaced by fn(it), the rest kept."""
    tensors = file_tensors(path)
    tensors[name] = fn(tensors[name]).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


def set_at(index: tuple, value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """For edit_tensor: the element at `index` set to `value`."""
    def fn(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[index] = value
        return t
    return fn


def add_at(index: tuple, delta: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """For edit_tensor: `delta` added to the element at `index` (in the tensor's dtype)."""
    def fn(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[index] += delta
        return t
    return fn


def edit_json(path: Path, fn: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data, indent=2))


COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path, src: Path, files: list[str], repo_id: str = "kimi/tiny") -> str:
    """A cache dir holding `repo_id` at COMMIT with `files` of `src`, as huggingface_hub lays
    it out (blobs linked from the snapshot, refs/main)."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name in files:
        blob = repo / "blobs" / hashlib.sha256(name.encode()).hexdigest()
        shutil.copyfile(src / name, blob)
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        if not (snapshot / name).is_symlink():
            (snapshot / name).symlink_to(blob)
    return str(root)


def st_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header as written (`__metadata__` included) and the offset where
    its data starts, parsed straight from the bytes."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(n)), 8 + n


def data_bytes(path: Path) -> int:
    """Tensor bytes of a safetensors file: its size less the 8-byte length and the header."""
    return path.stat().st_size - st_header(path)[1]


def kimi_moe_block(x: torch.Tensor, t: dict[str, torch.Tensor], layer: int, cfg: dict
             ) -> torch.Tensor:
    """A pruned Kimi MoE block on x [T, hidden] from the tensors `t` on disk, written here
    from the plan's description of Kimi's routing: sigmoid scores, the bias for selection only,
    top-k weights renormalised and times routed_scaling_factor, plus the shared expert."""
    p = f"model.layers.{layer}.mlp."
    w, bias = t[p + "gate.weight"].float(), t[p + "gate.e_score_correction_bias"]
    scores = torch.sigmoid(x @ w.T)
    chosen = torch.topk(scores + bias, cfg["num_experts_per_tok"], dim=-1).indices
    g = scores.gather(1, chosen)
    g = g / g.sum(-1, keepdim=True) * cfg["routed_scaling_factor"]

    def mlp(prefix: str, h: torch.Tensor) -> torch.Tensor:
        gate, up, down = (t[f"{prefix}{n}_proj.weight"].float() for n in ("gate", "up", "down"))
        return (torch.nn.functional.silu(h @ gate.T) * (h @ up.T)) @ down.T

    out = mlp(p + "shared_experts.", x)
    for i in range(x.shape[0]):
        for j in range(chosen.shape[1]):
            e = int(chosen[i, j])
            out[i] += g[i, j] * mlp(f"{p}experts.{e}.", x[i:i + 1])[0]
    return out


def assert_moe_blocks_route_as_written(ckpt: Path, tokens: int, tol: float) -> None:
    """transformers loads the dense checkpoint `ckpt` (kconvert.testing's strict loader), and
    each of its MoE blocks computes on `tokens` random inputs what kimi_moe_block computes from
    the tensors on disk, to `tol` (absolute and relative)."""
    from kconvert.testing.tiny_moe import load_kimi_checkpoint

    cfg = json.loads((ckpt / "config.json").read_text())
    model, tensors = load_kimi_checkpoint(ckpt), checkpoint_tensors(ckpt)
    x = torch.randn(tokens, cfg["hidden_size"], generator=torch.Generator().manual_seed(0))
    for layer in range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"]):
        with torch.no_grad():
            got = model.model.layers[layer].mlp(x[None])[0]
        torch.testing.assert_close(got, kimi_moe_block(x, tensors, layer, cfg), atol=tol,
                                   rtol=tol, msg=lambda m, layer=layer: f"layer {layer}: {m}")


def obs_problem(b: int, m: int, k: int, tokens: int, seed: int, arithmetic: str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An OBS test problem: weights [b, m, k], a Hessian per matrix from correlated inputs with
    uneven column scales (one column no token touched), and each matrix's NVFP4 global scale
    [b]."""
    from kconvert.formats import nvfp4

    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k ** 0.5 + torch.eye(k)
    x = torch.randn(b, tokens, k, generator=g) @ mix * torch.rand(k, generator=g) * 3
    h = x.transpose(1, 2) @ x
    h[0, :, 3] = h[0, 3, :] = 0.0
    w = torch.randn(b, m, k, generator=g) * k ** -0.5
    return w, h, nvfp4.tensor_scale(w.abs().amax((1, 2)), arithmetic)


def eval_logits(src: Path, candidates: list[Path], ids: torch.Tensor) -> list:
    """kconvert.evaluate of `candidates` against `src` on the CPU in fp32 (batches of 2): each
    candidate's logits comparison (its KL mean, top-1, ...)."""
    from kconvert.evaluate.run import evaluate
    from kconvert.io.checkpoint import open_checkpoint

    opened = [open_checkpoint(str(p)) for p in (src, *candidates)]
    try:
        report = evaluate(opened[0], opened[1:], ids, "cpu", 2, dtype=torch.float32)
    finally:
        for ckpt in opened:
            ckpt.close()
    return [c.logits for c in report.candidates]


class BuiltLayer(NamedTuple):
    ckpt: object  # the open checkpoint
    tensors: dict  # the layer's tensors by name (calibrate.load.tensors_by_layer)
    raw: object  # calibrate.load.read_layer's result
    loaded: object  # calibrate.load.build_layer's result


@contextlib.contextmanager
def built_layer(path: Path, index: int, dtype: torch.dtype = torch.bfloat16,
                **build) -> Iterator[BuiltLayer]:
    """Decoder layer `index` of the checkpoint at `path` as the calibration forward builds it,
    on the CPU in `dtype`; `build`: build_layer's keywords (e.g. grams=)."""
    from kconvert.calibrate.forward import model_config
    from kconvert.calibrate.load import build_layer, read_layer, tensors_by_layer
    from kconvert.calibrate.moe import ForwardContext
    from kconvert.calibrate.mtp import decoder_tensors
    from kconvert.io.checkpoint import open_checkpoint

    ckpt = open_checkpoint(str(path))
    try:
        cfg = model_config(ckpt)
        tensors = tensors_by_layer(ckpt, cfg.num_hidden_layers)[index]
        cpu = torch.device("cpu")
        raw = read_layer(ckpt, cfg, index, decoder_tensors(tensors), dtype, cpu)
        yield BuiltLayer(ckpt, tensors, raw, build_layer(raw, cfg, ForwardContext(), cpu, dtype,
                                                         stats=False, **build))
    finally:
        ckpt.close()


def compensated_on_trained(settings, src: Path) -> tuple:
    """(the repair, its plan, the prune stage) of REAP with `settings` (a RepairSettings) on
    the trained tiny MoE `src`, calibrated on 8 of its corpus's 32-byte windows (seed 3), fp32
    on the CPU: what `reap --data` makes, without the conversion."""
    from kconvert.calibrate.run import measure_stats
    from kconvert.io.checkpoint import open_checkpoint
    from kconvert.pruning.reap import plan_from_scores, scores_of
    from kconvert.pruning.repair import RouterRepair, with_repair
    from kconvert.stages.prune import prune_stage
    from kconvert.testing.tiny_moe import corpus_ids, windows

    ids = windows(corpus_ids("train"), 8, 32, torch.Generator().manual_seed(3))
    ckpt = open_checkpoint(str(src))
    try:
        fixer = RouterRepair(ckpt, ids, settings, torch.device("cpu"), dtype=torch.float32)
        stats = measure_stats(ckpt, ids, "cpu", 4, dtype=torch.float32, on_weights=fixer)
        plan = with_repair(plan_from_scores(scores_of(stats), settings.keep, "reap"), fixer)
        stage = prune_stage(plan, ckpt, fixer.rows, fixer.matrices)
    finally:
        ckpt.close()
    return fixer, plan, stage
