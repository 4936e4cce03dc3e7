"""`kconvert audit CKPT [--source SRC] [--plan PLAN]`: prove a checkpoint is what it claims to be.

Checks come in groups; every failure names the layer, the tensor (or file) and what differs.

* structure (CKPT alone): index == shards; every shard header valid; no file left by an
  unfinished kconvert write; config consistent with the tensors (kconvert.structure, the checks
  every conversion runs on its source).
* quant-config: every `quantization_config` agrees with the tensors (kconvert.structure).
* scales: fused sets (gate/up, q_a/kv_a) share one NVFP4 global (and input) scale; no NaN/Inf
  anywhere in floating tensors; no negative or NaN scales, FP8 scales in range; router bias F32.
* manifest (DST/kconvert-manifest.json, if present): every tensor's xxh3-128 hash, the tensor
  and file lists (an unlisted *.safetensors fails, any other unlisted file warns), non-weight
  file hashes, recorded fused-set scales and per-layer counts, and the
  recorded parameters (p48, keep count) hold in the data.
* source (--source): router rows and e_score_correction_bias entries equal the source rows the
  plan chose (or, without a plan, the mapping is inferred by matching router rows, and the report
  says so); kept experts byte-identical when their format is unchanged, else their decode within
  the recorded (or default) error of the source decode; every other tensor byte-identical;
  non-weight files identical; config unchanged except what pruning/quantization must change;
  nothing in the source unaccounted for.
* p48 (only when the manifest or config says so): every 8-element chunk (4 bytes of packed NVFP4)
  has at most 2 nonzero pairs and pruned pairs are stored as 0x00.

Data is streamed: tensors are read with pread in pieces of at most `chunk` bytes (into a fixed
pool of reused buffers) or a module's compressed parameters at a time, a few pieces ahead, so
memory does not grow with shard or tensor size: about 2 x (PREFETCH + 1) x chunk for pieces,
plus a few modules' parameters and row blocks of their decodes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import queue
import re
import sys
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from kconvert.checks.findings import Checks, Finding, short, text_config
from kconvert.checks.quant_config import check_quant_config, quant_blocks
from kconvert.checks.structure import check_config, check_layers
from kconvert.devices import pick_device
from kconvert.errors import KconvertError
from kconvert.formats import detect_codec, nvfp4
from kconvert.formats.base import Codec, is_linear
from kconvert.formats.dense import FLOAT_DTYPES, DenseCodec
from kconvert.formats.fp8_block import Fp8BlockCodec
from kconvert.formats.nvfp4_modelopt import ModeloptNvfp4Codec
from kconvert.formats.nvfp4_pair_bitmask import Nvfp4PairBitmaskCodec
from kconvert.io.checkpoint import GENERATED_FILES, INDEX, SINGLE, SKIPPED_DIRS, open_checkpoint
from kconvert.io.files import hash_file
from kconvert.io.readahead import read_ahead
from kconvert.io.shards import ShardReader, TensorInfo
from kconvert.manifest import MANIFEST, Manifest, read_manifest
from kconvert.model.names import Role, TensorName, parse_name
from kconvert.pruning.plan import PrunePlan, load_plan, parse_plan
from kconvert.sparsity.p48 import check_packed
from kconvert.stages.prune import PLAN_FILE

CHUNK = 8 << 20  # default bytes per streamed piece of a plain tensor
PREFETCH = 3  # pieces read ahead
FINITE_BLOCK = 1 << 20  # elements per NaN/Inf test (bounds its temporaries)
# Exponent-all-ones masks: a float is NaN/Inf iff (bits & mask) == mask.
NONFINITE_MASK = {"BF16": (torch.int16, 0x7F80), "F16": (torch.int16, 0x7C00),
                  "F32": (torch.int32, 0x7F800000), "F64": (torch.int64, 0x7FF0000000000000),
                  "F8_E4M3": (torch.uint8, 0x7F)}
MAX_STORED_PER_CHECK = 200  # findings kept per check (all are counted)
# Without a manifest that records the error, a re-encoded module must decode within this
# relative MSE of the source decode. 4-bit formats give 0.005-0.02 on real weights; any mix-up
# of experts gives ~2 (two independent weights of equal norm).
DEFAULT_REL_MSE = 0.05
# A module decoded to BF16 must equal the source decode to BF16 rounding (2^-9 relative).
DENSE_REL_TOL = 2.0**-8
# Config keys that pruning / quantization legitimately change.
CHANGEABLE_CONFIG_KEYS = {"quantization_config", "n_routed_experts", "n_group", "topk_group",
                          "torch_dtype", "dtype", "transformers_version"}
SCALE_POSITIVE = {"weight_global_scale", "input_global_scale", "weight_scale_2", "input_scale",
                  "weight_scale_inv"}
QUANT_PARAMS = {"weight_packed", "weight_scale", "weight_shape", "weight_global_scale",
                "weight_scale_2", "weight_scale_inv", "weight_zero_point", "input_scale",
                "input_global_scale", "weight_sparse_packed", "weight_sparse_mask"}
# Names kconvert writes under before a rename: one left behind is a write that never finished.
TEMP_SUFFIXES = (".kconvert-tmp", ".tmp", ".partial")
P48_NAMES = ("p48", "paired-4:8", "paired48")
GROUPS = ("structure", "quant-config", "scales", "manifest", "source", "p48")


# ============================================================================ report


@dataclass
class LayerRow:
    experts: str = "-"
    ids: str = "-"
    router: str = "-"
    scales: str = "-"
    max_rel_mse: float | None = None
    max_abs_err: float | None = None
    compared: int = 0


class Report(Checks):
    def __init__(self, ckpt: str, source: str | None, plan: str | None):
        super().__init__()
        self.ckpt, self.source, self.plan = ckpt, source, plan
        self.per_check: Counter = Counter()  # (group, check, severity) -> findings
        self.notes: list[str] = []
        self.layers: dict[int, LayerRow] = {}
        self.mapping: dict[str, dict] = {}

    @property
    def passed(self) -> bool:
        return not any(f.severity == "fail" for f in self.findings) and not any(
            self.failed.values())

    def row(self, layer: int) -> LayerRow:
        return self.layers.setdefault(layer, LayerRow())

    def keep(self, finding: Finding) -> None:
        key = (finding.group, finding.check, finding.severity)
        self.per_check[key] += 1
        if self.per_check[key] <= MAX_STORED_PER_CHECK:
            self.findings.append(finding)

    # -------------------------------------------------------------- output

    def to_json(self) -> dict:
        fails = [f for f in self.findings if f.severity == "fail"]
        warns = [f for f in self.findings if f.severity == "warn"]
        omitted = {f"{g}/{c}/{s}": n - MAX_STORED_PER_CHECK
                   for (g, c, s), n in self.per_check.items() if n > MAX_STORED_PER_CHECK}
        return {
            "ckpt": self.ckpt, "source": self.source, "plan": self.plan,
            "passed": self.passed,
            "checks": {g: {"run": self.counts[g], "failed": self.failed[g]} for g in GROUPS},
            "failures": [_finding_json(f) for f in fails],
            "warnings": [_finding_json(f) for f in warns],
            "omitted": omitted,
            "notes": self.notes,
            "mapping": self.mapping,
            "layers": {str(k): vars(v) for k, v in sorted(self.layers.items())},
        }

    def render(self) -> str:
        out = [f"kconvert audit {self.ckpt}"
               + (f" --source {self.source}" if self.source else "")
               + (f" --plan {self.plan}" if self.plan else "")]
        head = (f"{'layer':>5}  {'experts':>8}  {'ids':<14} {'router/bias':<22} {'scales':<8} "
                f"{'max rel-MSE':>11}  {'max |err|':>9}  status")
        out += ["", head, "-" * len(head)]
        bad_layers = Counter(f.layer for f in self.findings if f.severity == "fail")
        for layer, r in sorted(self.layers.items()):
            rel = f"{r.max_rel_mse:.2e}" if r.max_rel_mse is not None else "-"
            err = f"{r.max_abs_err:.2e}" if r.max_abs_err is not None else "-"
            status = f"FAIL ({bad_layers[layer]})" if bad_layers[layer] else "ok"
            out.append(f"{layer:>5}  {r.experts:>8}  {r.ids:<14} {r.router:<22} {r.scales:<8} "
                       f"{rel:>11}  {err:>9}  {status}")
        if bad_layers[None]:
            out.append(f"{'other':>5}  {'':>8}  {'':<14} {'':<22} {'':<8} {'':>11}  {'':>9}  "
                       f"FAIL ({bad_layers[None]})")
        out += ["", "checks:"]
        for g in GROUPS:
            if self.counts[g] or self.failed[g]:
                mark = "ok" if not self.failed[g] else f"{self.failed[g]} FAILED"
                out.append(f"  {g:<13} {self.counts[g]:>9} run   {mark}")
            else:
                out.append(f"  {g:<13} {'-':>9}       not applicable")
        if self.notes:
            out += ["", "notes:"] + [f"  - {n}" for n in self.notes]
        for severity, title in (("fail", "failures"), ("warn", "warnings")):
            items = [f for f in self.findings if f.severity == severity]
            if not items:
                continue
            out += ["", f"{title}:"]
            shown: Counter = Counter()
            for f in items:
                shown[(f.group, f.check)] += 1
                if shown[(f.group, f.check)] <= 10:
                    out.append("  " + f.line())
            for g, c in shown:
                total = self.per_check[(g, c, severity)]
                if total > 10:
                    out.append(f"  ... and {total - 10} more [{g}/{c}] (see --json)")
        n_fail = sum(n for (_, _, s), n in self.per_check.items() if s == "fail")
        out += ["", "PASS: every check passed" if self.passed else f"FAIL: {n_fail} failure(s)"]
        return "\n".join(out)


def _finding_json(f: Finding) -> dict:
    return {k: v for k, v in vars(f).items() if v is not None}


# ============================================================================ opening


@dataclass
class Tree:
    """A checkpoint directory: config, tensors (as the index resolves them) and readers."""

    root: Path
    config: dict
    tensors: dict[str, TensorInfo]
    readers: dict[Path, ShardReader]
    shards: list[str]  # relative names of the shards the tensors come from
    index: dict | None = None

    @property
    def text_config(self) -> dict:
        return text_config(self.config)

    def read(self, info: TensorInfo) -> torch.Tensor:
        return self.readers[info.file].read(info)

    def read_bytes(self, info: TensorInfo, offset: int, length: int) -> torch.Tensor:
        buf = torch.empty(length, dtype=torch.uint8)
        self.readers[info.file].read_into(info, buf, offset)
        return buf

    def other_files(self) -> list[str]:
        """Files that are neither shards nor regenerated (tokenizer, templates, *.py, ...)."""
        shards = set(self.shards) | {p.name for p in self.root.glob("*.safetensors")}
        out = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
            for fn in sorted(filenames):
                rel = os.path.relpath(os.path.join(dirpath, fn), self.root)
                if rel not in shards and rel not in GENERATED_FILES:
                    out.append(rel)
        return out

    def close(self) -> None:
        for r in self.readers.values():
            r.close()


def open_tree(path: Path, report: Report) -> Tree | None:
    """Open CKPT tolerantly: every inconsistency becomes a finding instead of an exception."""
    S = "structure"
    config: dict = {}
    cfg_path = path / "config.json"
    if report.check(S, cfg_path.is_file(), "config", "no config.json", file="config.json"):
        try:
            config = json.loads(cfg_path.read_text())
            report.check(S, isinstance(config, dict), "config", "config.json is not an object",
                         file="config.json")
        except json.JSONDecodeError as exc:
            report.add(S, "config", f"config.json is not valid JSON: {exc}", file="config.json")
        if not isinstance(config, dict):
            config = {}

    index_path = path / INDEX
    index, weight_map = None, None
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
            report.ran(S)
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            report.add(S, "index", f"malformed index: {exc}", file=INDEX)
            return None
        files = sorted(set(weight_map.values()))
    elif (path / SINGLE).is_file():
        files = [SINGLE]
    else:
        report.add(S, "index", f"no {INDEX} and no {SINGLE}", file=str(path))
        return None

    readers: dict[Path, ShardReader] = {}
    contents: dict[str, dict[str, TensorInfo]] = {}
    for fn in files:
        p = path / fn
        if not report.check(S, p.is_file(), "index", "the index names a shard that does not "
                            "exist", file=fn):
            continue
        try:
            reader = ShardReader(p)
        except KconvertError as exc:
            report.add(S, "shard-header", str(exc), file=fn)
            continue
        report.ran(S)
        readers[p] = reader
        contents[fn] = reader.tensors

    tensors: dict[str, TensorInfo] = {}
    where: dict[str, list[str]] = defaultdict(list)
    for fn, infos in contents.items():
        for name, info in infos.items():
            where[name].append(fn)
            tensors.setdefault(name, info)
    for name, fns in where.items():
        report.check(S, len(fns) == 1, "duplicate", f"tensor is stored in {len(fns)} shards: "
                     f"{fns}", tensor=name)
    if weight_map is not None:
        for name, fn in sorted(weight_map.items()):
            if fn not in contents:
                continue  # already reported: shard missing or unreadable
            held = where.get(name, [])
            if fn in held:
                report.ran(S)
            elif held:
                report.add(S, "index", f"stale index entry: the index maps it to {fn} but it "
                           f"is in {held[0]}", tensor=name, file=fn)
            else:
                report.add(S, "index", f"stale index entry: the index maps it to {fn}, which "
                           "does not hold it (tensor missing from its shard)", tensor=name, file=fn)
        for name, fns in sorted(where.items()):
            if name not in weight_map:
                report.add(S, "index", f"shard {fns[0]} holds a tensor the index does not list",
                           tensor=name, file=fns[0])
        total = (index.get("metadata") or {}).get("total_size")
        actual = sum(i.nbytes for i in tensors.values())
        if total is not None and total != actual:
            report.warn(S, "index", f"metadata.total_size is {total} but the tensors hold "
                        f"{actual} bytes", file=INDEX)
        for p in sorted(path.glob("*.safetensors")):
            if p.name not in contents and p.name not in files:
                report.warn(S, "index", "shard file not referenced by the index (loaders "
                            "ignore it)", file=p.name)
    return Tree(path, config, tensors, readers, sorted(contents), index)


def tree_of_source(src: str, revision: str | None) -> Tree:
    ckpt = open_checkpoint(src, revision)  # strict: a source must be consistent
    readers = {r.path: r for r in ckpt.readers.values()}
    return Tree(ckpt.root, ckpt.config, ckpt.tensors, readers, ckpt.shards)


# ============================================================================ modules


@dataclass
class Module:
    """A linear's parameter set (or any module whose params match a codec)."""

    name: str
    tn: TensorName
    params: dict[str, TensorInfo]
    codec: type[Codec]
    shape: tuple[int, ...]

    @property
    def primary(self) -> TensorInfo:
        return self.params[self.codec.params[0]]

    @property
    def linear(self) -> bool:
        return is_linear(self)

    @property
    def first_start(self) -> tuple[str, int]:
        info = min(self.params.values(), key=lambda i: (str(i.file), i.start))
        return str(info.file), info.start


