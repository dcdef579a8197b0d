"""eagertp: eager-mode micro-pipelined tensor parallelism.

``EagerMicroPipeline`` is a context manager that watches the ATen ops a
tensor-parallel program issues, defers the all-gathers it owns, and issues each
one fused with the matmuls that consume it, so that the matmul on one rank's
chunk overlaps the transfer of the next chunk. No compile step::

    from eagertp import EagerMicroPipeline

    with EagerMicroPipeline() as pipe:
        loss = model(batch).sum()
        loss.backward()
    print(pipe.explain())
"""

from eagertp.backends import BACKENDS, Backend
from eagertp.backends.base import PeerError
from eagertp.pipeline import EagerMicroPipeline, VerificationError

__all__ = ["BACKENDS", "Backend", "EagerMicroPipeline", "PeerError", "VerificationError"]
__version__ = "0.1.0"
