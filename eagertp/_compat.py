"""Names that moved between the torch releases eagertp supports (>= 2.11).

Newer torch renames ``*_into_tensor`` / ``*_tensor`` collectives to ``*_single``
and deprecates the old names; use the new one where it exists.
"""

from __future__ import annotations

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
