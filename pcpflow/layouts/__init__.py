"""Layout arithmetic, numpy only (no torch): where each token of a step runs (``layout``), where
its KV goes (``slots``), what a DCP rank gathers (``dcp_context``), and what a step costs in
rows, attention pairs, FLOPs and collective bytes (``accounting``).
"""