def build_modules(tree: Tree, report: Report | None) -> dict[str, Module]:
    """Group tensors into modules by codec. Router tensors and unmatched ones stay plain."""
    by_module: dict[str, dict[str, TensorInfo]] = defaultdict(dict)
    for name, info in tree.tensors.items():
        tn = parse_name(name)
        if tn.param and tn.param != "bias" and tn.role not in (Role.ROUTER_WEIGHT,
                                                               Role.ROUTER_BIAS):
            by_module[tn.module][tn.param] = info
    modules = {}
    for mod, params in by_module.items():
        codec = detect_codec(params)
        if codec is None:
            if report is not None and QUANT_PARAMS & set(params):
                first = params[sorted(params)[0]]
                report.add("structure", "format", f"parameters {sorted(params)} match no "
                           "known format (missing or extra scale tensors)", tensor=first.name)
            continue
        shape_value = None
        if "weight_shape" in params:
            info = params["weight_shape"]
            value = tree.read(info)
            shape_value = tuple(int(v) for v in value.reshape(-1).tolist())
        try:
            shape = tuple(codec.logical_shape(params, shape_value))
        except KconvertError as exc:
            if report is not None:
                report.add("structure", "shape", str(exc), tensor=exc.tensor)
            continue
        tn = parse_name(params[codec.params[0]].name)
        modules[mod] = Module(mod, tn, params, codec, shape)
    return modules


