"""Records every rank's proposals, to check that all ranks propose the same tokens and
that a layout proposes what one rank proposes. Insert after the draft slot:
``+pipeline.extra=[{kind: 'pcpflow_test_plugins.draft_probe:DraftProbe', after: draft, path: DIR}]``
writes ``DIR/rank<R>.jsonl`` (R the global rank: with ``disagg=pd`` both pools' ranks): one ``[step, req_ids, draft_token_ids, next_positions]`` line
per step (``next_positions``: each row's newest token's position, -1 for rows that did
not sample).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field

from pcpflow import spec
from pcpflow.pipeline.stage import Stage, StageConfig, register
from pcpflow.pipeline.state import StepState


@register
class DraftProbe(Stage):
    kind = "test_draft_probe"

    class Config(StageConfig):
        kind: Literal["test_draft_probe"] = "test_draft_probe"
        path: str = Field(description="directory for rank<R>.jsonl")

    def __call__(self, state: StepState) -> StepState:
        drafts, batch = state.draft_token_ids, state.batch
        start = spec.draft_start(batch, state.sampled_token_ids)
        positions = np.full(batch.num_reqs, -1, dtype=np.int64)
        positions[start.rows] = start.next_positions
        line = [
            batch.step,
            batch.req_ids.tolist(),
            None if drafts is None else drafts.tolist(),
            positions.tolist(),
        ]
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else self.ctx.world.rank
        out = Path(self.config.path) / f"rank{rank}.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write(json.dumps(line) + "\n")
        return state


def read(path: str | Path) -> dict[int, list]:
    """rank -> its recorded lines."""
    return {
        int(p.stem[4:]): [json.loads(line) for line in p.read_text().splitlines()]
        for p in sorted(Path(path).glob("rank*.jsonl"))
    }


def proposals(path: str | Path) -> dict[tuple[int, int], list[int]]:
    """(req_id, newest token's position) -> the drafts proposed there, over every rank of the
    run recorded at ``path``; every rank that proposed there proposed the same."""
    out: dict[tuple[int, int], list[int]] = {}
    for rank, lines in read(path).items():
        for _, req_ids, drafts, positions in lines:
            for rid, row, pos in zip(req_ids, drafts, positions):
                if pos >= 0:
                    assert out.setdefault((rid, pos), row) == row, (str(path), rank, rid, pos)
    return out
