"""Holds a pcpflow driver at one moment, so that a test can signal it exactly there.

``PCPFLOW_TEST_PAUSE=module:function`` wraps that function: on its first call it touches
``PCPFLOW_TEST_PAUSE_FLAG`` and sleeps (``PCPFLOW_TEST_PAUSE_S``, default 30) before running
it (``...:function:after`` sleeps after it returns instead). Only a process whose
``tests/signal_pause`` is on PYTHONPATH loads this (Python imports ``sitecustomize`` at start).
"""

import functools
import importlib
import os
import sys
import time
from pathlib import Path

_TARGET = os.environ.get("PCPFLOW_TEST_PAUSE")


def _install(target: str) -> None:
    module_name, function, *when = target.split(":")
    module = importlib.import_module(module_name)
    original = getattr(module, function)
    seconds = float(os.environ.get("PCPFLOW_TEST_PAUSE_S", "30"))
    flag = Path(os.environ["PCPFLOW_TEST_PAUSE_FLAG"])

    @functools.wraps(original)
    def paused(*args, **kwargs):
        if when == ["after"]:
            out = original(*args, **kwargs)
        if not flag.exists():
            flag.write_text(str(os.getpid()))
            time.sleep(seconds)
        return out if when == ["after"] else original(*args, **kwargs)

    setattr(module, function, paused)


if _TARGET and sys.argv[:1] != ["-c"]:  # the driver (python -m ...), not its fork server or ranks
    _module = _TARGET.split(":")[0]

    class _Finder:
        """Wraps the function once its module has been imported by pcpflow itself."""

        def find_spec(self, name, path=None, target=None):
            if name == _module:
                sys.meta_path.remove(self)
                spec = importlib.util.find_spec(name)
                loader = spec.loader
                exec_module = loader.exec_module

                def exec_and_install(module):
                    exec_module(module)
                    _install(_TARGET)

                loader.exec_module = exec_and_install
                return spec
            return None

    import importlib.util

    sys.meta_path.insert(0, _Finder())
