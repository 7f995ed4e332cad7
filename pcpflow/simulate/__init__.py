"""Simulated runs (``mode=simulate``, docs/simulate.md): the executed run's scheduler, plan
and accounting at real lengths in one process, each step priced on a hardware profile as a
sum of operators.

``sizes`` (a card's parameters, dims and GEMM shapes), ``kernels`` (GEMMs, attention, memory
ops by shape), ``flash`` (FlashAttention-3's published throughput, and the shapes of the calls
a step's attention makes, the engine's and a ring's), ``collectives`` (NCCL's tuning model,
point-to-point), ``host`` (kernel launches, counted from pcpflow's own forward), ``price``
(a step's operators, a ring's as the executed ring counts it, and what hides behind what), ``engine`` (the loop and its summary),
``prepare`` (simulated defaults and bad input), ``decide`` (sweep ranking, Pareto front, the
terms that decide the order), ``plot`` (load.png). The settings live in
``pcpflow.config.hardware``.
"""
