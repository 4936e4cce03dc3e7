"""kconvert: stream-convert Kimi-K2 family MoE checkpoints shard by shard.

The Python API (kconvert.api) is reachable from here, imported on first use so that
`import kconvert` stays light: `kconvert.inspect(...)`, `kconvert.int4_to_nvfp4(...)`, ...
Every function raises `kconvert.KconvertError` with the command line's message.
"""

from kconvert.errors import KconvertError
from kconvert.version import __version__

# One function per command (kconvert.api).
API = ("int4_to_nvfp4", "int4_to_mxfp4", "mxfp4_to_nvfp4", "quantize", "dequant", "reap",
       "sparsify", "densify", "calibrate", "eval", "audit", "inspect", "run_recipe")

__all__ = ["API", "KconvertError", "__version__", *API]


def __getattr__(name: str):
    if name in API:
        from kconvert import api

        return getattr(api, name)
    raise AttributeError(f"module 'kconvert' has no attribute {name!r}")
