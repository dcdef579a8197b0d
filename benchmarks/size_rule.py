"""The size rule's thresholds, measured here: ``eagertp.calibrate`` on gloo ranks.

    python benchmarks/size_rule.py                     # plain loopback
    python benchmarks/size_rule.py --link-rate 2gbit   # wire-limited loopback

Prints, per kind and bytes per rank, the op issued as written against fused,
and the threshold that follows; compare it with ``eagertp.backends.MIN_FUSE_BYTES``.
"""

from __future__ import annotations

import argparse
import sys

import _harness


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/size_rule.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _harness.add_common_args(parser)
    parser.set_defaults(repeats=9)
    parser.add_argument("--k", type=int, default=1024, help="row length (and the matmul's K = N)")
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[1 << p for p in range(14, 23)], help="bytes per rank to measure"
    )
    return parser.parse_args(argv)


def _worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    import dataclasses

    from eagertp.calibrate import calibrate_min_fuse_bytes

    cal = calibrate_min_fuse_bytes(k=args.k, sizes=args.sizes, repeats=args.repeats, warmup=args.warmup)
    return {**dataclasses.asdict(cal), "render": cal.render()}


def main(argv=None) -> int:
    args = parse_args(argv)
    with _harness.quiet_warnings():
        result = _harness.run(args, _worker)
    print(f"gloo on {_harness.link_name(args)}, {args.world_size} ranks")
    print(result.pop("render"))
    _harness.write_json(args.json, {"link": _harness.link_name(args), **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
