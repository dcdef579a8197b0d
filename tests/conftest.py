from __future__ import annotations

import pytest

from multirank import WorkerPool, fuse_every_size

fuse_every_size()  # this process too: the single-process tests

_pools: list[WorkerPool] = []


@pytest.fixture(scope="session")
def pool():
    workers = WorkerPool()
    _pools.append(workers)
    yield workers
    workers.close()


def pytest_terminal_summary(terminalreporter):
    """Crashes a rerun survived (Note [A crash, run again] in multirank.py),
    printed whole: they are bugs to find, not noise."""
    crashes = [crash for workers in _pools for crash in workers.crashes]
    if crashes:
        terminalreporter.section(f"worker crashes survived by a rerun: {len(crashes)}")
        for crash in crashes:
            terminalreporter.write_line(crash)
