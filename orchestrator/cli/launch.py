"""``spotswarm up CONFIG`` (and ``resume CONFIG``) from a machine outside the cloud, a laptop: the head is
launched too, as Ray's ``ray up`` does, and the run followed from here with no port open on the head.

The laptop checks what it can (credentials, the archive, no head of the run up already), puts the config
and the run's authority key in the run's archive (``launch/``), and launches the head from
``head_node_type`` on demand, tagged with the run.  The head's boot script (``render_head_script``) runs
the config's boot commands and then ``spotswarm head-boot`` (``cli/head_boot.py``), which takes the launch
from the archive and starts the Ray head and the supervisor there.  Until the head's first status
document arrives, the laptop reads the head's console: a boot that fails (a setup command, the head's own
start) or never comes is shown with the console's end, and everything launched is terminated.
"""

from __future__ import annotations

import secrets
import socket
import tempfile
import threading
import time
from pathlib import Path

import yaml
from rich.console import Console

from orchestrator.cli.refusals import NotStarted, ResumeError, refuse_archived_run
from orchestrator.config.checks import load_cluster_config
from orchestrator.config.schema import ClusterConfig
from orchestrator.config.tags import INSTANCE_TAG, NODE_TYPE_TAG, RUN_TAG
from orchestrator.fleet.registry import terminate_cloud_run
from orchestrator.fleet.zones import ZoneChoice
from orchestrator.providers.base import CapacityError, LaunchSpec, ProviderError
from orchestrator.providers.bootstrap import BOOT_FAILED, render_head_script
from orchestrator.providers.cloud import CloudProvider, Machine
from orchestrator.runs.durable import ArchiveError, RunArchive

BOOT_TIMEOUT_S = 900.0  # a head with no word in its archive this long after launch is taken for failed
FRESH_S = 60.0  # a status document younger than this means a head is running the run
POLL_S = 2.0
CONSOLE_POLL_S = 10.0  # the head's console is read this often while it boots, every POLL_S in its first half minute
PROGRESS_EVERY_S = 60.0  # a line of progress at least this often while nothing else changes
CONSOLE_TAIL_LINES = 40


def launches_head(config: ClusterConfig, address: str | None) -> bool:
    """Whether ``up``/``resume`` launches the head: a cloud run naming ``head_node_type``, without ``--address``
    (the user brings their own head) or ``ray.address``."""
    return (config.provider.type in ("aws", "gcp") and config.head_node_type is not None
            and address is None and config.ray.address is None)


def default_archive_uri(config: ClusterConfig) -> str:
    """Where a launched run keeps its archive when ``checkpoint.uri`` is left out (a Ray YAML has none): a
    bucket of the account's (S3: ``spotswarm-<account>-<region>``; Cloud Storage: ``spotswarm-<project>``),
    the run under its name."""
    if config.provider.type == "gcp":
        return f"gs://spotswarm-{config.provider.project}/{config.cluster_name}"
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        sts = boto3.client("sts", region_name=config.provider.region, endpoint_url=config.provider.endpoint_url)
        account = sts.get_caller_identity()["Account"]
    except (BotoCoreError, ClientError) as e:
        raise NotStarted(f"checkpoint.uri is left out, and the account for its default bucket could not be "
                         f"found ({e}): set checkpoint.uri") from None
    return f"s3://spotswarm-{account}-{config.provider.region}/{config.cluster_name}"


def check_default_bucket_owned(config: ClusterConfig, provider: CloudProvider, archive: RunArchive) -> None:
    """A default bucket's name is predictable, and bucket names are global (S3's and Cloud Storage's alike):
    one someone else made first (and left writable) would take the run's archive and its authority key.
    Refused unless this account (S3) or the run's project (Cloud Storage) owns it."""
    bucket = archive.bucket
    if config.provider.type == "gcp":
        from orchestrator.providers.gcp import GcpProvider

        assert isinstance(provider, GcpProvider)
        try:
            ours, owner = provider.project_number(), archive.gcs_project_number()
        except (ProviderError, ArchiveError) as e:
            raise NotStarted(f"the default archive bucket {bucket}'s owner could not be checked ({e}): set "
                             "checkpoint.uri to a bucket of yours") from None
        if owner != ours:
            raise NotStarted(f"the default archive bucket {bucket} belongs to project number {owner or '?'}, not "
                             f"to {config.provider.project} ({ours}): set checkpoint.uri to a bucket of yours")
        return
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    account = bucket.split("-")[1]  # spotswarm-<account>-<region>: an account id is 12 digits
    try:
        boto3.client("s3", region_name=config.provider.region, endpoint_url=config.checkpoint.endpoint_url) \
            .head_bucket(Bucket=bucket, ExpectedBucketOwner=account)
    except (BotoCoreError, ClientError) as e:
        raise NotStarted(f"the default archive bucket {bucket} is not this account's ({e}): set checkpoint.uri "
                         "to a bucket of yours") from None


