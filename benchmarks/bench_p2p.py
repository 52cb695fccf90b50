"""p2p transport benchmark: RPC latency, call rate, and tensor streaming against raw sockets.

Two processes on loopback: this one calls, a child serves.  The raw-socket baseline moves the same
bytes with ``socket.sendall`` / ``recv_into`` between the same two processes in the same run, so the
ratio is measured side by side.

    python benchmarks/bench_p2p.py [--quick]

Prints a table, then one JSON line of figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import uvloop  # noqa: E402
from _common import Child, fmt, guarded, percentile, print_json, print_table, stop_all  # noqa: E402

from p2p import P2P, CallKind  # noqa: E402

MiB = 1 << 20
ME = [sys.executable, os.path.abspath(__file__)]
LIMIT_S = 300.0  # each part, its child included


# ---- serving side (child process) --------------------------------------------------------------
async def _serve(chunk_mib: int) -> None:
    node = await P2P.create("127.0.0.1", 0)

    async def empty(request, ctx):
        return None

    async def stream(nbytes, ctx):
        chunk = chunk_mib * MiB
        src = np.ones(chunk // 4, dtype=np.float32)
        sent = 0
        while sent < nbytes:
            n = min(chunk, nbytes - sent)
            yield src[: n // 4]
            sent += n

    node.register("empty", empty)
    node.register("stream", stream, CallKind.SERVER_STREAM)
    print(json.dumps({"addr": str(node.address)}), flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_reader(sys.stdin.fileno(), stop.set)  # parent closes stdin: done
    await stop.wait()
    await node.shutdown()


def _serve_raw_main() -> None:
    raw = socket.socket()
    raw.bind(("127.0.0.1", 0))
    raw.listen()
    print(json.dumps({"raw_port": raw.getsockname()[1]}), flush=True)
    _serve_raw(raw)


def _serve_raw(listener: socket.socket) -> None:
    """Each connection asks for N bytes (8-byte header) and gets them with one sendall; N=0 ends."""
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = np.ones(512 * MiB, dtype=np.uint8)
    while True:
        hdr = conn.recv(8, socket.MSG_WAITALL)
        n = int.from_bytes(hdr, "little") if len(hdr) == 8 else 0
        if n == 0:
            break
        conn.sendall(memoryview(payload)[:n])
    conn.close()
    listener.close()


# ---- measuring side ----------------------------------------------------------------------------
def _raw_rate(port: int, nbytes: int, reps: int) -> float:
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = np.empty(nbytes, dtype=np.uint8)
    view = memoryview(buf)
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        s.sendall(nbytes.to_bytes(8, "little"))
        got = 0
        while got < nbytes:
            got += s.recv_into(view[got:], nbytes - got)
        best = max(best, nbytes / MiB / (time.perf_counter() - t0))
    s.sendall((0).to_bytes(8, "little"))
    s.close()
    return best


async def _measure(addr: str, n_calls: int, nbytes: int, reps: int, concurrency: int) -> dict:
    node = await P2P.create(client_mode=True)
    for _ in range(200):  # warm up: connection, handshake, allocator
        await node.call(addr, "empty")
    lat = []
    for _ in range(n_calls):
        t0 = time.perf_counter()
        await node.call(addr, "empty")
        lat.append(time.perf_counter() - t0)

    async def worker(k: int) -> None:
        for _ in range(k):
            await node.call(addr, "empty")

    per = max(n_calls // concurrency, 1)
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(per) for _ in range(concurrency)))
    calls_per_s = per * concurrency / (time.perf_counter() - t0)

    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        got = 0
        async with await node.call_stream(addr, "stream", nbytes, timeout=120) as call:
            async for chunk in call:
                got += chunk.nbytes
        assert got == nbytes, (got, nbytes)
        best = max(best, nbytes / MiB / (time.perf_counter() - t0))
    await node.shutdown()
    return {
        "rtt_p50_us": percentile(lat, 0.5) * 1e6,
        "rtt_p99_us": percentile(lat, 0.99) * 1e6,
        "rtt_mean_us": statistics.fmean(lat) * 1e6,
        "calls_per_s": calls_per_s,
        "stream_mb_s": best,
    }


def measure_rpc(chunk_mib: int, n_calls: int, nbytes: int, reps: int) -> dict:
    server = Child("the serving child", [*ME, "--serve", "--chunk-mib", str(chunk_mib)], quit_line=None)
    try:
        addr = server.recv("addr", time.monotonic() + 60)["addr"]
        return uvloop.run(asyncio.wait_for(_measure(addr, n_calls, nbytes, reps, concurrency=64), LIMIT_S))
    finally:
        stop_all([server], grace=30)


def measure_raw(nbytes: int, reps: int) -> dict:
    server = Child("the raw-socket child", [*ME, "--serve-raw"], stdin=False)
    try:
        port = server.recv("raw_port", time.monotonic() + 60)["raw_port"]
        return {"raw_socket_mb_s": _raw_rate(port, nbytes, reps)}
    finally:
        stop_all([server], grace=30)


def print_figures(figures: dict) -> None:
    rows = [
        ("empty call RTT p50 (us)", figures.get("rtt_p50_us"), "<= 200"),
        ("empty call RTT p99 (us)", figures.get("rtt_p99_us"), ""),
        ("calls/s (64 in flight)", figures.get("calls_per_s"), ""),
        ("stream 256 MiB (MB/s)", figures.get("stream_mb_s"), ""),
        ("raw sendall (MB/s)", figures.get("raw_socket_mb_s"), ""),
        ("stream / raw", figures.get("stream_fraction_of_raw"), ">= 0.60"),
    ]
    print_table(["<28", ">14"], ["figure", "value", "target"], [(name, fmt(v, ".2f"), t) for name, v, t in rows])
    for key, value in figures.items():
        if key.endswith("_error"):
            print(f"{key}: {value}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller run, under 60 s")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-raw", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--chunk-mib", type=int, default=4, help="stream chunk size")
    args = parser.parse_args()
    if args.serve:
        uvloop.run(_serve(args.chunk_mib))
        return
    if args.serve_raw:
        _serve_raw_main()
        return

    n_calls = 5000 if args.quick else 50000
    reps = 3 if args.quick else 7
    nbytes = 256 * MiB
    figures = guarded("p2p", measure_rpc, args.chunk_mib, n_calls, nbytes, reps)
    figures.update(guarded("raw", measure_raw, nbytes, reps))
    if "stream_mb_s" in figures and "raw_socket_mb_s" in figures:
        figures["stream_fraction_of_raw"] = figures["stream_mb_s"] / figures["raw_socket_mb_s"]
    figures.update(quick=args.quick, calls=n_calls, stream_bytes=nbytes, chunk_mib=args.chunk_mib)
    print_figures(figures)
    print_json(figures, digits=3)


if __name__ == "__main__":
    main()
