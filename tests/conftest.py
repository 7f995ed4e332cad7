"""Session-wide fixtures: the shared rank processes of tests/shared_ranks.py."""

from __future__ import annotations

import pytest

import shared_ranks

_NEEDED: set[str] = set()


def pytest_configure(config):
    config.addinivalue_line("markers", "matrix(name): reads a shared_ranks matrix through the shared_runs fixture")


def pytest_collection_modifyitems(config, items):
    _NEEDED.clear()
    for item in items:
        for mark in item.iter_markers("matrix"):
            _NEEDED.update(mark.args)


@pytest.fixture(scope="session")
def shared_runs() -> shared_ranks.SharedRuns:
    return shared_ranks.SharedRuns(set(_NEEDED))
