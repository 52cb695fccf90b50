"""``spotswarm token``: membership certificates for volunteers, and a look inside one.

``token issue RUN`` signs a certificate with the run's authority key (in the run directory) for
a peer id, or for a fresh identity it writes next to the token, and prints the flags the
volunteer's ``spotswarm worker`` takes.  The token carries no secret: it is useless without the
private key of the peer it names.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path


def _run_dir(target: str) -> tuple[Path, str]:
    """The run directory and run name of RUN (a run directory, or the run's cluster YAML)."""
    from orchestrator.config.checks import load_cluster_config
    from orchestrator.runs.store import RunStore

    path = Path(target)
    if path.is_file():
        config = load_cluster_config(target)
        return config.run_dir(), config.cluster_name
    if not (path / "config.yaml").exists():
        raise ValueError(f"{target}: no such run directory or cluster YAML")
    return path, RunStore.read_config(path).cluster_name


def _level_flag(run_dir: Path) -> str:
    """The worker flag a volunteer needs to average with the run's trainers (their byzantine level), if any:
    a peer of another level is dropped from every group by name."""
    from orchestrator.runs.store import RunStore

    try:
        level = RunStore.read_config(run_dir).training.byzantine
    except (OSError, ValueError):  # a run directory without its config: the level cannot be told
        return ""
    return f" --byzantine {level}" if level != "off" else ""


def issue(args: argparse.Namespace) -> int:
    from orchestrator.fleet.authority import AUTHORITY_FILE, parse_duration, run_authority
    from p2p import Identity, PeerID

    try:
        ttl = parse_duration(args.ttl)
        run_dir, run = _run_dir(args.run)
        if not (run_dir / AUTHORITY_FILE).exists():
            raise ValueError(f"{run_dir} has no {AUTHORITY_FILE}: the run never started with membership on")
        if args.peer:
            peer_id, key_path = PeerID.from_string(args.peer), None
        else:
            key_path = Path(args.identity_out or f"{run}-member.key")
            if key_path.exists():
                raise ValueError(f"{key_path} exists; pass --peer with its peer id, or another --identity-out")
            peer_id = Identity.from_file(key_path).peer_id
        cert = run_authority(run_dir, run).issue(peer_id, ttl, roles=tuple(args.role or ["volunteer"]))
    except (OSError, ValueError) as e:
        print(f"spotswarm token issue: {e}", file=sys.stderr)
        return 2
    print(cert.to_token())
    expires = dt.datetime.fromtimestamp(cert.expires, dt.timezone.utc).isoformat(timespec="seconds")
    key_flag = f" --identity {key_path}" if key_path else " --identity <the key of that peer>"
    print(f"peer {peer_id} is a member of run {run!r} until {expires}; it joins with:\n"
          f"  spotswarm worker --run {run}{key_flag}{_level_flag(run_dir)} --membership-token <the token above> "
          "--initial-peers ...",
          file=sys.stderr)
    return 0


def show(args: argparse.Namespace) -> int:
    from p2p.membership import Certificate

    try:
        cert = Certificate.from_token(args.token)
    except ValueError as e:
        print(f"spotswarm token show: {e}", file=sys.stderr)
        return 2
    expires = dt.datetime.fromtimestamp(cert.expires, dt.timezone.utc).isoformat(timespec="seconds")
    print(f"run:       {cert.run}\npeer:      {cert.peer_id}\nroles:     {', '.join(cert.roles) or '-'}\n"
          f"expires:   {expires}\nauthority: {cert.authority.hex()}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    tok = sub.add_parser("token", help="membership certificates of a run (volunteers join with one)")
    tsub = tok.add_subparsers(dest="token_command", required=True)
    iss = tsub.add_parser("issue", help="sign a certificate with the run's authority key")
    iss.add_argument("run", metavar="RUN", help="run directory, or the run's cluster YAML")
    iss.add_argument("--ttl", default="24h", help="lifetime: seconds, or 90s / 15m / 12h / 7d (default 24h)")
    iss.add_argument("--peer", metavar="PEER_ID", help="the member's peer id (default: make a new identity)")
    iss.add_argument("--identity-out", metavar="PATH",
                     help="where the new identity's private key goes (default ./<run>-member.key)")
    iss.add_argument("--role", action="append", metavar="ROLE", help="a role written into the certificate "
                     "(repeatable; default volunteer)")
    iss.set_defaults(func=issue)
    sh = tsub.add_parser("show", help="print what a token says (run, peer, roles, expiry)")
    sh.add_argument("token")
    sh.set_defaults(func=show)