def with_archive(config: ClusterConfig) -> ClusterConfig:
    """The config with its archive: ``checkpoint.uri`` as given, else the default (``default_archive_uri``)."""
    if config.checkpoint.uri:
        return config
    checkpoint = config.checkpoint.model_copy(update={"uri": default_archive_uri(config)})
    return config.model_copy(update={"checkpoint": checkpoint})


def launch_yaml(config_path: str, config: ClusterConfig) -> str:
    """The YAML the head runs: the user's file, with the default archive written in where it had none."""
    text = Path(config_path).read_text()
    data = yaml.safe_load(text)
    if isinstance(data, dict) and not (data.get("checkpoint") or {}).get("uri"):
        data["checkpoint"] = {**(data.get("checkpoint") or {}), "uri": config.checkpoint.uri}
        return yaml.safe_dump(data, sort_keys=False)
    return text


def check_launchable(config: ClusterConfig) -> None:
    assert config.checkpoint.uri is not None
    if config.checkpoint.uri.startswith("/"):
        raise NotStarted(f"checkpoint.uri {config.checkpoint.uri} is a path on this machine, which the launched "
                         "head cannot read: use s3:// or gs://")


def new_authority_key() -> bytes:
    """A fresh authority key (PEM): made here, it reaches the head through the archive only."""
    from p2p.identity import Identity

    with tempfile.TemporaryDirectory(prefix="spotswarm-key-") as tmp:
        path = Path(tmp) / "authority.key"
        Identity.from_file(path)
        return path.read_bytes()


def refuse_if_head_up(config: ClusterConfig, config_path: str, provider: CloudProvider, archive: RunArchive,
                      command: str, console: Console) -> None:
    """A second ``up`` of a run whose head runs (or boots) is refused, as is a ``resume`` while a head runs
    the run: a launched head the cloud still runs, or one the cloud does not know (brought by the user)
    that published within a minute.  ``resume`` terminates a launched head that stopped publishing: it is
    lost, and a new one takes over."""
    heads = provider.heads()
    doc = archive.status()
    age = time.time() - float(doc.get("published_at", 0.0)) if doc else None
    fresh = doc is not None and age is not None and age < FRESH_S and doc.get("state") != "stopped"
    launched = doc.get("head_instance") if doc else None
    running = {m.tags.get(INSTANCE_TAG) for m in heads}
    publishing = fresh and (launched is None or launched in running)  # a launched head the cloud ended is lost
    names = ", ".join(f"{m.handle} ({m.state})" for m in heads)
    if command == "up" and (heads or publishing):
        raise NotStarted(f"run {config.cluster_name} is already up" + (f" (head {names})" if heads else
                         f" (its head published {age:.0f} s ago)") + f": watch it with `spotswarm status "
                         f"{config_path}`, stop it with `spotswarm down {config_path}`")
    if command == "resume" and publishing:
        raise NotStarted(f"run {config.cluster_name}'s head published {age:.0f} s ago: it is up; stop it with "
                         f"`spotswarm down {config_path}` first")
    last_word = float(doc.get("published_at", 0.0)) if doc else 0.0
    booting = [m for m in heads if m.created > last_word]
    if command == "resume" and booting:
        raise NotStarted(f"a head of run {config.cluster_name} is booting ({booting[0].handle}, launched "
                         f"{time.time() - booting[0].created:.0f} s ago); stop it with `spotswarm down {config_path}`")
    for machine in heads:  # resume: a head that stopped publishing is lost
        console.print(f"terminating {machine.handle}, a head of the run that no longer publishes")
        provider.release_head(machine)


