import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from symm_mem_emulation import BOTH_BACKENDS, run_on
from test_fuzz import MIN_FUSE_BYTES, WORLDS, _run_program, programs


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    steps=programs(), autocast=st.booleans(), min_fuse_bytes=st.sampled_from(MIN_FUSE_BYTES),
    world=st.sampled_from(WORLDS), small_pieces=st.booleans(), batch=st.sampled_from([1, 2]),
)
@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_more(pool, backend, steps, autocast, min_fuse_bytes, world, small_pieces, batch):
    args = (steps, autocast, min_fuse_bytes, small_pieces, batch)
    for rank, r in enumerate(run_on(backend, pool, _run_program, world, *args, timeout=30)):
        assert r["equal"], (rank, steps, backend, autocast, min_fuse_bytes, small_pieces, batch, r["explain"])
