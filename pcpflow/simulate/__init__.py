"""Simulated runs (``mode=simulate``, docs/simulate.md): the executed run's scheduler, plan
and accounting at real lengths in one process, each step priced on a hardware profile as a
sum of operators.

``sizes`` (a card's parameters, dims and GEMM shapes), ``kernels`` (GEMMs, attention, memory
ops by shape), ``collectives`` (NCCL's tuning model, point-to-point), ``host`` (kernel launches,
counted from pcpflow's own forward), ``ring`` (Meta's ring variants, priced only), ``price``
(a step's operators and what hides behind what), ``engine`` (the loop and its summary),
``prepare`` (simulated defaults and bad input), ``decide`` (sweep ranking, Pareto front, the
terms that decide the order), ``plot`` (load.png). The settings live in
``pcpflow.config.hardware``.
"""
