"""The DHT keys of a training run and what each may hold: the one list every node of a run installs.

A DHT replica stores whatever it is sent; only a rule refuses a plain value over a shared
dictionary, an unsigned subkey where each peer owns its own, or a value readers would choke on.
The keys are written all over the layers (progress and state hand-off here in ``workers/``,
matchmaking in ``averaging/``, expert records in ``experts/``), so their rules are gathered here,
and ``run_validators`` is what a worker, the supervisor and a ``spotswarm dht --run`` bootstrap
peer pass to their DHT.  A change to what a writer stores must be mirrored here.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pydantic

from dht import KeyRule, RecordValidator, SchemaValidator, SignatureValidator
from experts.grid import DELIMITER, parse_uid
from p2p import Identity

from .progress import PeerProgress
from .progress_tree import ProgressSummary


class ProgressRecord(PeerProgress):
    """A ``<run>.progress`` value: a ``PeerProgress`` whose rates and times are finite numbers
    (an infinite throughput would make every reader think the global batch is already full)."""

    samples_per_second: float = pydantic.Field(ge=0, allow_inf_nan=False)
    time: float = pydantic.Field(allow_inf_nan=False)


class ProgressSummaryRecord(ProgressSummary):
    """A summary under a progress key: a ``ProgressSummary`` with no other fields (padding)."""

    model_config = pydantic.ConfigDict(extra="forbid")


class StateAdvert(pydantic.BaseModel):
    """A ``<run>.state`` value (``workers/state.py`` StateSharer.advertise): a donor's epoch and address."""

    epoch: int = pydantic.Field(ge=0)
    a: str


class MatchmakingDeclaration(pydantic.BaseModel):
    """A ``<prefix>.mm.<group key>`` value (``averaging/matchmaking.py`` Matchmaker.form_group)."""

    model_config = pydantic.ConfigDict(allow_inf_nan=False)

    a: str | None  # the address to join at; None for a peer that cannot lead
    t: float  # when it started looking
    bw: float = pydantic.Field(0.0, ge=0)
    h: str = ""  # hash of its tensors' schema
    g: int | None = pydantic.Field(None, ge=0)  # in a ``declare_gone`` record: the unit below that will not come


def _is_expert_uid(key: str) -> bool:
    try:
        parse_uid(key)
    except ValueError:
        return False
    return True


def _is_expert_prefix(key: str) -> bool:
    return key.endswith(DELIMITER) and _is_expert_uid(key + "0")


def expert_rules(exclude: Callable[[str], bool] = lambda key: False) -> list[KeyRule]:
    """``experts/declare.py``: ``name.i.j`` holds one subkey per holder (its address -> the same
    address), and ``name.`` / ``name.i.`` hold the next coordinates.  Keys ``exclude`` accepts are
    someone else's even if they look like expert names."""
    return [
        KeyRule.where(lambda key: _is_expert_uid(key) and not exclude(key), "expert uids",
                      dictionary=True, subkey=str, value=str, allow_none=True),
        KeyRule.where(lambda key: _is_expert_prefix(key) and not exclude(key), "expert grid prefixes",
                      dictionary=True, subkey=int, value=str, allow_none=True),
    ]


def run_rules(run: str, signed_matchmaking: bool = False) -> list[KeyRule]:
    """Every key of run ``run``: progress (``<run>.progress`` and, in a large run, the tree of keys
    under it: records and summaries) and state adverts (signed subkeys, one per peer), the
    averagers' matchmaking keys (``<run>_grad.mm.e<epoch>``, ``<run>_params.mm.d<dim>:<coords>``)
    and expert records."""
    owned = dict(dictionary=True, subkey=str, owned_subkeys=True, allow_none=True)
    matchmaking = re.compile(rf"{re.escape(run)}_[A-Za-z0-9_-]+\.mm\..+")
    progress = re.compile(rf"{re.escape(run)}\.progress(\.[0-9]+)*")
    state = re.compile(rf"{re.escape(run)}\.state(\.[0-9]+)*")
    rules = [
        KeyRule.regex(progress.pattern, f"progress keys of run {run!r}", value=ProgressRecord | ProgressSummaryRecord,
                      **owned),
        KeyRule.regex(state.pattern, f"state advert keys of run {run!r}", value=StateAdvert, **owned),
        KeyRule.regex(matchmaking.pattern, f"matchmaking keys of run {run!r}", dictionary=True, subkey=str,
                      value=MatchmakingDeclaration, allow_none=True),
        # a group key may be a number, and a progress or state key looks like an expert's name
        *expert_rules(exclude=lambda key: any(r.fullmatch(key) is not None for r in (matchmaking, progress, state))),
    ]
    if signed_matchmaking:  # trainers that do not trust each other: one signed declaration per member and key
        rules.append(KeyRule.regex(rf"{re.escape(run)}_(grad|params)\.mm\..+",
                                   f"signed matchmaking keys of run {run!r}", value=MatchmakingDeclaration, **owned))
    return rules


def run_validators(run: str, identity: Identity, byzantine: str = "off") -> list[RecordValidator]:
    """The validators of every DHT node of ``run``: owner signatures (made with ``identity``), the run's key
    rules; a run whose trainers do not trust each other (``byzantine`` clip or verify) takes only signed
    matchmaking declarations for their groups."""
    return [SignatureValidator(identity), SchemaValidator(rules=run_rules(run, byzantine != "off"))]
