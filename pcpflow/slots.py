"""Public face of the slot arithmetic (``pcpflow.layouts.slots``; numpy only, no torch)."""

from pcpflow.layouts.slots import PAD_SLOT_ID, compute_slot_mapping, dcp_local_seq_lens

__all__ = ["PAD_SLOT_ID", "compute_slot_mapping", "dcp_local_seq_lens"]
