"""kconvert: stream-convert Kimi-K2 family MoE checkpoints shard by shard.

The Python API (kconvert.api) is reachable from here, imported on first use so that
`import kconvert` stays light: `kconvert.inspect(...)`, `kconvert.int4_to_nvfp4(...)`, ...
Every function raises `kconvert.KconvertError` with the command line's message.

The package's layers, lowest first, are declared once below (LAYERS;
tests/test_architecture_rules.py holds the code to them).
"""

from kconvert.errors import KconvertError
from kconvert.version import __version__

# One function per command (kconvert.api).
API = ("int4_to_nvfp4", "int4_to_mxfp4", "mxfp4_to_nvfp4", "quantize", "dequant", "reap",
       "sparsify", "densify", "calibrate", "eval", "audit", "inspect", "run_recipe")

__all__ = ["API", "LAYERS", "KconvertError", "__version__", *API]

# The package's layers, lowest first: a module may import its own layer and the layers below it,
# never one above (a function's lazy import included). A layer is a tuple of module prefixes (a
# prefix holds the module of that name and every module under it; the package's own `kconvert`
# holds only itself: the API's lazy entry).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("kconvert.errors", "kconvert.version", "kconvert.model", "kconvert.common",
     "kconvert.plugins"),  # ground
    ("kconvert.records",),  # run records
    ("kconvert.io",),
    ("kconvert.formats",),
    ("kconvert.checks",),
    ("kconvert.gpu",),  # devices, GPU memory plan and budget
    ("kconvert.calibrate",),
    ("kconvert.methods",),
    ("kconvert.pruning",),
    ("kconvert.engine",),
    ("kconvert.stages",),
    ("kconvert.testing",),  # fixtures: anything below the driver
    ("kconvert.driver",),  # the driver
    ("kconvert.audit", "kconvert.evaluate", "kconvert.sizing"),  # commands beside conversion
    ("kconvert.api",),
    ("kconvert.cli", "kconvert.__main__", "kconvert"),  # entry points
)


def __getattr__(name: str):
    if name in API:
        from kconvert import api

        return getattr(api, name)
    raise AttributeError(f"module 'kconvert' has no attribute {name!r}")