# ============================================================================ p48


def _p48_spec(options: object) -> dict | None:
    """The stage options that declare p48 in a manifest's options, if any.

    Contract for the sparsify stage: record `{"pattern": "p48", "targets": [roles]}` (any key
    or nesting is found; a string value "p48" / "paired-4:8" anywhere also counts).
    """
    if isinstance(options, dict):
        if options.get("pattern") in P48_NAMES or options.get("p48") is True:
            return options
        for v in options.values():
            found = _p48_spec(v)
            if found is not None:
                return found if isinstance(v, dict) else options
    elif isinstance(options, list):
        for v in options:
            found = _p48_spec(v)
            if found is not None:
                return found
    elif isinstance(options, str) and options in P48_NAMES:
        return {}
    return None


# ============================================================================ config helpers


def _flatten(d: object, prefix: str = "") -> dict[str, object]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, object] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and k != "quantization_config":
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


def _hexfloat(t: torch.Tensor) -> str:
    return repr(float(t.reshape(-1)[0])) if t.numel() else "[]"


# ============================================================================ the auditor


@dataclass
class Unit:
    """One piece of streamed work, read by the prefetch pool and checked in the main thread."""

    key: tuple[str, int]
    nbytes: int
    info: TensorInfo | None = None  # a plain-tensor chunk ...
    offset: int = 0
    length: int = 0
    src_info: TensorInfo | None = None
    module: Module | None = None  # ... or a whole module
    src_module: Module | None = None
    mode: str | None = None  # "bytes" | "decode" | None (no source comparison)


@dataclass
class ModuleCompare:
    rel_mse: float
    max_abs: float
    bad_elems: int


