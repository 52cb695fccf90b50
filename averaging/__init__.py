"""averaging: butterfly all-reduce, load balancing by measured bandwidth, matchmaking over the DHT,
Moshpit All-Reduce and per-tensor compression; the data-parallel core of training."""

from p2p.codecs import Codec

from .allreduce import GroupInfo
from .averager import Averager, DecentralizedAverager, MoshpitAverager, StepResult
from .load_balancing import load_balanced_parts, optimal_shares, part_sizes
from .matchmaking import ShapeMismatch

__all__ = [
    "Averager", "Codec", "DecentralizedAverager", "GroupInfo", "MoshpitAverager", "ShapeMismatch", "StepResult",
    "load_balanced_parts", "optimal_shares", "part_sizes",
]
