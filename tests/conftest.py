from __future__ import annotations

import pytest

from multirank import WorkerPool


@pytest.fixture(scope="session")
def pool():
    workers = WorkerPool()
    yield workers
    workers.close()