class Auditor:
    def __init__(self, ckpt: Path, source: str | None, plan_path: str | None, device: str,
                 revision: str | None, progress: bool, max_rel_mse: float | None,
                 chunk: int = CHUNK):
        self.chunk = max(8, chunk // 8 * 8)
        self.pool = _BufferPool(self.chunk, 2 * (PREFETCH + 1))
        self.report = Report(str(ckpt), source, plan_path)
        self.ckpt_path, self.source_arg, self.plan_path = ckpt, source, plan_path
        self.device = pick_device(device)
        self.revision, self.progress, self.max_rel_mse = revision, progress, max_rel_mse
        self.tree: Tree | None = None
        self.src: Tree | None = None
        self.manifest: Manifest | None = None
        self.plan: PrunePlan | None = None
        self.modules: dict[str, Module] = {}
        self.src_modules: dict[str, Module] = {}
        self.module_of: dict[str, Module] = {}
        self.mapping: dict[int, list[int | None]] = {}  # MoE layer -> new id -> source id
        self.moe_layers: list[int] = []
        self.used_src: set[str] = set()
        self.has_counterpart: set[str] = set()
        self.hashers: dict[str, tuple[xxhash.xxh3_128, int]] = {}
        self.fused: dict[str, dict[str, tuple[str, torch.Tensor, torch.Tensor | None]]] = (
            defaultdict(dict))
        self.p48: dict | None = None
        self.p48_roles: set[str] = {Role.ROUTED_EXPERT.value}
        self.scale_bad: Counter = Counter()  # layer -> scale failures

    # -------------------------------------------------------------- driver

    def run(self) -> Report:
        r = self.report
        if not self.ckpt_path.is_dir():
            raise KconvertError("CKPT is not a directory", file=str(self.ckpt_path))
        if self.plan_path:
            self.plan = load_plan(self.plan_path)
        if self.source_arg:
            self.src = tree_of_source(self.source_arg, self.revision)
            self.src_modules = build_modules(self.src, None)
        self.tree = open_tree(self.ckpt_path, r)
        try:
            if self.tree is None:
                return r
            self._load_manifest()
            self._load_plan_file()
            self.modules = build_modules(self.tree, r)
            for m in self.modules.values():
                for info in m.params.values():
                    self.module_of[info.name] = m
            modules = list(self.modules.values())
            check_config(r, self.tree.config)
            layers = check_layers(r, self.tree.config, self.tree.tensors, modules)
            self.moe_layers = layers.moe
            for layer, columns in layers.rows.items():
                vars(r.row(layer)).update(columns)
            check_quant_config(r, self.tree.config, modules, self.tree.root)
            self._check_stray_files()
            if self.manifest is not None:
                self._check_manifest_static()
            if self.src is not None:
                self._map_experts()
                self._check_config_vs_source()
            elif self.plan is not None:
                self._check_plan_alone()
            self._stream()
            if self.p48 is not None and not r.counts["p48"]:
                r.add("p48", "pattern", f"the manifest declares p48 for {sorted(self.p48_roles)} "
                      "but no NVFP4 module of those roles was found to check", file=MANIFEST)
            self._check_fused_sets()
            if self.manifest is not None:
                self._check_manifest_after()
            if self.src is not None:
                self._check_accounting()
                self._check_other_files_vs_source()
            self._fill_table()
        finally:
            if self.tree is not None:
                self.tree.close()
            if self.src is not None:
                self.src.close()
        return r

    # -------------------------------------------------------------- manifest

    def _load_manifest(self) -> None:
        r, M = self.report, "manifest"
        path = self.tree.root / MANIFEST
        if (self.tree.root / ".kconvert").exists():
            r.add("structure", "incomplete", "a .kconvert/ run-state folder is present: a "
                  "kconvert run into this directory did not finish", file=".kconvert")
        if not path.is_file():
            r.notes.append("no kconvert-manifest.json: manifest checks skipped")
            return
        try:
            self.manifest = read_manifest(path)
            r.ran(M)
        except (ValueError, OSError) as exc:
            r.add(M, "manifest", f"unreadable or invalid manifest: {exc}", file=MANIFEST)
            return
        self.p48 = _p48_spec(self.manifest.options)
        if self.p48 is not None:
            targets = self.p48.get("targets")
            if isinstance(targets, list) and targets:
                self.p48_roles = {str(t) for t in targets}
            r.notes.append(f"manifest declares p48 sparsity: checking roles "
                           f"{sorted(self.p48_roles)}")
        if self.plan is None:
            embedded = _find_plan(self.manifest.options)
            if isinstance(embedded, dict):
                self.plan = parse_plan(embedded, f"{MANIFEST} options")
                r.notes.append("using the plan recorded in the manifest")

    def _load_plan_file(self) -> None:
        """The plan a pruning run wrote into CKPT (reap-plan.json), unless --plan was given."""
        path = self.tree.root / PLAN_FILE
        if self.plan is not None or not path.is_file():
            return
        if PLAN_FILE not in self._generated():
            # Carried over from an earlier pruning: it maps THAT run's source, not this one's.
            self.report.notes.append(f"CKPT/{PLAN_FILE} was not written by the run that made "
                                     "CKPT (not in the manifest's generated files): not used; "
                                     "pass --plan to use it")
            return
        try:
            self.plan = load_plan(path)
            self.report.notes.append(f"using the plan in CKPT/{PLAN_FILE}")
        except KconvertError as exc:
            self.report.add("structure", "plan", str(exc), file=PLAN_FILE)

    def _generated(self) -> dict[str, str]:
        """Files the run that made CKPT generated (manifest's generated_files)."""
        if self.manifest is None:
            return {}
        return getattr(self.manifest, "generated_files", None) or {}

    def _check_stray_files(self) -> None:
        """Files nothing accounts for: a kconvert temporary (a write that never finished)
        fails; with a manifest, an unlisted *.safetensors fails (a loader may read its
        tensors) and any other unlisted file warns."""
        r, man, tree = self.report, self.manifest, self.tree
        carried = man.non_weight_files if man is not None else {}
        listed = {*carried, *self._generated(), *(man.files if man is not None else ())}
        indexed = {*tree.shards, *((tree.index or {}).get("weight_map") or {}).values()}
        unindexed = [p.name for p in sorted(tree.root.glob("*.safetensors"))
                     if p.name not in indexed]
        for rel in unindexed + tree.other_files():
            if rel in carried:
                continue
            if rel.endswith(TEMP_SUFFIXES):
                r.add("structure", "incomplete", "a kconvert temporary file: a write into this "
                      "directory did not finish", file=rel)
            elif man is None or rel in listed:
                continue
            elif rel.endswith(".safetensors"):
                r.add("manifest", "files", "a .safetensors file no manifest entry accounts for "
                      "(a loader may read its tensors)", file=rel)
            else:
                r.warn("manifest", "non-weight", "file not in the manifest (added after "
                       "conversion?)", file=rel)

    def _check_manifest_static(self) -> None:
        r, M, man = self.report, "manifest", self.manifest
        have, listed = set(self.tree.tensors), set(man.tensors)
        for name in sorted(listed - have):
            r.add(M, "tensors", "listed in the manifest but not in the checkpoint", tensor=name)
        for name in sorted(have - listed):
            r.add(M, "tensors", "in the checkpoint but not in the manifest", tensor=name)
        for name in sorted(have & listed):
            info, entry = self.tree.tensors[name], man.tensors[name]
            rel = os.path.relpath(info.file, self.tree.root)
            r.check(M, (entry.file, entry.dtype, tuple(entry.shape))
                    == (rel, info.dtype, tuple(info.shape)), "tensors",
                    f"manifest says {entry.dtype}{entry.shape} in {entry.file}, checkpoint has "
                    f"{info.dtype}{list(info.shape)} in {rel}", tensor=name)
        per_file = Counter(os.path.relpath(i.file, self.tree.root)
                           for i in self.tree.tensors.values())
        for fn in sorted(set(man.files) | set(self.tree.shards)):
            entry = man.files.get(fn)
            if entry is None:
                r.add(M, "files", "shard not listed in the manifest", file=fn)
                continue
            path = self.tree.root / fn
            if not r.check(M, path.is_file(), "files", "manifest lists a shard that is not here",
                           file=fn):
                continue
            size = path.stat().st_size
            r.check(M, size == entry.bytes, "files", f"file is {size} bytes, manifest says "
                    f"{entry.bytes}", file=fn)
            r.check(M, per_file[fn] == entry.tensors, "files", f"shard holds {per_file[fn]} "
                    f"tensors, manifest says {entry.tensors}", file=fn)
        r.check(M, man.summary.get("tensors", len(man.tensors)) == len(man.tensors), "summary",
                f"summary.tensors {man.summary.get('tensors')} != {len(man.tensors)} entries",
                file=MANIFEST)
        for rel, digest in sorted(man.non_weight_files.items()):
            p = self.tree.root / rel
            if r.check(M, p.is_file(), "non-weight", "listed in the manifest but missing",
                       file=rel):
                got = hash_file(p)
                r.check(M, got == digest, "non-weight", f"content changed: xxh3 {got}, manifest "
                        f"says {digest}", file=rel)
        for rel, digest in sorted(self._generated().items()):
            p = self.tree.root / rel
            got = hash_file(p) if p.is_file() else "missing"
            r.check(M, got == digest, "generated", f"xxh3 {got}, manifest says {digest} "
                    "(edited after conversion?)", file=rel)
        fmt = man.output_format
        methods = {b.get("quant_method") for _, b in quant_blocks(self.tree.config)}
        ok = {"bf16": not methods, "compressed-tensors": methods == {"compressed-tensors"},
              "modelopt": methods == {"modelopt"}}.get(fmt, True)
        r.check(M, ok, "output-format", f"manifest output_format {fmt!r} but config.json's "
                f"quantization_config method is {sorted(m or '-' for m in methods) or 'absent'}",
                file="config.json")
        keep = _find_key(man.options, "kept_per_layer")
        keep = _find_key(man.options, "keep") if keep is None else keep
        if isinstance(keep, int) and not isinstance(keep, bool):
            n = self.tree.text_config.get("n_routed_experts")
            r.check(M, n == keep, "keep", f"manifest records keep={keep} but n_routed_experts "
                    f"is {n}", file="config.json")
        digest = _find_key(man.options, "plan")
        if isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest):
            path = self.tree.root / PLAN_FILE
            got = (hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file()
                   else "missing")
            r.check(M, got == digest, "plan", f"the manifest records plan sha256 {digest[:16]}... "
                    f"but {PLAN_FILE} is {got[:16]}...", file=PLAN_FILE)
        if self.source_arg and man.source.path:
            same = self.src is not None and Path(man.source.path).resolve() == self.src.root
            if not same:
                r.notes.append(f"the manifest's source is {man.source.path}; auditing against "
                               f"{self.source_arg} (recorded errors refer to the former)")

    def _check_manifest_after(self) -> None:
        r, M, man = self.report, "manifest", self.manifest
        stored = {mod: v for members in self.fused.values() for mod, v in members.items()}
        for fused_name, entry in man.fused_sets.items():
            sets = sorted({parse_name(f"{m}.weight").fused_set for m in entry.members})
            if sets != [fused_name]:
                r.warn(M, "fused-sets", f"the manifest files members {entry.members} under "
                       f"{fused_name}, but they form {sets}", file=MANIFEST)
            for member in entry.members:
                got = stored
                if member not in got:
                    r.add(M, "fused-sets", f"manifest lists member {member} of {fused_name} "
                          "but it has no NVFP4 scale here", tensor=member)
                    continue
                codec, gs, _ = got[member]
                want = torch.tensor([entry.global_scale], dtype=torch.float32)
                if codec == ModeloptNvfp4Codec.name:  # its own arithmetic: amax / 2688
                    want = nvfp4.tensor_scale(torch.tensor([entry.amax]), "modelopt")
                r.check(M, bool(torch.equal(gs.reshape(-1).float(), want.reshape(-1))),
                        "fused-sets", f"stored global scale {_hexfloat(gs)} but the manifest "
                        f"records {entry.global_scale} (2688/amax, amax {entry.amax}) for "
                        f"{fused_name}", tensor=member)
        quantized: Counter = Counter()
        for m in self.modules.values():
            entry = man.tensors.get(m.primary.name)
            if entry is not None and "quantize" in entry.stage.split("+"):
                quantized[str(m.tn.layer)] += 1
        for layer, entry in man.layers.items():
            r.check(M, quantized[layer] == entry.quantized_modules, "layers",
                    f"manifest records {entry.quantized_modules} quantized modules, the "
                    f"checkpoint has {quantized[layer]}", file=MANIFEST,
                    layer=int(layer) if layer.isdigit() else None)

    # -------------------------------------------------------------- source mapping

    def _map_experts(self) -> None:
        r, SRC = self.report, "source"
        src_routers = _routers(self.src)
        out_routers = _routers(self.tree)
        modes = Counter()
        for layer in self.moe_layers:
            row = r.row(layer)
            w_info, b_info = out_routers.get(layer, (None, None))
            sw_info, sb_info = src_routers.get(layer, (None, None))
            if w_info is None:
                continue
            if not r.check(SRC, sw_info is not None, "router", "the source has no router for "
                           "this layer", tensor=w_info.name):
                continue
            w, sw = self.tree.read(w_info), self.src.read(sw_info)
            self.used_src.add(sw_info.name)
            self.has_counterpart.add(w_info.name)
            b = self.tree.read(b_info) if b_info is not None else None
            sb = self.src.read(sb_info) if sb_info is not None else None
            if sb_info is not None:
                self.used_src.add(sb_info.name)
            if b_info is not None:
                self.has_counterpart.add(b_info.name)
            if not r.check(SRC, w.dim() == 2 and sw.dim() == 2 and w.shape[1] == sw.shape[1]
                           and w.dtype == sw.dtype, "router",
                           f"router {w.dtype}{list(w.shape)} cannot be compared with the "
                           f"source's {sw.dtype}{list(sw.shape)}", tensor=w_info.name):
                continue
            n, ns = w.shape[0], sw.shape[0]
            rows = _row_bytes(w)
            src_rows = _row_bytes(sw)
            by_bytes: dict[bytes, list[int]] = defaultdict(list)
            for j, rb in enumerate(src_rows):
                by_bytes[rb].append(j)
            keep = self.plan.keep(layer) if self.plan is not None else None
            if self.plan is not None and keep is None:
                if n == ns:
                    r.warn(SRC, "plan", "the plan has no entry for this layer; assuming it was "
                           "not pruned", layer=layer)
                    keep = list(range(n))
                else:
                    r.add(SRC, "plan", f"the plan has no entry for this layer, which has {n} "
                          f"of the source's {ns} experts", layer=layer)
            if keep is not None and not r.check(
                    SRC, len(keep) == n and keep[-1] < ns, "plan",
                    f"the plan keeps {len(keep)} experts (max id {keep[-1]}) but the layer has "
                    f"{n} and the source {ns}", layer=layer, tensor=w_info.name):
                keep = None
            if keep is not None:
                mapping: list[int | None] = list(keep)
                mode = "plan"
                bad_rows = 0
                for i, s in enumerate(keep):
                    if rows[i] == src_rows[s]:
                        r.ran(SRC)
                        continue
                    bad_rows += 1
                    actual = by_bytes.get(rows[i], [])
                    diff = float((w[i].float() - sw[s].float()).abs().max())
                    r.add(SRC, "router", f"row {i} differs from source row {s} chosen by the "
                          f"plan (max abs diff {diff:.3g}); "
                          + (f"it equals source row {actual[0]}" if actual else
                             "it equals no source row"), layer=layer, tensor=w_info.name)
                row.router = f"= plan ({n - bad_rows}/{n})"
                if n != ns:
                    row.experts = f"{n}/{ns}"
            else:
                mapping, mode = self._infer(layer, w, sw, rows, by_bytes, b, sb, w_info)
                if mode == "identity":
                    row.router = f"= source ({n})"
                else:
                    row.router = f"inferred ({n}/{ns})"
                    if n != ns:
                        row.experts = f"{n}/{ns}"
            if b is not None and sb is not None:
                bad = 0
                for i, s in enumerate(mapping):
                    if s is None or i >= b.shape[0] or s >= sb.shape[0]:
                        continue
                    if r.check(SRC, _same_bits(b[i], sb[s]), "bias",
                               f"entry {i} = {float(b[i])!r} but source entry {s} = "
                               f"{float(sb[s])!r}", layer=layer, tensor=b_info.name):
                        continue
                    bad += 1
                if bad:
                    row.router += f", bias {bad} bad"
            if all(s is not None for s in mapping) and mapping != sorted(mapping):
                r.warn(SRC, "router", "kept experts are not in ascending source order",
                       layer=layer, tensor=w_info.name)
            self.mapping[layer] = mapping
            modes[mode] += 1
            r.mapping[str(layer)] = {"mode": mode, "source_ids": mapping}
        if modes["inferred"]:
            r.notes.append(f"no plan: expert mapping of {modes['inferred']} layer(s) INFERRED by "
                           "matching router rows to source rows")
        if modes["plan"]:
            r.notes.append(f"expert mapping of {modes['plan']} layer(s) taken from the plan")

    def _check_plan_alone(self) -> None:
        """Without a source only the plan's shape can be checked: one entry per MoE layer,
        keeping as many experts as the layer has."""
        r = self.report
        r.notes.append("--plan without --source: only the plan's expert counts are checked")
        routers = _routers(self.tree)
        for layer in self.moe_layers:
            keep = self.plan.keep(layer)
            w_info = routers.get(layer, (None, None))[0]
            n = w_info.shape[0] if w_info is not None and w_info.shape else None
            if not r.check("structure", keep is not None, "plan", "the plan has no entry for "
                           "this layer", layer=layer):
                continue
            r.check("structure", n is None or len(keep) == n, "plan", f"the plan keeps "
                    f"{len(keep)} experts but the layer has {n}", layer=layer,
                    tensor=w_info.name if w_info is not None else None)
        for key in self.plan.layers:
            r.check("structure", int(key) in self.moe_layers, "plan", f"the plan lists layer "
                    f"{key}, which is not a MoE layer here", layer=int(key))

    def _infer(self, layer, w, sw, rows, by_bytes, b, sb, w_info):
        r, SRC = self.report, "source"
        n, ns = w.shape[0], sw.shape[0]
        mapping: list[int | None] = []
        taken: set[int] = set()
        for i, rb in enumerate(rows):
            cands = [j for j in by_bytes.get(rb, []) if j not in taken]
            if len(cands) > 1 and b is not None and sb is not None and i < b.shape[0]:
                narrowed = [j for j in cands if _same_bits(b[i], sb[j])]
                cands = narrowed or cands
            if not cands:
                near = (sw.float() - w[i].float()).abs().amax(1)
                j = int(near.argmin())
                r.add("source", "router", f"row {i} equals no source router row (nearest: source "
                      f"row {j}, max abs diff {float(near[j]):.3g})", layer=layer,
                      tensor=w_info.name)
                mapping.append(i if n == ns else None)
                continue
            r.ran(SRC)
            if len(cands) > 1:
                r.warn(SRC, "router", f"row {i} equals source rows {cands}; took {cands[0]}",
                       layer=layer, tensor=w_info.name)
            mapping.append(cands[0])
            taken.add(cands[0])
        identity = n == ns and mapping == list(range(n))
        return mapping, "identity" if identity else "inferred"

    def _src_name(self, name: str) -> str | None:
        tn = parse_name(name)
        if tn.role is Role.ROUTED_EXPERT and tn.layer in self.mapping:
            mp = self.mapping[tn.layer]
            s = mp[tn.expert] if tn.expert < len(mp) else None
            return None if s is None else tn.with_expert(s).name
        return name

    def _src_module(self, m: Module) -> Module | None:
        name = self._src_name(m.primary.name)
        if name is None:
            return None
        return self.src_modules.get(parse_name(name).module)

    def _check_config_vs_source(self) -> None:
        r, SRC = self.report, "source"
        a, b = _flatten(self.src.config), _flatten(self.tree.config)
        for key in sorted(set(a) | set(b)):
            leaf = key.rsplit(".", 1)[-1]
            if leaf in CHANGEABLE_CONFIG_KEYS:
                continue
            if key not in b:
                r.add(SRC, "config", f"config key {key} (source: {short(a[key])}) was removed",
                      file="config.json")
            elif key not in a:
                r.warn(SRC, "config", f"config key {key} = {short(b[key])} is not in the "
                       "source", file="config.json")
            else:
                r.check(SRC, a[key] == b[key], "config", f"config {key} = {short(b[key])}, "
                        f"the source has {short(a[key])}", file="config.json")

    # -------------------------------------------------------------- streaming pass

    def _units(self) -> list[Unit]:
        man = self.manifest
        units: list[Unit] = []
        in_module_unit: set[str] = set()
        for m in self.modules.values():
            s = self._src_module(m) if self.src is not None else None
            mode = None
            if s is not None:
                stages = {man.tensors[i.name].stage for i in m.params.values()
                          if man is not None and i.name in man.tensors}
                transformed = any(st != "copy" for st in stages)
                same = (s.codec is m.codec and set(s.params) == set(m.params) and all(
                    (s.params[p].dtype, s.params[p].shape) == (i.dtype, i.shape)
                    for p, i in m.params.items()))
                mode = "decode" if transformed or not same else "bytes"
            if m.codec.quantized or mode == "decode":
                nbytes = sum(i.nbytes for i in m.params.values())
                if s is not None:
                    nbytes += sum(i.nbytes for i in s.params.values())
                units.append(Unit(m.first_start, nbytes, module=m, src_module=s, mode=mode))
                in_module_unit.update(i.name for i in m.params.values())
        for name, info in self.tree.tensors.items():
            if name in in_module_unit:
                continue
            src_info = None
            tn = parse_name(name)
            if self.src is not None and tn.role not in (Role.ROUTER_WEIGHT, Role.ROUTER_BIAS):
                sname = self._src_name(name)
                cand = self.src.tensors.get(sname) if sname else None
                if cand is not None:
                    self.used_src.add(cand.name)
                    self.has_counterpart.add(name)
                    if self.report.check("source", (cand.dtype, cand.shape)
                                         == (info.dtype, info.shape), "bytes",
                                         f"{info.dtype}{list(info.shape)} but source {sname} is "
                                         f"{cand.dtype}{list(cand.shape)}", tensor=name):
                        src_info = cand
            step = max(8, self.chunk // 8 * 8)
            for off in range(0, max(info.nbytes, 1), step):
                length = min(step, info.nbytes - off)
                nbytes = length * (2 if src_info is not None else 1)
                units.append(Unit((str(info.file), info.start + off), nbytes, info=info,
                                  offset=off, length=length, src_info=src_info))
        units.sort(key=lambda u: u.key)
        return units

    def _read(self, u: Unit):
        """(ckpt data, source data, pool buffers to give back) for one unit."""
        if u.module is not None:
            out = {p: self.tree.read(i) for p, i in u.module.params.items()}
            src = ({p: self.src.read(i) for p, i in u.src_module.params.items()}
                   if u.src_module is not None else None)
            return out, src, []
        bufs = [self.pool.take()]
        out = bufs[0][:u.length]
        self.tree.readers[u.info.file].read_into(u.info, out, u.offset)
        src = None
        if u.src_info is not None:
            bufs.append(self.pool.take())
            src = bufs[1][:u.length]
            self.src.readers[u.src_info.file].read_into(u.src_info, src, u.offset)
        return out, src, bufs

    def _stream(self) -> None:
        from tqdm import tqdm

        units = self._units()
        total = sum(u.nbytes for u in units)
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="audit",
                  disable=not self.progress, file=sys.stderr, smoothing=0.1) as bar, \
                ThreadPoolExecutor(2, thread_name_prefix="kconvert-audit") as pool:
            for u, (out, src, bufs) in read_ahead(pool, units, self._read, PREFETCH):
                if u.module is not None:
                    self._module_unit(u, out, src)
                else:
                    self._chunk_unit(u, out, src)
                del out, src
                for buf in bufs:
                    self.pool.give(buf)
                bar.update(u.nbytes)

    def _hash(self, info: TensorInfo, data: torch.Tensor) -> None:
        if self.manifest is None or info.name not in self.manifest.tensors:
            return
        hasher, done = self.hashers.get(info.name, (None, 0))
        if hasher is None:
            hasher = xxhash.xxh3_128()
        if data.numel():
            raw = data.contiguous().reshape(-1).view(torch.uint8)
            hasher.update(memoryview(raw.numpy()).cast("B"))
        done += data.numel() * data.element_size()
        if done < info.nbytes:
            self.hashers[info.name] = (hasher, done)
            return
        self.hashers.pop(info.name, None)
        want = self.manifest.tensors[info.name].hash
        self.report.check("manifest", hasher.hexdigest() == want, "hash",
                          f"xxh3-128 of the bytes is {hasher.hexdigest()}, the manifest "
                          f"records {want}", tensor=info.name)

    def _finite(self, info: TensorInfo, data: torch.Tensor, offset: int = 0) -> None:
        """No NaN/Inf in floating tensors (and no NaN codes in FP8 ones), tested on the bits
        in blocks so that temporaries stay small whatever the piece size."""
        if info.dtype not in NONFINITE_MASK:
            return
        int_dtype, mask = NONFINITE_MASK[info.dtype]
        bits = data.reshape(-1).view(torch.uint8).view(int_dtype)
        mask_t = torch.tensor(mask, dtype=int_dtype)
        count, first = 0, None
        for i in range(0, bits.numel(), FINITE_BLOCK):
            bad = (bits[i:i + FINITE_BLOCK] & mask_t) == mask_t
            if bool(bad.any()):
                count += int(bad.sum())
                first = i + _first(bad) if first is None else first
        element = offset // info.torch_dtype.itemsize + (first or 0)
        if not self.report.check("scales", count == 0, "finite",
                                 f"{count} NaN/Inf value(s), first at element "
                                 f"{_where(info, element)}", tensor=info.name):
            self.scale_bad[parse_name(info.name).layer] += 1

    def _chunk_unit(self, u: Unit, out: torch.Tensor, src: torch.Tensor | None) -> None:
        info = u.info
        self._hash(info, out)
        if info.nbytes % info.torch_dtype.itemsize == 0:
            self._finite(info, out, u.offset)
        if src is not None:
            same = bool(torch.equal(out, src))
            if not same:
                first = _first(out != src)
                element = (u.offset + first) // info.torch_dtype.itemsize
                self.report.add("source", "bytes", f"differs from source {u.src_info.name} at "
                                f"element {_where(info, element)}", tensor=info.name)
            elif u.offset + u.length >= info.nbytes:
                self.report.ran("source")

    def _module_unit(self, u: Unit, out: dict[str, torch.Tensor], src) -> None:
        m, r = u.module, self.report
        for p, info in m.params.items():
            self._hash(info, out[p])
            self._finite(info, out[p])
            self._scale_values(info, p, out[p], m)
        if m.codec.global_scale_param is not None:
            self.fused[m.tn.fused_set][m.name] = (m.codec.name,
                                                  out[m.codec.global_scale_param],
                                                  out.get(m.codec.input_scale_param))
            if self.p48 is not None and m.tn.role.value in self.p48_roles:
                try:
                    packed = m.codec.unpack(out)[0] if m.codec is Nvfp4PairBitmaskCodec \
                        else out[m.codec.params[0]]
                except ValueError as exc:  # a mask chunk without exactly 2 bits
                    r.add("p48", "pattern", str(exc), tensor=m.params["weight_sparse_mask"].name)
                    return
                res = check_packed(packed)
                r.ran("p48", res.chunks)
                if not res.ok:
                    row, chunk, raw = res.first
                    what = ("3 or more nonzero pairs" if res.first_kind == "nonzero"
                            else "a pruned pair stored as -0 instead of 0x00")
                    r.add("p48", "pattern", f"{res.over_two} chunk(s) with more than 2 nonzero "
                          f"pairs, {res.neg_zero} with pruned pairs not 0x00; first: row {row}, "
                          f"chunk {chunk} (elements {8 * chunk}..{8 * chunk + 7}) has {what}: "
                          f"bytes {' '.join(f'{b:02x}' for b in raw)}",
                          tensor=m.params[m.codec.params[0]].name)
        if src is None or u.src_module is None:
            return
        s = u.src_module
        self.used_src.update(i.name for i in s.params.values())
        self.has_counterpart.update(i.name for i in m.params.values())
        if u.mode == "bytes":
            for p, info in m.params.items():
                if not _same_bits(out[p], src[p]):
                    r.add("source", "bytes", f"differs from source {s.params[p].name} (same "
                          f"format {m.codec.name}, must be byte-identical)", tensor=info.name)
                else:
                    r.ran("source")
            return
        self._compare_decode(m, s, out, src)

    def _scale_values(self, info: TensorInfo, p: str, t: torch.Tensor, m: Module) -> None:
        r = self.report
        bad_msg = None
        if p == "weight_scale" and info.dtype == "F8_E4M3":
            raw = t.reshape(-1).view(torch.uint8)
            neg = (raw & 0x80) != 0
            if bool(neg.any()):
                bad_msg = (f"{int(neg.sum())} negative FP8 block scale(s), first at element "
                           f"{_where(info, _first(neg))}")
        elif p == "weight_scale" and info.dtype in FLOAT_DTYPES:
            neg = t.reshape(-1) < 0
            if bool(neg.any()):
                bad_msg = (f"{int(neg.sum())} negative scale(s), first at "
                           f"{_where(info, _first(neg))}")
        elif p in SCALE_POSITIVE and info.dtype in FLOAT_DTYPES:
            bad = ~(t.reshape(-1).float() > 0) | ~torch.isfinite(t.reshape(-1).float())
            if bool(bad.any()):
                bad_msg = (f"scale must be finite and > 0, found "
                           f"{float(t.reshape(-1)[_first(bad)])!r}")
        else:
            return
        if not r.check("scales", bad_msg is None, "scale-values", bad_msg or "", tensor=info.name):
            self.scale_bad[m.tn.layer] += 1

    def _compare_decode(self, m: Module, s: Module, out: dict, src: dict) -> None:
        r = self.report
        if not r.check("source", m.shape == s.shape and len(m.shape) == 2, "decode",
                       f"logical shape {list(m.shape)} but source {s.name} is {list(s.shape)}",
                       tensor=m.primary.name):
            return
        kind, bound, why = self._bound(m)
        res = _decode_compare(m, s, out, src, self.device, kind == "elementwise")
        row = r.row(m.tn.layer) if m.tn.layer is not None else None
        if row is not None:
            row.compared += 1
            row.max_rel_mse = max(row.max_rel_mse or 0.0, res.rel_mse)
            row.max_abs_err = max(row.max_abs_err or 0.0, res.max_abs)
        if kind == "elementwise":
            r.check("source", res.bad_elems == 0, "decode",
                    f"{res.bad_elems} element(s) differ from the source decode of {s.name} by "
                    f"more than BF16 rounding (max abs err {res.max_abs:.3g})",
                    tensor=m.primary.name)
        else:
            r.check("source", res.rel_mse <= bound, "decode",
                    f"decode differs from the source decode of {s.name}: relative MSE "
                    f"{res.rel_mse:.3g} > {bound:.3g} ({why})", tensor=m.primary.name)

    def _bound(self, m: Module) -> tuple[str, float, str]:
        if self.max_rel_mse is not None:
            return "rel", self.max_rel_mse, "--max-rel-mse"
        if m.codec is DenseCodec:
            return "elementwise", DENSE_REL_TOL, "BF16 rounding"
        man = self.manifest
        if man is not None and m.primary.name in man.tensors:
            entry = man.layers.get(str(m.tn.layer))
            if entry is not None:
                return ("rel", entry.rel_mse_max * (1 + 1e-3) + 1e-9,
                        f"the manifest's rel_mse_max for layer {m.tn.layer}")
        return "rel", DEFAULT_REL_MSE, "default bound for a re-encoded module"

    # -------------------------------------------------------------- after the pass

    def _check_fused_sets(self) -> None:
        r = self.report
        sets: dict[str, list[Module]] = defaultdict(list)
        for m in self.modules.values():
            if m.linear:
                sets[m.tn.fused_set].append(m)
        for fused_name, ms in sorted(sets.items()):
            if len(ms) < 2:
                continue
            ms.sort(key=lambda m: m.name)
            codecs = {m.codec for m in ms}
            if not r.check("scales", len(codecs) == 1, "fused-scale",
                           f"members of fused set {fused_name} are in different formats: "
                           + ", ".join(f"{m.name.rsplit('.', 1)[-1]} {m.codec.name}" for m in ms),
                           tensor=fused_name):
                continue
            if any(c.global_scale_param is None for c in codecs):
                continue
            stored = self.fused.get(fused_name, {})
            if any(m.name not in stored for m in ms):
                continue  # a module unit failed to read; reported elsewhere
            first = ms[0]
            _, gs0, in0 = stored[first.name]
            short0 = first.name.rsplit(".", 1)[-1]
            for m in ms[1:]:
                _, gs, inp = stored[m.name]
                if not r.check("scales", _same_bits(gs, gs0), "fused-scale",
                               f"global scale {_hexfloat(gs)} but {short0} has {_hexfloat(gs0)}: "
                               f"fused set {fused_name} must share one", tensor=m.primary.name):
                    self.scale_bad[m.tn.layer] += 1
                if not _same_bits(inp, in0):
                    r.add("scales", "fused-scale", f"input scale differs from {short0}'s: "
                          f"fused set {fused_name} must share one", tensor=m.primary.name)

    def _check_accounting(self) -> None:
        r, SRC = self.report, "source"
        dropped = set(self.manifest.dropped) if self.manifest is not None else set()
        kept = {L: {s for s in mp if s is not None} for L, mp in self.mapping.items()}
        pruned = 0
        for name in sorted(self.src.tensors):
            if name in self.used_src:
                continue
            tn = parse_name(name)
            if tn.role is Role.ROUTED_EXPERT and tn.layer in kept and tn.expert not in kept[
                    tn.layer]:
                pruned += 1
                continue
            if name in dropped:
                continue
            r.add(SRC, "accounting", "source tensor has no counterpart in the checkpoint (not "
                  "kept, transformed, pruned by the mapping, or recorded as dropped)",
                  tensor=name)
        for name in sorted(self.tree.tensors):
            if name not in self.has_counterpart:
                r.add(SRC, "accounting", "tensor has no counterpart in the source", tensor=name)
        r.ran(SRC, len(self.src.tensors))
        if pruned:
            r.notes.append(f"{pruned} source tensors belong to pruned experts")
        if self.manifest is not None and self.src is not None:
            self._check_manifest_sources()

    def _check_manifest_sources(self) -> None:
        r, man = self.report, self.manifest
        if not man.source.path or Path(man.source.path).resolve() != self.src.root:
            return
        for name, entry in man.tensors.items():
            if name not in self.tree.tensors:
                continue
            tn = parse_name(name)
            for sname in entry.sources:
                ok = sname in self.src.tensors
                if ok and tn.role is Role.ROUTED_EXPERT and tn.layer in self.mapping:
                    mp = self.mapping[tn.layer]
                    want = mp[tn.expert] if tn.expert < len(mp) else None
                    ok = parse_name(sname).expert == want
                r.check("manifest", ok, "sources", f"manifest says it was made from {sname}, "
                        "which disagrees with the source / expert mapping", tensor=name)

    def _check_other_files_vs_source(self) -> None:
        r, SRC = self.report, "source"
        dropped = set(self.manifest.dropped) if self.manifest is not None else set()
        mine = set(self.tree.other_files())
        for rel in self.src.other_files():
            if rel in dropped:
                continue
            p = self.tree.root / rel
            if r.check(SRC, p.is_file(), "non-weight", "in the source but missing here",
                       file=rel):
                a, b = hash_file(self.src.root / rel), hash_file(p)
                r.check(SRC, a == b, "non-weight", f"differs from the source's copy (xxh3 {b} vs "
                        f"{a})", file=rel)
        for rel in sorted(mine - set(self.src.other_files()) - set(self._generated())):
            r.warn(SRC, "non-weight", "not in the source", file=rel)

    def _fill_table(self) -> None:
        r = self.report
        for layer, row in r.layers.items():
            row.scales = f"{self.scale_bad[layer]} bad" if self.scale_bad[layer] else "ok"


