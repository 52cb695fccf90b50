"""The ``spotswarm`` command.  Subcommands import what they need lazily, so ``--help`` stays fast."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

# a run read from another machine than its head comes from its archive (checkpoint.uri)
ON_ANY_MACHINE = ("run directory, or cluster YAML (where this machine has no run directory: read from the run's "
                  "archive, checkpoint.uri)")


def _console():
    from rich.console import Console

    return Console()


def _demo(args: argparse.Namespace) -> int:
    from orchestrator.cli.cluster import up

    return up(args.config, args.duration, _console())


def _ray_address(value: str) -> str:
    """argparse type of ``--address``: the rule of the YAML key ``ray.address``."""
    from orchestrator.config.validators import check_ray_address

    try:
        return check_ray_address(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _head_address(value: str) -> str:
    """argparse type of ``--head``: a HOST:PORT that joining nodes dial ("auto" means nothing there)."""
    if value == "auto":
        raise argparse.ArgumentTypeError("'auto' finds a cluster from inside it; a joining node needs HOST:PORT")
    return _ray_address(value)


def _foreground(command: str, target: str, args: argparse.Namespace) -> int:
    """``up`` or ``resume``: a bad config or an unreachable cluster is one clear message, no traceback."""
    from orchestrator.cli import cluster
    from orchestrator.config.schema import ConfigError
    from orchestrator.fleet.ray_session import RayConnectError
    from orchestrator.providers.base import ProviderAuthError
    from orchestrator.runs.durable import ArchiveError

    try:
        extra = {"fresh": args.fresh} if command == "up" else {}
        return getattr(cluster, command)(target, args.duration, _console(), address=args.address,
                                         boot_timeout_s=args.boot_timeout, **extra)
    except ConfigError as e:
        print(f"spotswarm {command}: invalid config, nothing started:\n{e}", file=sys.stderr)
        return 2
    except RayConnectError as e:
        print(f"spotswarm {command}: {e}", file=sys.stderr)
        return 1
    except ProviderAuthError as e:
        print(f"spotswarm {command}: nothing started: {e}", file=sys.stderr)
        return 2
    except cluster.NotStarted as e:
        print(f"spotswarm {command}: {e}; nothing started", file=sys.stderr)
        return 2
    except ArchiveError as e:  # the archive refused (no bucket, access denied) or kept failing
        print(f"spotswarm {command}: {e}", file=sys.stderr)
        return 1


def _up(args: argparse.Namespace) -> int:
    return _foreground("up", args.config, args)


def _resume(args: argparse.Namespace) -> int:
    return _foreground("resume", args.target, args)


def _head_boot(args: argparse.Namespace) -> int:
    from orchestrator.cli.head_boot import boot_head

    return boot_head(args.uri, args.endpoint_url)


def validate(path: str, warnings: list[str] | None = None) -> tuple[bool, str]:
    """Check a cluster YAML as ``up`` would, starting nothing (no Ray, no run directory): whether
    it is valid, and the summary line or every problem.  Warnings go to ``warnings`` if given
    (else to the log); they do not make the file invalid."""
    from orchestrator.config.checks import ConfigError, load_cluster_config

    try:
        config = load_cluster_config(path, warnings)
    except ConfigError as e:
        return False, str(e)
    types = config.available_node_types
    low = sum(t.min_workers for t in config.fleet_types().values())
    return True, (f"{path}: valid (provider {config.provider.type}, mode {config.provider.mode}, "
                  f"{len(types)} node type{'s' if len(types) != 1 else ''}, {low}..{config.max_instances()} instances)")


def _validate(args: argparse.Namespace) -> int:
    warnings: list[str] = []
    ok, text = validate(args.config, warnings)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(text, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 2


def _bootstrap_script(args: argparse.Namespace) -> int:
    from orchestrator.config.checks import ConfigError, load_cluster_config

    try:
        config = load_cluster_config(args.config)
    except ConfigError as e:
        print(f"spotswarm bootstrap-script: invalid config:\n{e}", file=sys.stderr)
        return 2
    if args.node_type not in config.available_node_types:
        known = ", ".join(sorted(config.available_node_types))
        print(f"spotswarm bootstrap-script: {args.config}: no node type {args.node_type!r} in "
              f"available_node_types (known: {known})", file=sys.stderr)
        return 2
    from orchestrator.providers.bootstrap import render_boot_script

    head = args.head if args.head is not None else "<HEAD_ADDRESS>"
    print(render_boot_script(config, args.node_type, head, args.instance_id), end="")
    return 0


def _viewing(command: str, action: Callable[[], int]) -> int:
    """``status``, ``report``, ``dashboard``, ``logs``: a TARGET that names no run, a bad YAML, or an archive
    that cannot be read is one message and exit 2."""
    from orchestrator.cli.remote import RunNotFound
    from orchestrator.config.schema import ConfigError
    from orchestrator.runs.durable import ArchiveError

    try:
        return action()
    except (RunNotFound, ArchiveError, ConfigError) as e:
        print(f"spotswarm {command}: {e}", file=sys.stderr)
        return 2


def _status(args: argparse.Namespace) -> int:
    from orchestrator.cli.cluster import status

    return _viewing("status", lambda: status(args.run, _console()))


def _logs(args: argparse.Namespace) -> int:
    from orchestrator.cli.remote import logs

    return _viewing("logs", lambda: logs(args.run, args.instance, _console()))


def _check(args: argparse.Namespace) -> int:
    """Exit 0: every invariant holds; 1: some do not (each printed); 2: not a run directory."""
    from pathlib import Path

    from orchestrator.runs.figures import is_live
    from orchestrator.runs.invariants import check_run

    run_dir = Path(args.run)
    if not (run_dir / "run.sqlite").exists():
        print(f"spotswarm check: {run_dir} is not a run directory (no run.sqlite)", file=sys.stderr)
        return 2
    live = is_live(run_dir)
    result = check_run(run_dir, stopped=not live, stall_bound_s=args.stall_bound)
    for v in result.violations:
        print(f"{v.invariant}: {v.detail}")
    verdict = "ok" if result.ok else f"{len(result.violations)} violation(s)"
    print(f"{run_dir}: {verdict} ({'live' if live else 'stopped'}; {result.checkpoints} checkpoint(s) load; "
          f"longest wait for an epoch {result.max_stall_s:.1f} s; {result.logs} log file(s) scanned)")
    return 0 if result.ok else 1


def _chaos(args: argparse.Namespace) -> int:
    """Exit 0: every invariant held through every fault; 1: some broke (each printed); 2: cannot start."""
    import signal
    import threading

    from orchestrator.chaos.runner import ChaosError, ChaosRun, ChaosSettings
    from orchestrator.config.checks import load_cluster_config
    from orchestrator.config.schema import ConfigError

    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        config = load_cluster_config(args.config)
        kinds = () if args.kinds == "none" else \
            tuple(k.strip() for k in args.kinds.split(",") if k.strip()) if args.kinds else None
        settings = ChaosSettings(args.duration, seed=args.seed, every_s=args.every, stall_bound_s=args.stall_bound,
                                 aim_s=args.aim,
                                 **({"kinds": kinds} if kinds is not None else {}))
        report = ChaosRun(config, settings, config_path=args.config, stop=stop).run()
    except ConfigError as e:
        print(f"spotswarm chaos: invalid config, nothing started:\n{e}", file=sys.stderr)
        return 2
    except ChaosError as e:
        print(f"spotswarm chaos: {e}", file=sys.stderr)
        return 2
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    from orchestrator.chaos.report import print_report

    print_report(report, _console())
    return 0 if not report.violations else 1


def _dashboard(args: argparse.Namespace) -> int:
    from orchestrator.cli.cluster import dashboard

    return _viewing("dashboard", lambda: dashboard(args.run, args.host, args.port, args.open, _console()))


def _report(args: argparse.Namespace) -> int:
    from orchestrator.cli.cluster import report

    return _viewing("report", lambda: report(args.run, args.out, _console()))


def _down(args: argparse.Namespace) -> int:
    from orchestrator.cli.cluster import down
    from orchestrator.config.schema import ConfigError
    from orchestrator.fleet.ray_session import RayConnectError
    from orchestrator.providers.base import ProviderError
    from orchestrator.runs.durable import ArchiveError

    try:
        return down(args.run, _console(), address=args.address)
    except RayConnectError as e:
        print(f"spotswarm down: {e}", file=sys.stderr)
        return 1
    except (ConfigError, ProviderError, ArchiveError) as e:
        print(f"spotswarm down: {e}", file=sys.stderr)
        return 2


def _runs(args: argparse.Namespace) -> int:
    from orchestrator.cli.cluster import runs

    return runs(args.base, _console())


def _dht(args: argparse.Namespace) -> int:
    from orchestrator.instance.dht_peer import RUN_NAME, run_dht_peer

    if args.run is not None and not RUN_NAME.fullmatch(args.run):
        print(f"spotswarm dht: --run {args.run!r}: a run name has only letters, digits, '_' and '-'", file=sys.stderr)
        return 2
    return run_dht_peer(host=args.host, port=args.port, initial_peers=args.initial_peers, identity_path=args.identity,
                        run=args.run, membership_token=args.membership_token)


def _settings_cli(name: str) -> Any:
    """``worker`` or ``expert_server`` (``instance/``): the command's settings (``FLAGS``) and its ``run``."""
    if name == "expert_server" and "torch" not in sys.modules:
        # idle OpenMP threads sleep, not spin: the experts' torch work shares the cores with the event loop
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return importlib.import_module(f"orchestrator.instance.{name}")


