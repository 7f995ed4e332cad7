"""Attention kernels and their context-parallel wrappers: ``paged`` (the reference over paged
caches), ``fused`` (one kernel with log-sum-exp; CUDA graphs), ``context_parallel`` (PCP
gathers, DCP shards and their exact merge), ``metadata`` (slot mappings and per-row
contexts, built once per step).
"""