def launch_head(config: ClusterConfig, provider: CloudProvider, head_id: str) -> Machine:
    """The head, on demand, in the first zone with capacity; its machine as the cloud lists it."""
    head = config.head_node_type
    assert head is not None
    archive_uri, endpoint = config.checkpoint.uri, config.checkpoint.endpoint_url
    assert archive_uri is not None
    script = render_head_script(config, archive_uri, endpoint)
    tags = {RUN_TAG: config.cluster_name, INSTANCE_TAG: head_id, NODE_TYPE_TAG: head}
    zones = ZoneChoice(config, provider).zones(head)  # where the fleet's launches of that type would go
    if not zones:
        raise NotStarted(f"no zone to launch the head ({head}) in: set provider.zones")
    refused = []
    for zone in zones:
        spec = LaunchSpec(head_id, head, zone, "on-demand", tags, dict(config.available_node_types[head].node_config),
                          boot_script=script)
        try:
            instance = provider.launch(spec)
            break
        except CapacityError as e:
            refused.append(f"{zone}: {e}")
        except ProviderError as e:
            raise NotStarted(f"the head could not be launched: {e}") from None
    else:
        raise NotStarted("no zone had capacity for the head: " + "; ".join(refused))
    listed = {m.handle: m for m in provider.heads()}
    return listed.get(instance.handle) or Machine(instance.handle, tags, instance.zone, False, time.time())


def launch(config_path: str, duration: float | None, console: Console, command: str = "up",
           boot_timeout_s: float = BOOT_TIMEOUT_S, stop: threading.Event | None = None, fresh: bool = False) -> int:
    """Launch the run's head and follow the run until it stops (0; 2 when the head never booted, everything
    launched then terminated).  ``stop`` (Ctrl-C) ends the following only: the run goes on."""
    from orchestrator.fleet.registry import make_provider

    config = load_cluster_config(config_path)
    with tempfile.TemporaryDirectory(prefix="spotswarm-laptop-") as tmp:
        provider = make_provider(config, time.time, Path(tmp))  # refused credentials: ProviderAuthError here
    assert isinstance(provider, CloudProvider)
    try:
        given = config.checkpoint.uri is not None
        config = with_archive(config)
        check_launchable(config)
        archive = RunArchive.for_config(config)
        assert archive is not None
        if not given:
            created = archive.ensure_bucket(config.provider.region) if command == "up" else False
            check_default_bucket_owned(config, provider, archive)
            console.print(f"the run's archive: {archive.uri} (checkpoint.uri left out: the default"
                          f"{', its bucket created' if created else ''})", soft_wrap=True)
        try:
            archive.check_writable()
        except ArchiveError as e:
            raise NotStarted(f"checkpoint.uri cannot take the run's archive: {e}") from None
        refuse_if_head_up(config, config_path, provider, archive, command, console)
        if command == "up":
            refuse_archived_run(archive, config.cluster_name, config_path, fresh, console)
        key = None
        if command == "resume":
            if not archive.has_history():
                raise ResumeError(f"{config_path}: nothing archived at {archive.uri} to resume")
            key = archive.authority_key()  # a resumed run keeps its authority: volunteers' tokens stay valid
        head_id = f"head-{secrets.token_hex(3)}"
        launched_at = time.time()
        archive.write_launch({"command": command, "config_yaml": launch_yaml(config_path, config), "duration": duration,
                              "head": head_id, "at": launched_at, "by": socket.gethostname()},
                             key or new_authority_key())
        machine = launch_head(config, provider, head_id)
        _print_launched(config, config_path, machine, console)
        return follow(config, config_path, provider, archive, machine, launched_at, console, boot_timeout_s,
                      stop or threading.Event())
    finally:
        provider.shutdown()


def _print_launched(config: ClusterConfig, config_path: str, machine: Machine, console: Console) -> None:
    head = config.head_node_type
    node_type = config.available_node_types[head] if head else None
    kind = (node_type.node_config.get("InstanceType") or node_type.node_config.get("machineType")) if node_type else ""
    console.print(f"head {machine.tags.get(INSTANCE_TAG)} launched: {machine.handle} "
                  f"({machine.address or 'address pending'}), {machine.zone}, {kind} on demand", soft_wrap=True)
    for what, line in (("watch", f"spotswarm status {config_path}"),
                       ("dashboard", f"spotswarm dashboard {config_path}"),
                       ("logs", f"spotswarm logs {config_path} [INSTANCE]"), ("stop", f"spotswarm down {config_path}")):
        console.print(f"  {what + ':':<11}{line}", soft_wrap=True, highlight=False)
    console.print("following the run (Ctrl-C stops following; the run goes on)")


