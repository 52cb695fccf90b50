"""``spotswarm token``: membership certificates for volunteers, and a look inside one.

``token issue RUN`` signs a certificate with the run's authority key (in the run directory; for a
run whose head ``up`` launched, given by its YAML on another machine: the key in the run's archive) for
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


def _archived_authority(target: str, run: str):  # noqa: ANN202 - p2p's Authority, imported lazily
    """The authority key of TARGET's run from its archive (``launch/authority.key``, put there by the
    ``up`` that launched its head), or None where TARGET is no YAML or its archive holds none."""
    import tempfile

    from orchestrator.cli.remote import RunNotFound, archive_of
    from orchestrator.config.checks import load_cluster_config
    from orchestrator.runs.durable import ArchiveError
    from p2p.membership import Authority

    if not Path(target).is_file():
        return None
    try:
        key = archive_of(load_cluster_config(target), target).authority_key()
    except (RunNotFound, ArchiveError):
        return None
    if key is None:
        return None
    with tempfile.TemporaryDirectory(prefix="spotswarm-key-") as tmp:
        path = Path(tmp) / "authority.key"
        path.write_bytes(key)
        return Authority.from_file(path, run, create=False)


def _level_flag(run_dir: Path, target: str) -> str:
    """The worker flag a volunteer needs to average with the run's trainers (their byzantine level), if any:
    a peer of another level is dropped from every group by name.  From the run directory's config, else
    from TARGET's YAML (a run whose head is elsewhere)."""
    from orchestrator.config.checks import load_cluster_config
    from orchestrator.runs.store import RunStore

    try:
        level = RunStore.read_config(run_dir).training.byzantine
    except (OSError, ValueError):  # no run directory here
        try:
            level = load_cluster_config(target).training.byzantine if Path(target).is_file() else "off"
        except (OSError, ValueError):  # the level cannot be told
            return ""
    return f" --byzantine {level}" if level != "off" else ""


def issue(args: argparse.Namespace) -> int:
    from orchestrator.fleet.authority import AUTHORITY_FILE, parse_duration, run_authority
    from p2p import Identity, PeerID

    try:
        ttl = parse_duration(args.ttl)
        run_dir, run = _run_dir(args.run)
        authority = run_authority(run_dir, run) if (run_dir / AUTHORITY_FILE).exists() else \
            _archived_authority(args.run, run)
        if authority is None:
            raise ValueError(f"{run_dir} has no {AUTHORITY_FILE}, nor has the run's archive: the run never started "
                             "with membership on")
        if args.peer:
            peer_id, key_path = PeerID.from_string(args.peer), None
        else:
            key_path = Path(args.identity_out or f"{run}-member.key")
            if key_path.exists():
                raise ValueError(f"{key_path} exists; pass --peer with its peer id, or another --identity-out")
            peer_id = Identity.from_file(key_path).peer_id
        cert = authority.issue(peer_id, ttl, roles=tuple(args.role or ["volunteer"]))
    except (OSError, ValueError) as e:
        print(f"spotswarm token issue: {e}", file=sys.stderr)
        return 2
    print(cert.to_token())
    expires = dt.datetime.fromtimestamp(cert.expires, dt.timezone.utc).isoformat(timespec="seconds")
    key_flag = f" --identity {key_path}" if key_path else " --identity <the key of that peer>"
    level = _level_flag(run_dir, args.run)
    print(f"peer {peer_id} is a member of run {run!r} until {expires}; it joins with:\n"
          f"  spotswarm worker --run {run}{key_flag}{level} --membership-token <the token above> "
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
