"""Index arrays (numpy) handed to torch."""

from __future__ import annotations

import numpy as np
import torch


def int64_tensor(a, device: torch.device | str | None = None) -> torch.Tensor:
    """``a``'s values as an int64 tensor on ``device`` (on the CPU, the array's own memory
    where it can: a read-only array, such as a decode-only layout's shared segments, is
    copied, since torch takes no read-only memory)."""
    a = np.ascontiguousarray(a, dtype=np.int64)
    if not a.flags.writeable:
        a = a.copy()
    t = torch.from_numpy(a)
    return t if device is None else t.to(device)
