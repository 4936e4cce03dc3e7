"""Opening a checkpoint: a local directory or a Hugging Face repo id.

`Checkpoint` knows the config (top level or `text_config` of the K2.5/K2.6 wrapper), the
weight map (from `model.safetensors.index.json` or a single `model.safetensors`), a validated
reader per shard, and the non-weight files that must be carried over byte for byte.

`open_checkpoint` (a conversion's source) is strict: everything that can be checked before
converting is checked here, so a bad input fails before a single output byte is written
(kconvert.checks.survey opens the same files for `kconvert audit`, reporting every
inconsistency as a finding instead).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from kconvert.errors import KconvertError
from kconvert.io.checkpoint_files import INDEX, SINGLE
from kconvert.io.shards import ShardReader, TensorInfo
from kconvert.model.config_check import text_config_problem
from kconvert.records.manifest import MANIFEST

CONFIG = "config.json"
# Kimi-K2 / DeepSeek-V3 (and the K2.5/K2.6 wrapper), and Kimi-K3 (its wrapper, text_config
# "kimi_linear"; kconvert.model.arch says what each family's config calls things).
SUPPORTED_MODEL_TYPES = {"kimi_k2", "deepseek_v3", "kimi_linear"}
SUPPORTED_ARCHITECTURES = {"DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration",
                           "KimiK3ForConditionalGeneration"}
# Files that describe weights and are regenerated for the output, never copied.
GENERATED_FILES = {INDEX, CONFIG, "hf_quant_config.json", MANIFEST,
                   "reap-plan.json"}
SKIPPED_DIRS = {".git", ".cache", ".kconvert"}
log = logging.getLogger(__name__)
# Tensor bytes at each end of a shard that its content fingerprint reads (Checkpoint.fingerprint).
FINGERPRINT_BYTES = 1 << 20


# Weight files of a Hub repo that are fetched only when the index names them (a repo may hold
# other formats of the same weights beside the safetensors: original/*.pth, *.bin).
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")


@dataclass
class Checkpoint:
    root: Path
    identity: dict
    config: dict
    weight_map: dict[str, str]
    has_index: bool
    readers: dict[str, ShardReader] = field(default_factory=dict)
    index: dict | None = None  # the index file's contents, where there is one

    @property
    def text_config(self) -> dict:
        """The language model's config: `text_config` for K2.5/K2.6, else the top level."""
        return self.config.get("text_config", self.config)

    @property
    def shards(self) -> list[str]:
        """Shard file names in a stable order (sorted: Kimi's names sort in layer order)."""
        return sorted(set(self.weight_map.values()))

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        return {
            name: self.readers[file].tensors[name] for name, file in self.weight_map.items()
        }

    def tensor(self, name: str) -> TensorInfo:
        """One tensor's info, without building `tensors` (a dict of every tensor)."""
        return self.readers[self.weight_map[name]].tensors[name]

    def reader_for(self, info: TensorInfo) -> ShardReader:
        return self.readers[info.file.name]

    def shape_values(self) -> dict[str, tuple[int, ...]]:
        """Contents of every INT4 `weight_shape` tensor (8-16 bytes each): a module's logical
        shape, needed to group and plan modules."""
        values = {}
        for name, file in self.weight_map.items():
            if name.endswith(".weight_shape"):
                info = self.readers[file].tensors[name]
                values[name] = self.readers[file].read_ints(info)
        return values

    def fingerprint(self) -> str | None:
        """sha256 of what identifies the checkpoint's content without reading it all:
        config.json, and per shard its name, size, header and its first and last MiB of tensor
        data (a retrained or edited checkpoint of the same layout differs there); None when a
        shard is not a file under root (a streamed run's, deleted once converted)."""
        digest = hashlib.sha256((self.root / CONFIG).read_bytes())
        for shard in self.shards:
            path = self.root / shard
            if not path.is_file():
                return None
            size = path.stat().st_size
            with path.open("rb") as fh:
                head = fh.read(8)
                start = 8 + int.from_bytes(head, "little")
                digest.update(f"{shard}\0{size}\0".encode() + head + fh.read(start - 8))
                digest.update(fh.read(min(FINGERPRINT_BYTES, size - start)))
                fh.seek(max(start, size - FINGERPRINT_BYTES))
                digest.update(fh.read())
        return digest.hexdigest()

    def other_files(self) -> list[str]:
        """Every file that is not a weight shard or a regenerated file, relative to root."""
        shards = set(self.shards)
        out = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
            for fn in sorted(filenames):
                rel = os.path.relpath(os.path.join(dirpath, fn), self.root)
                if rel in shards or rel in GENERATED_FILES:
                    continue
                out.append(rel)
        return out

    def check_other_files(self) -> None:
        """Every non-weight file must be copied at the end of a run: find the unreadable ones
        (a broken symlink, a FIFO, no permission) now, before any output is written."""
        for dirpath, dirnames, _ in os.walk(self.root):
            for d in dirnames:
                if d not in SKIPPED_DIRS and os.path.islink(os.path.join(dirpath, d)):
                    raise KconvertError("a symlink to a directory in the source is not "
                                        "followed, so its files would be lost; replace it with "
                                        "the directory", file=os.path.join(dirpath, d))
        for rel in self.other_files():
            path = self.root / rel
            try:
                if not stat.S_ISREG(path.stat().st_mode):
                    raise KconvertError("non-weight file is not a regular file; kconvert copies "
                                        "every non-weight file of the source", file=str(path))
                with path.open("rb"):
                    pass
            except OSError as exc:
                what = "a broken symlink" if path.is_symlink() else exc.strerror
                raise KconvertError(f"non-weight file cannot be read ({what}); kconvert copies "
                                    "every non-weight file of the source: fix or remove it",
                                    file=str(path)) from exc

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()


