"""experts: decentralized mixture-of-experts — expert servers, remote experts with autograd, and a
DMoE layer that finds its experts through the DHT and keeps working when some of them vanish."""

from .backend import ExpertBackend
from .beam_search import FoundExpert, PrefixCache, find_best_experts
from .checkpoints import load_experts, save_experts
from .client import ExpertClient, default_client
from .declare import declare_experts, get_expert_holders, get_experts, withdraw_experts
from .errors import (
    ExpertCallFailed,
    ExpertError,
    ExpertRequestTooLarge,
    ExpertSchemaError,
    NonFiniteValues,
    NotEnoughExperts,
    UnknownExpert,
)
from .grid import expand_pattern, make_uid, parse_uid
from .handoff import ExpertState, fetch_expert_state, load_state_bytes, params_checksum, state_bytes
from .layers import FeedforwardBlock, NopExpert, TransformerBlock, create_expert, expert_kinds, register_expert_class
from .moe import MixtureCallReport, RemoteMixtureOfExperts
from .remote import ExpertInfo, RemoteExpert
from .schema import TensorSchema
from .server import BackgroundExpertServer, ExpertServer
from .trust import AssignedServers, TrustPolicy

__all__ = [
    "AssignedServers", "BackgroundExpertServer", "ExpertBackend", "ExpertCallFailed", "ExpertClient", "ExpertError",
    "ExpertInfo", "ExpertRequestTooLarge", "ExpertSchemaError", "ExpertServer", "ExpertState", "FeedforwardBlock",
    "FoundExpert", "MixtureCallReport", "NonFiniteValues", "NopExpert", "NotEnoughExperts", "PrefixCache",
    "RemoteExpert", "RemoteMixtureOfExperts", "TensorSchema", "TransformerBlock", "TrustPolicy", "UnknownExpert",
    "create_expert", "declare_experts", "default_client", "expand_pattern", "expert_kinds", "fetch_expert_state",
    "find_best_experts", "get_expert_holders", "get_experts", "load_experts", "load_state_bytes", "make_uid",
    "params_checksum", "parse_uid", "register_expert_class", "save_experts", "state_bytes", "withdraw_experts",
]