def _run_with_settings(args: argparse.Namespace) -> int:
    """``--config``'s YAML with the flags given over it, then the command; every problem and exit 2 if invalid."""
    from orchestrator.config.loader import ConfigError

    cli = _settings_cli(args.settings)
    try:
        config = cli.FLAGS.load(args.config, vars(args))
    except ConfigError as e:
        print(f"spotswarm {args.command}: invalid config, nothing started:\n{e}", file=sys.stderr)
        return 2
    return cli.run(config)


class _Parser(argparse.ArgumentParser):
    """A sub-command's parser; with ``settings`` (``_settings_cli``), ``--config`` and a flag per field, added
    when it parses: the expert server's settings import torch, which other sub-commands and --help need not
    wait for."""

    def __init__(self, *args: Any, settings: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._settings = settings
        if settings is not None:
            self.add_argument("--config", metavar="YAML", help="settings file")
            self.set_defaults(func=_run_with_settings, settings=settings)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self._settings is not None:
            _settings_cli(self._settings).FLAGS.add_arguments(self)
            self._settings = None
        return super().parse_known_args(args, namespace)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spotswarm", description="Decentralized training on preemptible machines.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    demo = sub.add_parser("demo", help="a few minutes of training on the simulated local spot fleet")
    demo.add_argument("--config", default="cluster_configs/local.yaml", help="cluster YAML (default: local.yaml)")
    demo.add_argument("--duration", type=float, default=150.0, help="seconds to run (default 150)")
    demo.set_defaults(func=_demo)
    upp = sub.add_parser("up", help="start a run from a cluster YAML (foreground; Ctrl-C stops it cleanly); a cloud "
                                    "run naming head_node_type launches its head and is followed from here")
    upp.add_argument("config", help="cluster YAML, e.g. cluster_configs/local.yaml")
    upp.add_argument("--duration", type=float, help="stop after this many seconds")
    upp.add_argument("--address", type=_ray_address, metavar="auto|HOST:PORT",
                     help="join this Ray cluster instead of starting one (overrides ray.address)")
    upp.add_argument("--boot-timeout", type=float, default=900.0, metavar="S",
                     help="a launched head with no word in the archive this long after its launch has failed: "
                          "its console is shown and everything launched terminated (default 900)")
    upp.add_argument("--fresh", action="store_true",
                     help="the run's archive (checkpoint.uri) holds an earlier run of this name: delete it and "
                          "start over (without it, up refuses; resume continues that run)")
    upp.set_defaults(func=_up)
    res = sub.add_parser("resume", help="continue a run after its fleet, supervisor or Ray died")
    res.add_argument("target", metavar="TARGET",
                     help="run directory (e.g. runs/local-demo), or the run's cluster YAML: its run directory, "
                          "restored from checkpoint.uri (S3) first when this machine has none")
    res.add_argument("--duration", type=float, help="stop after this many seconds")
    res.add_argument("--address", type=_ray_address, metavar="auto|HOST:PORT",
                     help="join this Ray cluster instead of starting one (overrides ray.address)")
    res.add_argument("--boot-timeout", type=float, default=900.0, metavar="S",
                     help="a launched head with no word in the archive this long after its launch has failed: "
                          "its console is shown and everything launched terminated (default 900)")
    res.set_defaults(func=_resume)
    hb = sub.add_parser("head-boot", help="what a head launched by `up` runs at boot: takes the run from its archive, "
                                          "starts Ray and the supervisor")
    hb.add_argument("uri", help="the run's archive (checkpoint.uri)")
    hb.add_argument("--endpoint-url", help="the archive's endpoint (checkpoint.endpoint_url)")
    hb.set_defaults(func=_head_boot)
    va = sub.add_parser("validate", help="check a cluster YAML without starting anything")
    va.add_argument("config", help="cluster YAML")
    va.set_defaults(func=_validate)
    bs = sub.add_parser("bootstrap-script", help="print the boot script an instance of a node type runs")
    bs.add_argument("config", help="cluster YAML")
    bs.add_argument("node_type", metavar="NODE_TYPE", help="a key of available_node_types")
    bs.add_argument("--head", type=_head_address, metavar="HOST:PORT",
                    help="the Ray head to join (default: a <HEAD_ADDRESS> placeholder)")
    bs.add_argument("--instance-id", default="<INSTANCE_ID>", metavar="ID",
                    help="the instance's id (default: an <INSTANCE_ID> placeholder)")
    bs.set_defaults(func=_bootstrap_script)
    st = sub.add_parser("status", help="headline figures of a run: throughput, instances, cost, savings")
    st.add_argument("run", metavar="RUN_DIR|CONFIG", help=ON_ANY_MACHINE)
    st.set_defaults(func=_status)
    lg = sub.add_parser("logs", help="the run's log files (the supervisor's, each instance's): list them, or show one")
    lg.add_argument("run", metavar="RUN_DIR|CONFIG", help=ON_ANY_MACHINE)
    lg.add_argument("instance", nargs="?", help="an instance id (or log file name) to show")
    lg.set_defaults(func=_logs)
    ck = sub.add_parser("check", help="check a run's invariants: store consistent, checkpoints load, no stalls, "
                                      "no errors in its logs")
    ck.add_argument("run", help="run directory")
    ck.add_argument("--stall-bound", type=float, metavar="S",
                    help="a violation if no new epoch came for longer than S seconds of the run's clock")
    ck.set_defaults(func=_check)
    ch = sub.add_parser("chaos", help="a local nodes-mode run under injected faults, its invariants checked "
                                      "throughout; the report is <run>/chaos.json and the dashboard's chaos page")
    ch.add_argument("config", help="cluster YAML (local provider, mode nodes, time_scale 1), e.g. "
                                   "cluster_configs/local-chaos.yaml")
    ch.add_argument("--duration", type=float, default=300.0, help="seconds of faults after the first epoch "
                                                                  "(default 300)")
    ch.add_argument("--seed", type=int, default=0, help="draws the faults' moments, kinds and targets (default 0)")
    ch.add_argument("--every", type=float, default=15.0, metavar="S", help="mean seconds between faults (default 15)")
    ch.add_argument("--stall-bound", type=float, default=60.0, metavar="S",
                    help="a violation if no new epoch comes for longer, or if the fleet has not completed two "
                         "epochs this long after the last fault (the run goes on past --duration until it has; "
                         "default 60)")
    ch.add_argument("--kinds", metavar="K1,K2", help="only these fault kinds (default all: worker_kill, node_kill, "
                                                     "supervisor_kill, worker_pause, bandwidth_drop, disk_full, "
                                                     "clock_jump; none: the same run without faults)")
    ch.add_argument("--aim", type=float, default=10.0, metavar="S",
                    help="a fault waits up to S seconds for its target to be in a phase drawn for it (matchmaking, "
                         "all-reduce, state download, checkpoint write, idle); 0: faults land where they fall "
                         "(default 10)")
    ch.set_defaults(func=_chaos)
    db = sub.add_parser("dashboard", help="serve a run's cost and throughput dashboard (live or finished)")
    db.add_argument("run", metavar="RUN_DIR|CONFIG", help=ON_ANY_MACHINE)
    db.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    db.add_argument("--port", type=int, default=8270, help="port to listen on (default 8270; 0: any free port)")
    db.add_argument("--open", action="store_true", help="open it in the default browser")
    db.set_defaults(func=_dashboard)
    rp = sub.add_parser("report", help="write a static HTML report with PNG plots of a run")
    rp.add_argument("run", metavar="RUN_DIR|CONFIG", help=ON_ANY_MACHINE)
    rp.add_argument("--out", metavar="DIR", help="where to write it (default <run>/report; from an archive, "
                                                 "./<cluster>-report)")
    rp.set_defaults(func=_report)
    dn = sub.add_parser("down", help="stop a running run: release every instance, keep its data")
    dn.add_argument("run", metavar="RUN_DIR|CONFIG",
                    help="run directory, or cluster YAML (on another machine than the head: the head is asked "
                         "through checkpoint.uri; a cloud run's tagged instances are terminated too, also when "
                         "no head answers within a minute)")
    dn.add_argument("--address", type=_ray_address, metavar="auto|HOST:PORT",
                    help="the Ray cluster whose detached supervisor runs the run (default: its ray.address)")
    dn.set_defaults(func=_down)
    rn = sub.add_parser("runs", help="list runs")
    rn.add_argument("--base", default="runs", help="runs directory (default runs)")
    rn.set_defaults(func=_runs)
    dht = sub.add_parser("dht", help="run a DHT peer (e.g. a bootstrap node) and print its address")
    dht.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    dht.add_argument("--port", type=int, default=0, help="port to listen on (default: any free port)")
    dht.add_argument("--initial-peers", nargs="*", default=[], metavar="ADDR",
                     help="peers to join through, as host:port or peerid@host:port")
    dht.add_argument("--identity", metavar="PATH", help="private key file; created if missing, keeps the peer id")
    dht.add_argument("--run", metavar="RUN",
                     help="refuse records that break run RUN's key rules (owner signatures are always checked)")
    dht.add_argument("--membership-token", metavar="TOKEN",
                     help="be a member of the token's run (spotswarm token issue; needs --identity with its key)")
    dht.set_defaults(func=_dht)
    sub.add_parser("expert-server", help="host experts for decentralized mixture-of-experts layers",
                   settings="expert_server", description="Settings come from --config (YAML, keys as the flags "
                                                             "with underscores); flags override it.")
    sub.add_parser("worker", help="run one training peer", settings="worker",
                   description="Settings come from --config (YAML, keys as in workers.peer.WorkerConfig); flags "
                               "override it. SIGTERM leaves gracefully.")
    from orchestrator.cli import token as token_cli  # argparse only: its work imports lazily like the rest

    token_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO if args.command == "worker"
                        else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C before a command set up its own stop (its cleanup ran on the way out)
        print(f"spotswarm {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
