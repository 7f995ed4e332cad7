"""Session-wide fixtures: the shared rank processes of tests/shared_ranks.py."""

from __future__ import annotations

import pytest
import shared_ranks


def pytest_configure(config):
    config.addinivalue_line("markers", "matrix(name): reads a shared_ranks matrix through the shared_runs fixture")


@pytest.fixture(scope="session")
def shared_runs(request) -> shared_ranks.SharedRuns:
    # NOTE: the session's final items, after -m/-k deselection: a deselected (slow) test's
    # matrix is neither composed nor run.
    return shared_ranks.SharedRuns(
        {name for item in request.session.items for mark in item.iter_markers("matrix") for name in mark.args}
    )
