"""GlobalBatch's derived arrays against a per-token reference."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pcpflow.layouts.layout import TokenPositions
from pcpflow.scheduling.batch import GlobalBatch

rows = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 20)), max_size=8)


@settings(max_examples=80, deadline=None, database=None)
@given(rows, st.data())
def test_per_token_arrays_and_sampled_rows(reqs, data):
    q = np.array([n for n, _ in reqs], dtype=np.int64)
    c = np.array([k for _, k in reqs], dtype=np.int64)
    t = int(q.sum())
    logits = data.draw(st.lists(st.integers(0, max(t - 1, 0)), unique=True, max_size=t).map(sorted))
    batch = GlobalBatch(
        step=0, req_ids=np.arange(len(q)), num_scheduled_tokens=q, num_computed_tokens=c,
        is_prefilling=np.ones(len(q), dtype=bool), prompt_lens=c + q, input_ids=np.zeros(t, dtype=np.int64),
        block_tables=np.zeros((len(q), 1), dtype=np.int64), logits_indices=np.array(logits, dtype=np.int64),
        num_draft_tokens=np.zeros(len(q), dtype=np.int64),
    )
    # request r's tokens, in order, at positions c_r, c_r + 1, ...
    row = [r for r, n in enumerate(q.tolist()) for _ in range(n)]
    pos = [int(c[r]) + i for r, n in enumerate(q.tolist()) for i in range(n)]
    assert batch.req_indices.tolist() == row and batch.positions.tolist() == pos
    assert batch.req_indices.dtype == batch.positions.dtype == batch.logits_req_indices.dtype == np.int64
    assert batch.logits_req_indices.tolist() == [row[i] for i in logits]
    assert batch.num_tokens == t and batch.query_start_loc.tolist() == [0, *np.cumsum(q).tolist()]
    # the same positions held per request: indexed by any token rows, and built whole
    per_request = TokenPositions(batch.query_start_loc, c)
    tokens = np.array(data.draw(st.lists(st.integers(0, max(t - 1, 0)), max_size=2 * t)) if t else [], dtype=np.int64)
    assert per_request.shape == (t,) and per_request[tokens].tolist() == [pos[i] for i in tokens]
    assert np.asarray(per_request).tolist() == pos and np.asarray(per_request).dtype == np.int64
