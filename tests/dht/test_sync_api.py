"""The blocking API (node on a background loop thread) and the `spotswarm dht` command."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dht import DHT, DHTNode
from p2p import P2PError

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parent.parent.parent


def test_blocking_api_between_two_peers():
    threads_before = threading.active_count()
    with DHT() as first, DHT(initial_peers=first.addresses) as second:
        assert first.addresses[0].startswith(str(first.peer_id) + "@")
        assert second.store("k", [1, "two", b"3"], time.time() + 60)
        assert first.get("k").value == [1, "two", b"3"]
        future = second.get("k", return_future=True)
        assert isinstance(future, concurrent.futures.Future)
        assert future.result(timeout=10).value == [1, "two", b"3"]
        assert second.store_many(["a", "b"], [1, 2], time.time() + 60) == [True, True]
        assert {k: v.value for k, v in first.get_many(["a", "b"]).items()} == {"a": 1, "b": 2}

        async def routing_size(node: DHTNode) -> int:
            return len(node.routing)
        assert first.run_coroutine(routing_size) == 1
    assert threading.active_count() == threads_before  # both loop threads joined
    with pytest.raises(RuntimeError, match="shut down"):
        first.get("k")


def test_client_mode_peer_reads_and_writes_but_serves_nothing():
    with DHT() as server, DHT(initial_peers=server.addresses, client_mode=True) as client:
        assert client.addresses == []
        assert client.store("from-client", 42, time.time() + 60)
        assert server.get("from-client").value == 42
        assert len(server.node.routing) == 0  # a client is never a routing contact


def test_unreachable_initial_peers_are_a_clear_error():
    with pytest.raises(Exception, match="none of the 1 initial peers could be reached"):
        DHT(initial_peers=["127.0.0.1:1"], rpc_timeout=2)


def test_cli_bootstrap_node_serves_others_and_stops_cleanly(tmp_path):
    key = tmp_path / "boot.pem"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "orchestrator.cli.main", "dht", "--identity", str(key)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        line = proc.stdout.readline()
        assert line.startswith("DHT peer listening at "), line
        address = line.split()[-1]
        with DHT(initial_peers=[address]) as peer:
            assert peer.store("via-cli", "ok", time.time() + 60)
            assert peer.get("via-cli").value == "ok"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0 and "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # the key file keeps the peer id across restarts
    from p2p import Identity
    assert address.startswith(str(Identity.from_file(key).peer_id))


def test_peers_on_one_borrowed_loop_talk_and_each_shutdown_closes_its_own_node():
    """Many peers of one process may share one event loop (a swarm simulated in few processes)."""
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        first = DHT(loop=loop)
        second = DHT(initial_peers=first.addresses, loop=loop)
        assert second.store("shared", "loop", time.time() + 60)
        assert first.get("shared").value == "loop"
        address = second.addresses[0]
        second.shutdown()
        assert first.get("shared").value == "loop"  # the loop, and the other peer on it, carry on
        with pytest.raises(RuntimeError, match="shut down"):
            second.get("shared")
        with pytest.raises(P2PError):  # its node is closed: nobody listens at its address
            first.run_coroutine(lambda node: node.p2p.connect(address, 2.0))
        first.shutdown()
        assert runner.is_alive()  # the loop is the lender's to stop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(timeout=10)
        loop.close()