def is_repo_id(src: str) -> bool:
    """`owner/name`, not a path that exists here (nor one that starts like a path)."""
    return (src.count("/") == 1 and not src.startswith((".", "/", "~"))
            and not Path(src).exists() and all(src.split("/")))


def resolve(src: str, revision: str | None, token: str | None = None,
            cache_dir: str | None = None) -> tuple[Path, dict]:
    """A local path stays local; a repo id is downloaded (`download`); any other path that
    does not exist is a missing directory."""
    path = Path(src)
    if path.exists():
        if not path.is_dir():
            raise KconvertError("source is not a directory", file=src)
        if revision is not None:
            raise KconvertError(f"--revision {revision} applies to a Hub repo id, and the source "
                                "is a local directory: drop --revision", file=src)
        return path.resolve(), {"path": str(path.resolve())}
    if not is_repo_id(src):
        raise KconvertError("source directory does not exist", file=src)
    return download(src, revision, token, cache_dir)


def download(repo: str, revision: str | None, token: str | None = None,
             cache_dir: str | None = None, shards: bool = True) -> tuple[Path, dict]:
    """The files of Hub repo `repo` a conversion reads or carries over, in the Hugging Face
    cache: first every file but weights (config, index, tokenizer, chat template, code, docs:
    what a local run copies), then (`shards`) the shards the index names, and no other weight
    file."""
    from huggingface_hub import constants, snapshot_download

    where = f"{repo}@{revision or 'main'}"
    log.info("%s is no local directory: fetching %s from the Hugging Face Hub (cache %s), "
             "all but %s first", repo, where, cache_dir or constants.HF_HUB_CACHE,
             " ".join(WEIGHT_FILES))
    try:
        local = Path(snapshot_download(repo, revision=revision, token=token,
                                       cache_dir=cache_dir, ignore_patterns=list(WEIGHT_FILES)))
        index, _ = parse_index(local / INDEX) if (local / INDEX).is_file() else (None, None)
        names = sorted(set(index["weight_map"].values())) if index else [SINGLE]
        if shards:
            log.info("fetching the %d weight file(s) the index names, at commit %s",
                     len(names), local.name)
            # Pinned to the commit of the first call, so both halves are of one revision.
            snapshot_download(repo, revision=local.name, token=token, cache_dir=cache_dir,
                              allow_patterns=names)
    except Exception as exc:  # network, auth, missing repo: all the user's to fix
        raise KconvertError(hub_failed(repo, where, "the snapshot", exc,
                                       constants.is_offline_mode())) from exc
    return local, {"repo": repo, "revision": revision or "main", "commit": local.name}


def hub_failed(src: str, where: str, name: str, exc: Exception, offline: bool) -> str:
    """Why SRC, no local directory, could not be had as a Hub repo id either."""
    tried = f"source directory does not exist: {src!r} is no local directory, and as a Hub repo id"
    if offline:
        return (f"{tried} {name} of {where} is not in the Hugging Face cache while "
                f"HF_HUB_OFFLINE is set ({type(exc).__name__})")
    return f"{tried} {name} could not be fetched from {where}: {exc}"


