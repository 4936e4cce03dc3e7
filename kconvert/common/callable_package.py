"""A package that is also a function of the Python API.

The API names its functions after the commands, and two commands have packages of the same
name: `kconvert.audit(...)` runs an audit while `kconvert.audit.auditor` stays the package's
module (likewise `kconvert.calibrate`)."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable


def callable_package(name: str, function: Callable) -> None:
    """Calling the package `name` calls `function`."""

    class CallablePackage(types.ModuleType):
        __call__ = staticmethod(function)

    sys.modules[name].__class__ = CallablePackage
