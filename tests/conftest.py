"""Shared fixtures.  Every test fails if asyncio logged an error (a destroyed pending task, an
unretrieved exception, an unclosed transport): a clean shutdown leaves no traceback."""

from __future__ import annotations

import functools
import importlib.util
import ipaddress
import logging
import os
import socket
import subprocess
from pathlib import Path

import pytest
from hypothesis import settings

from orchestrator.host.wait import wait_for as host_wait_for
from orchestrator.host.wait import wait_for_async

# Token authentication, Ray's default for a local cluster, for every Ray this process starts or joins
# (the shared head, test_chaos's local one): set before Ray is imported, which reads it once.
os.environ.setdefault("RAY_AUTH_MODE", "token")
# Dead nodes declared after three failed health checks a second apart (Ray's default: five, 3 s apart),
# so a module does not wait long for the nodes of the one before to be gone; an answer may take 5 s.
for _key, _value in {"RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_period_ms": "1000",
                     "RAY_health_check_timeout_ms": "5000", "RAY_health_check_failure_threshold": "3"}.items():
    os.environ.setdefault(_key, _value)

# Same examples on every run: a failure found once is found again, and CI never flakes on a draw.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.load_profile("deterministic")

_FOREIGN_NAMES: list[str] = []  # names this process was asked to resolve that are not this machine's


def _resolve_local_only(resolve):
    """Tests talk to loopback and the namespaces they create, never to a cloud: a name that is not this
    machine's (a default endpoint a test forgot to point at its stand-in) is refused, and the test that
    asked fails (``no_foreign_names``) even where the caller retried and carried on without it."""
    local = {"localhost", socket.gethostname()}  # (no getfqdn: a reverse lookup at every start)

    @functools.wraps(resolve)
    def guarded(host, *args, **kwargs):
        name = host.decode() if isinstance(host, bytes) else host
        if name is not None and name not in local and not name.endswith(".localhost"):
            try:
                ipaddress.ip_address(name.split("%")[0])
            except ValueError:
                _FOREIGN_NAMES.append(name)
                raise socket.gaierror(socket.EAI_NONAME, f"tests never resolve {name!r}: use a stand-in") from None
        return resolve(host, *args, **kwargs)
    return guarded


socket.getaddrinfo = _resolve_local_only(socket.getaddrinfo)

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
_wait_for = functools.partial(host_wait_for, every=0.1)


class _ErrorCollector(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(autouse=True)
def no_asyncio_errors():
    collector = _ErrorCollector()
    logger = logging.getLogger("asyncio")
    logger.addHandler(collector)
    try:
        yield collector
    finally:
        logger.removeHandler(collector)
    messages = [r.getMessage() for r in collector.records]
    assert not messages, f"asyncio logged errors: {messages}"


@pytest.fixture(autouse=True)
def no_foreign_names():
    del _FOREIGN_NAMES[:]
    yield
    assert not _FOREIGN_NAMES, f"the test tried to reach {sorted(set(_FOREIGN_NAMES))}, not a local stand-in"


@pytest.fixture
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="session")
def wait_for():
    """``wait_for(predicate, timeout, what)``: poll a condition until it holds (returns as soon as it
    does; never a fixed sleep), a TimeoutError naming ``what`` past ``timeout``."""
    return _wait_for


@pytest.fixture(scope="session")
def until():
    """``wait_for`` for async tests: ``await until(predicate, timeout, what)``; the event loop runs
    between polls."""
    return wait_for_async


def pytest_configure(config: pytest.Config) -> None:
    """The machine's Ray token, made once by the process that starts the others: two test processes
    (the heavy phase runs two) making it at the same moment could each start a Ray with a token that
    the other then replaced."""
    if hasattr(config, "workerinput") or importlib.util.find_spec("ray") is None:
        return  # an xdist worker (its controller made it), or no Ray to test
    from tests.ray_heads import ensure_machine_token

    try:
        ensure_machine_token(dict(os.environ))
    except (OSError, subprocess.SubprocessError):
        pass  # not a reason to stop every test: the Ray tests' heads try again and fail there, saying why


# The longest modules of the heavy phase (half a minute or more each), longest first: handed out first (the
# Makefile turns off xdist's own order, by number of tests), so that its two processes finish together
# instead of one starting a long module as the other runs out of work.
LONGEST_FIRST = ("test_gcp_launch.py", "test_resume.py", "test_aws_launch.py", "test_chaos.py",
                 "test_ray_example_launch.py", "test_collaborative.py", "test_nodes.py")


def _longest_first(item: pytest.Item) -> int:
    name = item.path.name
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules on the shared Ray head run last in each pytest process, one after another: the
    head starts once per process, and no test of that process that starts a Ray of its own runs
    while it is up.  Before them, the longest modules first (``LONGEST_FIRST``)."""
    items.sort(key=lambda item: ("ray_session" in item.fixturenames, _longest_first(item)))  # stable otherwise


@pytest.fixture(scope="session")
def shared_ray_head(tmp_path_factory):
    """One ``ray start --head`` for the modules using ``ray_session``: connecting to it takes a fraction
    of a second, where a local Ray of each module's own took about 5 s and 9 CPU-seconds to start and
    stop."""
    pytest.importorskip("ray")
    from tests.ray_heads import ray_head

    head = ray_head("shared", tmp_path_factory.mktemp("ray") / "head.log", num_cpus=2, own_token=False)
    try:
        yield head
    finally:
        head.close()


@pytest.fixture(scope="module")
def ray_session(request, shared_ray_head):
    """A test module's connection to the shared Ray, in a namespace of its own: its named actors never
    meet another module's, and the actors it owns die when it disconnects.  It starts once the nodes
    of the module before it are marked dead (some had their power cut), so that none of its actors
    lands on one.  Ray is imported only by modules that use it."""
    ray = pytest.importorskip("ray")
    from orchestrator.fleet.ray_session import start_ray

    shared_ray_head.alive()
    start_ray(shared_ray_head.address, namespace=f"spotswarm-{request.module.__name__.rsplit('.', 1)[-1]}")
    _wait_for(lambda: sum(node["Alive"] for node in ray.nodes()) == 1, 60,
              "the nodes of the module before this one to be gone (a module starts on the head alone)")
    yield
    ray.shutdown()


@pytest.fixture
def dht_boot():
    """A DHT peer to join (experts' and the attack suite's tests)."""
    from dht import DHT

    boot = DHT()
    yield boot
    boot.shutdown()


@pytest.fixture
def client_dht(dht_boot):
    from dht import DHT

    d = DHT(initial_peers=dht_boot.addresses, client_mode=True)
    yield d
    d.shutdown()


@pytest.fixture
def start_server(dht_boot):
    """``start_server(backends, **options)``: a server joined to ``dht_boot``'s DHT."""
    from experts import BackgroundExpertServer

    servers: list = []

    def factory(backends, **options) -> BackgroundExpertServer:
        options.setdefault("initial_peers", dht_boot.addresses)
        server = BackgroundExpertServer(backends, **options)
        servers.append(server)
        return server

    yield factory
    for server in reversed(servers):
        server.shutdown()
