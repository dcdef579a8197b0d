from __future__ import annotations

import pytest

from multirank import WorkerPool, fuse_every_size

fuse_every_size()  # this process too: the single-process tests

@pytest.fixture(scope="session")
def pool():
    workers = WorkerPool()
    yield workers
    workers.close()

