"""The repository's ``scripts/`` as modules, for tests that call their functions in this
process (imports are warm; no new Python per call)."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@functools.cache
def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` imported once per session, as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # NOTE: before exec: dataclasses and pickling look the module up
    spec.loader.exec_module(module)
    return module
