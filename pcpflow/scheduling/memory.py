"""This host's memory, for what a run will hold: the driver refuses a run that cannot fit
before anything is allocated (an executed run's caches and buffers, ``pcpflow.rank.devices``;
a simulated run's requests and steps, ``pcpflow.simulate.prepare``)."""

from __future__ import annotations

import os
from pathlib import Path

HOST_MEMORY_FRACTION = 0.8
"""A run may plan to use this much of the host's available memory."""


def host_memory_bytes() -> int | None:
    """The host's available memory (``MemAvailable``), or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
