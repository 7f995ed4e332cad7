"""Simulated runs (``mode=simulate``, docs/simulate.md): the executed run's scheduler, plan
and accounting at real lengths in one process, each step priced on a hardware profile.

``settings`` (simulate.* and hardware), ``sizes`` (a card's parameters and dims),
``price`` (roofline + alpha-beta per step), ``engine`` (the loop), ``prepare`` (simulated
defaults and bad input), ``decide`` (sweep ranking, Pareto front), ``plot`` (load.png).
"""
