"""A checkpoint's headers and config without its tensor data: a local directory as it is, a
Hub repo id through huggingface_hub (config.json and the index downloaded, each shard's
safetensors header read with HTTP range requests, `parse_safetensors_file_metadata`).

What `kconvert inspect` and `--dry-run` open. With HF_HUB_OFFLINE=1 the Hub cache is used
(shards already cached are read there) or the command fails at once, naming what is missing.
"""

from __future__ import annotations

import logging
from pathlib import Path

from kconvert.errors import KconvertError
from kconvert.io.checkpoint import (
    INDEX,
    SINGLE,
    Checkpoint,
    hub_failed,
    is_repo_id,
    load_config,
    open_checkpoint,
    parse_index,
)
from kconvert.io.shards import DTYPES, ShardReader, TensorInfo

log = logging.getLogger(__name__)


class HeaderOnlyShard:
    """A remote shard's header: its tensors, and no way to read their bytes."""

    def __init__(self, path: Path, header: dict[str, tuple[str, list[int], list[int]]],
                 metadata: dict[str, str] | None):
        self.path = path
        self.metadata = metadata or {}
        self.tensors: dict[str, TensorInfo] = {}
        for name, (dtype, shape, (start, end)) in header.items():
            if dtype not in DTYPES:
                raise KconvertError(f"unsupported dtype {dtype}", file=path.name, tensor=name)
            # Offsets within the data section: only their difference (the size) is used.
            self.tensors[name] = TensorInfo(name, path, dtype, tuple(shape), start, end)

    def read(self, info: TensorInfo, pin: bool = False):
        raise self._absent(info)

    def read_ints(self, info: TensorInfo) -> tuple[int, ...]:
        raise self._absent(info)

    def _absent(self, info: TensorInfo) -> KconvertError:
        """No byte of this shard is here."""
        return KconvertError("only the header of this shard was fetched", file=self.path.name,
                             tensor=info.name)

    def close(self) -> None:
        """Nothing is open."""


def open_headers(src: str, revision: str | None = None, *, token: str | None = None,
                 cache_dir: str | None = None) -> Checkpoint:
    """The checkpoint SRC with headers only: local shards are opened as a conversion opens
    them (headers validated, nothing read); a repo id's shards are not downloaded."""
    if not is_repo_id(src):
        return open_checkpoint(src, revision)
    from huggingface_hub import HfApi, constants, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    where = f"{src}@{revision or 'main'}"
    offline = constants.is_offline_mode()

    def fetch(name: str) -> Path:
        return Path(hf_hub_download(src, name, revision=revision, token=token,
                                    cache_dir=cache_dir))

    try:
        root = fetch("config.json").parent
    except Exception as exc:  # network, auth, missing repo: all the user's to fix
        raise KconvertError(hub_failed(src, where, "config.json", exc, offline)) from exc
    config = load_config(root)
    index = None
    try:
        index, problem = parse_index(fetch(INDEX))
        if problem is not None:
            raise KconvertError(problem, file=f"{where}/{INDEX}")
        weight_map, files = index["weight_map"], sorted(set(index["weight_map"].values()))
    except (EntryNotFoundError, LocalEntryNotFoundError):
        weight_map, files = {}, [SINGLE]
    except KconvertError:
        raise
    except Exception as exc:
        raise KconvertError(hub_failed(src, where, INDEX, exc, offline)) from exc

    commit = root.name  # snapshot folders are named by commit hash
    ckpt = Checkpoint(root, {"repo": src, "revision": revision or "main", "commit": commit},
                      config, weight_map, index is not None, index=index)
    api = HfApi(token=token)
    for fn in files:
        if (root / fn).is_file():  # already in the cache: read its header here
            log.debug("header of %s from the Hugging Face cache", fn)
            ckpt.readers[fn] = ShardReader(root / fn)
            continue
        if offline:
            raise KconvertError(f"HF_HUB_OFFLINE is set and shard {fn} of {where} is not in the "
                                "Hugging Face cache: run once online (inspect reads only its "
                                "header) or unset HF_HUB_OFFLINE", file=fn)
        log.info("reading the header of %s of %s with HTTP range requests", fn, where)
        try:
            meta = api.parse_safetensors_file_metadata(src, fn, revision=commit, token=token)
        except Exception as exc:
            raise KconvertError(f"could not read the header of shard {fn} from {where}: {exc}",
                                file=fn) from exc
        header = {name: (t.dtype, list(t.shape), list(t.data_offsets))
                  for name, t in meta.tensors.items()}
        ckpt.readers[fn] = HeaderOnlyShard(root / fn, header, meta.metadata)
    if index is None:
        ckpt.weight_map = {name: SINGLE for name in ckpt.readers[SINGLE].tensors}
    for name, fn in ckpt.weight_map.items():
        if name not in ckpt.readers[fn].tensors:
            raise KconvertError("index names a tensor the shard does not hold", file=fn,
                                tensor=name)
    return ckpt