def parse_config(path: Path) -> tuple[dict, str | None]:
    """(config.json's object, or {} and what is wrong with the file)."""
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        return {}, f"config.json is not valid JSON: {exc}"
    if not isinstance(config, dict):
        return {}, f"config.json holds a JSON {type(config).__name__}, not an object"
    return config, None


def load_config(root: Path) -> dict:
    path = root / CONFIG
    if not path.is_file():
        raise KconvertError("no config.json", file=str(path))
    config, problem = parse_config(path)
    if problem is not None:
        raise KconvertError(problem, file=str(path))
    text = config.get("text_config", config)
    if not isinstance(text, dict):
        raise KconvertError("config.json's text_config is not an object", file=str(path))
    problem = architecture_problem(config) or text_config_problem(text)
    if problem is not None:
        raise KconvertError(problem, file=str(path))
    return config


def architecture_problem(config: dict) -> str | None:
    """Why a config is not of the Kimi-K2 / DeepSeek-V3 family, or None: every architecture it
    names and its (text) model_type must be ones kconvert handles, and it must name one."""
    text = config.get("text_config", config)
    archs = config.get("architectures") or []
    model_type = text.get("model_type") if isinstance(text, dict) else None
    archs = set(archs) if isinstance(archs, list) and all(isinstance(a, str) for a in archs) \
        else {str(archs)}
    if archs - SUPPORTED_ARCHITECTURES or (model_type is not None and model_type not in
                                           SUPPORTED_MODEL_TYPES) or not (archs or model_type):
        return (f"unsupported architecture {sorted(archs)} / model_type {model_type!r}: "
                "kconvert handles the Kimi-K2 / DeepSeek-V3 family and Kimi-K3")
    return None


def parse_index(path: Path) -> tuple[dict | None, str | None]:
    """(the index, whose weight_map maps tensor -> shard file name; or None and what is wrong
    with the file)."""
    try:
        index = json.loads(path.read_text())
        weight_map = index["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        return None, f"malformed index: {exc}"
    if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
        return None, ("malformed index: weight_map is not an object of tensor -> shard file "
                      "name")
    return index, None


def open_checkpoint(src: str, revision: str | None = None, *, token: str | None = None,
                    cache_dir: str | None = None) -> Checkpoint:
    root, identity = resolve(src, revision, token, cache_dir)
    config = load_config(root)
    index_path = root / INDEX
    index = None
    if index_path.is_file():
        index, problem = parse_index(index_path)
        if problem is not None:
            raise KconvertError(problem, file=str(index_path))
        weight_map, has_index = index["weight_map"], True
    elif (root / SINGLE).is_file():
        weight_map, has_index = {}, False
    else:
        raise KconvertError(f"no {INDEX} and no {SINGLE}", file=str(root))

    ckpt = Checkpoint(root, identity, config, weight_map, has_index, index=index)
    files = sorted(set(weight_map.values())) if has_index else [SINGLE]
    for fn in files:
        path = root / fn
        if not path.is_file():
            what = "is a directory, not a file" if path.is_dir() else "does not exist"
            raise KconvertError(f"index names a shard that {what}", file=str(path))
        ckpt.readers[fn] = ShardReader(path)
        log.debug("shard %s: %d tensors", fn, len(ckpt.readers[fn].tensors))
    if not has_index:
        ckpt.weight_map = {name: SINGLE for name in ckpt.readers[SINGLE].tensors}

    return checked(ckpt)


def checked(ckpt: Checkpoint) -> Checkpoint:
    """`ckpt` once its index, shards and other files agree; closed and refused otherwise."""
    try:
        check_weight_map(ckpt)
        ckpt.check_other_files()
    except KconvertError:
        ckpt.close()
        raise
    return ckpt


def check_weight_map(ckpt: Checkpoint) -> None:
    """The index and the shards must agree exactly (loaders such as llama.cpp refuse
    otherwise)."""
    for name, fn in ckpt.weight_map.items():
        if name not in ckpt.readers[fn].tensors:
            raise KconvertError("index names a tensor the shard does not hold", file=fn,
                                tensor=name)
    for fn, reader in ckpt.readers.items():
        for name in reader.tensors:
            if ckpt.weight_map.get(name) != fn:
                raise KconvertError("shard holds a tensor the index does not list", file=fn,
                                    tensor=name)
