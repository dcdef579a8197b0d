"""eagertp: eager-mode micro-pipelined tensor parallelism.

``EagerMicroPipeline`` is a context manager that watches the ATen ops a
tensor-parallel program issues (a ``TorchDispatchMode``). Each all-gather,
reduce-scatter or all-reduce on a group it manages starts where the program
issues it; the matmuls around it are deferred and run fused with it, so that
the matmul on one rank's chunk overlaps the transfer of the next chunk. No
compile step::

    from eagertp import EagerMicroPipeline

    with EagerMicroPipeline(group=tp_group) as pipe:
        loss = model(batch).sum()
        loss.backward()
    print(pipe.explain())

``python -m eagertp.info`` prints what a bug report needs.
"""

from eagertp.backends import BACKENDS, Backend
from eagertp.backends.base import PeerError
from eagertp.calibrate import Calibration, calibrate_min_fuse_bytes
from eagertp.pipeline import EagerMicroPipeline, VerificationError

__all__ = [
    "BACKENDS", "Backend", "Calibration", "EagerMicroPipeline", "PeerError", "VerificationError",
    "calibrate_min_fuse_bytes",
]
__version__ = "0.1.0"
