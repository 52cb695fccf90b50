"""dht: a Kademlia distributed hash table over the p2p layer.

Peers find each other here with no central server: expert servers declare their experts, averaging
groups meet, training progress is tracked and state donors are found. Records expire, may hold
subkeys merged across writers, and may be signed by their owner.
"""

from .clock import LocalClock, SwarmClock, local_time
from .dht import DHT
from .node import DHTNode
from .records import RecordTooLarge, ValueWithExpiration
from .replicas import ReplicaSets
from .routing import Contact, RoutingTable
from .validation import (
    CompositeValidator,
    DHTRecord,
    KeyRule,
    RecordValidator,
    SchemaValidator,
    SignatureValidator,
    ValidationError,
    default_validators,
    owners_in,
)

__all__ = [
    "DHT", "Contact", "CompositeValidator", "DHTNode", "DHTRecord", "KeyRule", "LocalClock", "RecordTooLarge",
    "RecordValidator", "ReplicaSets", "RoutingTable", "SchemaValidator", "SignatureValidator", "SwarmClock",
    "ValidationError", "ValueWithExpiration", "default_validators", "local_time", "owners_in",
]
