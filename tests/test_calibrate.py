"""eagertp.calibrate: measuring the size rule's thresholds on a live group."""

from __future__ import annotations

import pytest
from expecttest import assert_expected_inline

from eagertp import EagerMicroPipeline
from eagertp.calibrate import calibrate_min_fuse_bytes, time_round_robin

SIZES = [4096, 8192]  # per rank: 16 and 32 rows of k=64 float32


def _calibrate_worker(rank, group):
    from eagertp.backends import MIN_FUSE_BYTES

    before = dict(MIN_FUSE_BYTES)
    cal = calibrate_min_fuse_bytes(group, k=64, sizes=SIZES, repeats=2, warmup=1)
    EagerMicroPipeline(group=group, min_fuse_bytes=cal.min_fuse_bytes)  # what it is for
    return {"thresholds": cal.min_fuse_bytes, "table": cal.table, "render": cal.render(),
            "defaults_untouched": MIN_FUSE_BYTES == before}


def test_calibration_measures_every_kind_and_ranks_agree(pool):
    results = pool.run(_calibrate_worker, 2)
    assert results[0]["thresholds"] == results[1]["thresholds"], "every rank gets the same answer"
    r = results[0]
    assert set(r["thresholds"]) == {"all_gather", "reduce_scatter", "all_reduce"}
    assert all(v in (0, 4096, 8192, 16384) for v in r["thresholds"].values()), r["thresholds"]
    assert [(row["kind"], row["nbytes"]) for row in r["table"]] == [
        ("all_gather", 4096), ("all_gather", 8192), ("reduce_scatter", 4096), ("reduce_scatter", 8192),
        ("all_reduce", 4096), ("all_reduce", 8192),
    ]
    assert all(row["t_plain"] > 0 and row["t_fused"] > 0 for row in r["table"])
    assert r["defaults_untouched"]
    assert r["render"].startswith("size rule calibration on group '2' (2 ranks), cpu, f32, k=64")


def _round_robin_worker(rank, group):
    import statistics
    import time

    rounds = []
    medians = time_round_robin([lambda: None, lambda: time.sleep(0.002)], group, repeats=3, warmup=2, rounds=rounds)
    return {"medians": medians, "rounds": rounds, "per_function": [statistics.median(col) for col in zip(*rounds)]}


def test_round_robin_hands_out_each_timed_round(pool):
    """Ratios within a round (benchmarks/train_step.py's spread) need every
    timed round's samples, in the order of the functions, warmup left out."""
    results = pool.run(_round_robin_worker, 2)
    assert results[0] == results[1], "every rank gets the slowest rank's samples"
    r = results[0]
    assert len(r["rounds"]) == 3 and all(len(samples) == 2 for samples in r["rounds"]), r["rounds"]
    assert all(sleeper >= 0.002 and idle < sleeper for idle, sleeper in r["rounds"]), r["rounds"]
    assert r["per_function"] == r["medians"], r


def test_round_robin_needs_a_timed_round():
    with pytest.raises(ValueError, match=r"time_round_robin: repeats=0; the medians need at least one timed round"):
        time_round_robin([lambda: None], group=None, repeats=0, warmup=1)


def test_calibration_threshold_rule():
    """The smallest size from which fused is no slower (within the tolerance) at
    every larger size."""
    from eagertp.calibrate import _threshold

    def rows(*ratios):  # plain / fused at 1, 2, 4, ... KiB
        return [{"nbytes": 1024 << i, "t_plain": r, "t_fused": 1.0} for i, r in enumerate(ratios)]

    assert _threshold(rows(1.2, 1.1, 1.5), 0.0) == 1024  # always pays: the smallest size
    assert _threshold(rows(0.5, 1.1, 1.5), 0.0) == 2048
    assert _threshold(rows(1.1, 0.9, 1.5), 0.0) == 4096  # a dip: only past it
    assert _threshold(rows(1.5, 1.1, 0.9), 0.0) == 8192  # slower at the largest: past the ladder
    assert _threshold(rows(1.5, 0.98, 1.2), 0.03) == 1024  # 2% slower is within 3%


def test_calibration_rejects_sizes_that_are_not_whole_rows():
    with pytest.raises(ValueError) as e:
        calibrate_min_fuse_bytes(k=64, sizes=[4096, 1000])
    assert_expected_inline(
        str(e.value),
        """calibrate_min_fuse_bytes: every size must be a positive multiple of one row, k * element size = 256 bytes for k=64 and f32; got sizes=[4096, 1000]""",
    )
