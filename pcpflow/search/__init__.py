"""``mode=search`` (docs/search.md): the best layouts for a model, ``search.gpus`` GPUs of a
hardware profile, a workload and latency targets.

``space`` (the layouts: tp, pcp, dcp, decode mode, ``dcp_rest``, CP attention, MoE dispatch,
CUDA-graph mode, pools, replicas; ``search.candidates`` as override strings), ``plan`` (every
layout validated as a ``mode=simulate`` run would be, the ones that cannot run pruned with
their reasons, before any pricing; bad input), ``rates`` (the highest request rate that keeps
SLO attainment: DistServe's goodput), ``evaluate`` (one layout priced through the simulator's
library, in process), ``run`` (screening in parallel with joblib, exhaustive or with Optuna,
the best priced in full, how far the fitted factors may move), ``report`` (search.csv,
pruned.csv, search.md, search.png, the console's lines).

The search sits below the driver: the driver hands it its validation (``prepare``), so that
a layout is judged by exactly the rules a run of it would meet.
"""
