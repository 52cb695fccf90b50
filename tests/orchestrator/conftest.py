"""The orchestrator tests' fixtures over the fake clouds of ``tests/fakes``: moto (EC2, S3), the fake
IMDS and the proxy in front of moto, the fake Compute Engine API and metadata server, the harnesses
that boot their instances as Ray nodes here, and Ray heads of their own."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest

from orchestrator.host.ray_head import RayHead
from tests.fakes.aws import AwsProxy, FakeImds, moto_server, moto_server_with_auth, reset_moto
from tests.fakes.gce import FakeComputeApi, FakeGceMetadata
from tests.fakes.machines import Ec2Harness, GceHarness
from tests.fakes.servers import LoopServers
from tests.ray_heads import ray_head


# ---- AWS: moto, a proxy in front of it, a fake IMDS, a harness that boots instances -----------------
@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    """moto's server for a test module, on a loopback port; fake credentials in the environment
    (never a real account's).  Its state is reset by ``aws`` for every test."""
    pytest.importorskip("boto3")
    with moto_server() as url:
        yield url


@pytest.fixture
def moto_with_auth() -> Iterator[str]:
    """A moto server that checks credentials (its IAM knows no users, so every key is refused)."""
    with moto_server_with_auth() as url:
        yield url


@pytest.fixture
def aws(moto_endpoint: str) -> str:
    """A fresh moto account for one test: its endpoint URL."""
    reset_moto(moto_endpoint)
    return moto_endpoint


@pytest.fixture
def loop_servers() -> Iterator[LoopServers]:
    with closing(LoopServers()) as servers:
        yield servers


@pytest.fixture
def aws_proxy(aws: str, loop_servers: LoopServers) -> AwsProxy:
    return AwsProxy(loop_servers, aws)


@pytest.fixture
def ec2_harness(aws: str, aws_proxy: AwsProxy, loop_servers: LoopServers, tmp_path: Path) -> Iterator[Ec2Harness]:
    with closing(Ec2Harness(aws, loop_servers, tmp_path / "machines")) as harness:
        aws_proxy.console = harness.console  # EC2's GetConsoleOutput through the proxy: the machine's own
        yield harness


@pytest.fixture
def fake_imds(loop_servers: LoopServers) -> FakeImds:
    return FakeImds(loop_servers, "i-0123456789abcdef0", "us-east-1a")


# ---- Ray heads of their own, as on separate head machines ------------------------------------------
@pytest.fixture
def ray_heads(tmp_path: Path) -> Iterator:
    """Start Ray heads by name (``ray_heads("a")``); every one is killed and cleaned up after the test."""
    pytest.importorskip("ray")
    started: list[RayHead] = []

    def start(name: str) -> RayHead:
        head = ray_head(name, tmp_path / f"ray-head-{name}.log")
        started.append(head)
        return head

    try:
        yield start
    finally:
        for head in started:
            head.close()


# ---- GCE: the Compute Engine v1 REST API, a metadata server, a harness that boots instances ---------
@pytest.fixture
def gce_api(loop_servers: LoopServers) -> FakeComputeApi:
    pytest.importorskip("google.cloud.compute_v1")
    return FakeComputeApi(loop_servers)


@pytest.fixture(scope="module")
def gcs() -> Iterator[str]:
    """Cloud Storage for a test module (gcp-storage-emulator) holding the shipped configs' bucket: its URL."""
    pytest.importorskip("gcsfs")
    pytest.importorskip("gcp_storage_emulator")
    from tests.fakes.gcs import gcs_emulator

    with gcs_emulator("spotswarm-runs") as url:
        yield url


@pytest.fixture
def gce_harness(gce_api: FakeComputeApi, loop_servers: LoopServers, tmp_path: Path) -> Iterator[GceHarness]:
    with closing(GceHarness(gce_api, loop_servers, tmp_path / "machines")) as harness:
        yield harness


@pytest.fixture
def gce_metadata(loop_servers: LoopServers) -> FakeGceMetadata:
    return FakeGceMetadata(loop_servers)