# ============================================================================ helpers


def _first(mask: torch.Tensor) -> int:
    idx = mask.reshape(-1).nonzero()
    return int(idx[0]) if idx.numel() else 0


def _where(info: TensorInfo, element: int) -> str:
    if len(info.shape) < 2:
        return f"[{element}]"
    idx = []
    for dim in reversed(info.shape):
        idx.append(element % dim)
        element //= dim
    return "[" + ", ".join(str(i) for i in reversed(idx)) + "]"


def _same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    a, b = a.reshape(-1), b.reshape(-1)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def _row_bytes(w: torch.Tensor) -> list[bytes]:
    raw = w.contiguous().view(torch.uint8).reshape(w.shape[0], -1)
    return [bytes(raw[i].numpy()) for i in range(w.shape[0])]


def _routers(tree: Tree) -> dict[int, tuple[TensorInfo | None, TensorInfo | None]]:
    out: dict[int, list] = defaultdict(lambda: [None, None])
    for name, info in tree.tensors.items():
        tn = parse_name(name)
        if tn.role is Role.ROUTER_WEIGHT and tn.param == "weight":
            out[tn.layer][0] = info
        elif tn.role is Role.ROUTER_BIAS:
            out[tn.layer][1] = info
    return {k: (v[0], v[1]) for k, v in out.items()}


