"""pcpflow: declarative pipelines for prefill/decode context parallelism, verified
against a single rank. Library entry points: ``pcpflow.layout.plan_layout`` and
``pcpflow.slots``; command line: ``python -m pcpflow``."""

__version__ = "0.1.0"
