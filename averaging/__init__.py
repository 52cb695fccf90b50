"""averaging: butterfly all-reduce, load balancing by measured bandwidth, matchmaking over the DHT,
Moshpit All-Reduce and per-tensor compression; the data-parallel core of training."""

from p2p.codecs import Codec

from .allreduce import GroupInfo
from .averager import Averager, DecentralizedAverager, MoshpitAverager, StepResult
from .grouped import GroupedResult, GroupPlan, average_in_groups, quorum_of
from .load_balancing import load_balanced_parts, optimal_shares, part_sizes
from .matchmaking import Planned, ShapeMismatch
from .robust import Byzantine

__all__ = [
    "Averager", "Byzantine", "Codec", "DecentralizedAverager", "GroupInfo", "GroupPlan", "GroupedResult",
    "MoshpitAverager", "Planned", "ShapeMismatch", "StepResult", "average_in_groups", "load_balanced_parts",
    "optimal_shares", "part_sizes", "quorum_of",
]