def follow(config: ClusterConfig, config_path: str, provider: CloudProvider, archive: RunArchive, machine: Machine,
           launched_at: float, console: Console, boot_timeout_s: float, stop: threading.Event) -> int:
    """The run as its head publishes it, a line per change; before the head's first word, its console."""
    booted_at: float | None = None
    shown, shown_at = ("", None), 0.0
    console_read = 0.0
    lost_warned = False
    unreadable = ""
    while not stop.is_set():
        try:
            doc = archive.status()
            unreadable = ""
        except ArchiveError as e:
            if str(e) != unreadable:  # said once, not every poll
                console.print(f"cannot read {archive.uri} now: {e}", soft_wrap=True)
            unreadable, doc = str(e), None
        # this head's word: told by its id, not by comparing its clock with ours
        mine = doc is not None and doc.get("head_instance") == machine.tags.get(INSTANCE_TAG)
        if mine:
            assert doc is not None
            if booted_at is None:
                booted_at = time.time()
                console.print(f"the head is up {booted_at - launched_at:.0f} s after launch: Ray and the supervisor "
                              "run there")
            what = (doc.get("state"), doc.get("live"))
            if what != shown or time.monotonic() - shown_at >= PROGRESS_EVERY_S:  # the epoch alone: once a minute
                console.print(f"{doc.get('state')}: epoch {doc.get('epoch')}, {doc.get('live')} instances live, "
                              f"{doc.get('training', '?')} of them training")
                shown, shown_at = what, time.monotonic()
            if doc.get("state") == "stopped":
                console.print("the run stopped; its head releases itself")
                return 0
            age = time.time() - float(doc.get("published_at", 0.0))
            if age > 2 * FRESH_S and not lost_warned:
                lost_warned = True
                console.print(f"the head has not published for {age:.0f} s; if it is lost, `spotswarm resume "
                              f"{config_path}` launches a new one from the archive", soft_wrap=True)
        elif booted_at is None and time.monotonic() - console_read >= _console_every(time.time() - launched_at):
            console_read = time.monotonic()
            failure = _boot_failure(provider, machine, launched_at, boot_timeout_s)
            if failure is not None:
                return _failed(config, machine, failure, console)
        stop.wait(POLL_S)
    console.print(f"stopped following; the run goes on (`spotswarm down {config_path}` stops it)", soft_wrap=True)
    return 0


def _console_every(since_launch_s: float) -> float:
    """A boot command fails in its first seconds as often as not: the console is read often then."""
    return POLL_S if since_launch_s < 30.0 else CONSOLE_POLL_S


def _boot_failure(provider: CloudProvider, machine: Machine, launched_at: float,
                  boot_timeout_s: float) -> tuple[str, str] | None:
    """Why the head's boot failed, with its console, or None while it may still come up."""
    try:
        output = provider.console_output(machine)
    except ProviderError as e:
        output = f"(its console output could not be read: {e})"
    failed = [line for line in output.splitlines() if line.startswith(BOOT_FAILED)]
    if failed:
        return failed[-1][len(BOOT_FAILED):].lstrip(": "), output
    if machine.handle not in {m.handle for m in provider.heads()}:
        return "the head machine stopped running before it booted", output
    if time.time() - launched_at > boot_timeout_s:
        return f"no word from the head in its archive within {boot_timeout_s:.0f} s of its launch", output
    return None


def _failed(config: ClusterConfig, machine: Machine, failure: tuple[str, str], console: Console) -> int:
    reason, output = failure
    console.print(f"[bold red]the head did not boot:[/] {reason}", soft_wrap=True)
    tail = output.splitlines()[-CONSOLE_TAIL_LINES:]
    if tail:
        console.print(f"the end of its console output ({machine.handle}):")
        for line in tail:
            console.print(f"  {line}", soft_wrap=True, markup=False, highlight=False)
    ids = terminate_cloud_run(config)
    console.print(f"terminated what the run had launched: {', '.join(ids) or 'nothing left'}", soft_wrap=True)
    return 2
