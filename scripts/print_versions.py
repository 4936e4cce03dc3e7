"""Print the versions of the packages the suite's results depend on, one line, so that a
failing test log says what it ran on (`make test` runs this first).

    python scripts/print_versions.py
"""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version

# The numerical and format libraries whose version can move a test's result: the arithmetic
# (torch, numpy, numba, triton) and the ecosystem oracles the tests compare against.
PACKAGES = ("torch", "transformers", "compressed-tensors", "nvidia-modelopt", "amd-quark",
            "numpy", "numba", "triton", "safetensors", "tokenizers", "pydantic")


def installed(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def main() -> None:
    found = ", ".join(f"{name} {installed(name)}" for name in PACKAGES)
    print(f"versions: python {platform.python_version()}, {found}")


if __name__ == "__main__":
    main()
