"""pcpflow: declarative pipelines for prefill/decode context parallelism, verified
against a single rank. Library entry points: ``pcpflow.layouts.layout.plan_layout`` and
``pcpflow.layouts.slots``; command line: ``python -m pcpflow``."""

from pcpflow.paths import checkout_root as _checkout_root

__version__ = "0.1.0"

# NOTE: a checkout keeps conf/ and stages/ beside the package (installed they are
# pcpflow.conf and pcpflow.stages); the root on the package path makes the same names
# import from a plain checkout, so nothing has to be installed to run from a clone.
if (_root := _checkout_root()) is not None and str(_root) not in __path__:
    __path__.append(str(_root))