def _find_key(options: object, key: str):
    if isinstance(options, dict):
        if key in options:
            return options[key]
        for v in options.values():
            found = _find_key(v, key)
            if found is not None:
                return found
    return None


def _find_plan(options: object):
    """A plan recorded inline in manifest options: a dict with 'layers' of {'keep': ...}."""
    if isinstance(options, dict):
        layers = options.get("layers")
        if isinstance(layers, dict) and all(isinstance(v, dict) and "keep" in v
                                            for v in layers.values()) and layers:
            return options
        plan = options.get("plan")
        if isinstance(plan, dict):
            return plan
        for v in options.values():
            found = _find_plan(v)
            if found is not None:
                return found
    return None


def _slice_rows(m: Module, t: dict[str, torch.Tensor], r0: int, r1: int) -> dict:
    out = {}
    for p in m.codec.params:
        if p == "weight_shape":
            continue
        v = t[p]
        if m.codec is Fp8BlockCodec and p == "weight_scale_inv":
            v = v[r0 // 128: -(-r1 // 128)]
        elif v.dim() == 2 and v.shape[0] == m.shape[0]:
            v = v[r0:r1]
        out[p] = v.unsqueeze(0)
    return out


def _decode_compare(m: Module, s: Module, out: dict, src: dict, device: torch.device,
                    elementwise: bool) -> ModuleCompare:
    """Decode both sides in row blocks on `device`; relative MSE, max abs error, bad elements."""
    rows_total, cols = m.shape
    step = max(128, ((1 << 21) // max(cols, 1)) // 128 * 128)
    out = {k: v.to(device) for k, v in out.items()}
    src = {k: v.to(device) for k, v in src.items()}
    err = torch.zeros((), dtype=torch.float64, device=device)
    ref = torch.zeros((), dtype=torch.float64, device=device)
    max_abs = torch.zeros((), dtype=torch.float32, device=device)
    bad = torch.zeros((), dtype=torch.int64, device=device)
    for r0 in range(0, rows_total, step):
        r1 = min(rows_total, r0 + step)
        a = s.codec.decode(_slice_rows(s, src, r0, r1), (r1 - r0, cols))[0].float()
        b = m.codec.decode(_slice_rows(m, out, r0, r1), (r1 - r0, cols))[0].float()
        d = b - a
        err += d.double().square().sum()
        ref += a.double().square().sum()
        max_abs = torch.maximum(max_abs, d.abs().max())
        if elementwise:
            bad += (d.abs() > DENSE_REL_TOL * a.abs()).sum()
    e, rf = float(err), float(ref)
    rel = e / rf if rf else (0.0 if e == 0 else math.inf)
    return ModuleCompare(rel, float(max_abs), int(bad))


class _BufferPool:
    """Host buffers for streamed pieces, allocated on first use and reused most recently freed
    first (a fixed set: no allocator churn, so resident memory stays at what is in flight)."""

    def __init__(self, size: int, count: int):
        self.size = size
        self._free: queue.LifoQueue = queue.LifoQueue()
        for _ in range(count):
            self._free.put(None)

    def take(self) -> torch.Tensor:
        buf = self._free.get()
        return torch.empty(self.size, dtype=torch.uint8) if buf is None else buf

    def give(self, buf: torch.Tensor) -> None:
        self._free.put(buf)


# ============================================================================ API and CLI


def run_audit(ckpt: str | Path, source: str | None = None, plan: str | None = None,
              device: str = "auto", revision: str | None = None, progress: bool = False,
              max_rel_mse: float | None = None, chunk: int = CHUNK) -> Report:
    """Audit CKPT; returns the report (`report.passed`). Raises KconvertError when it cannot."""
    return Auditor(Path(ckpt), source, plan, device, revision, progress, max_rel_mse,
                   chunk).run()
