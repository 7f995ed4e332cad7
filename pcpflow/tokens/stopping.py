"""Where a request stops early: at the first of its stop (EOS) tokens among the tokens a
step appends (its accepted drafts and the target's sample), that token included."""

from __future__ import annotations

import numpy as np


def cut_at_stop(
    stop_ids: np.ndarray, take: np.ndarray, row_of: np.ndarray, j: np.ndarray, tokens: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The appended tokens cut after each row's first stop token.

    ``take [R]``: tokens row r appends; ``tokens`` (with ``row_of``, ``j``: their row and
    offset in it) those tokens, row by row. Returns (take, row_of, j, tokens) cut, and
    ``stopped [R]``: the rows that appended a stop token.
    """
    if not len(stop_ids) or not len(tokens):
        return take, row_of, j, tokens, np.zeros(len(take), dtype=bool)
    hit = np.isin(tokens, stop_ids)
    first = take.copy()  # offset of the row's first stop token; take = none
    np.minimum.at(first, row_of[hit], j[hit])
    stopped = first < take
    take = np.where(stopped, first + 1, take)
    keep = j < take[row_of]
    return take, row_of[keep], j[keep], tokens[keep], stopped
