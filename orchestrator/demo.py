"""The embedded demo: several peers on loopback exchange tensors and agree on their exact mean.

It exercises what exists end to end (identities, handshake, multiplexed calls, tensor frames,
streaming) and checks its own result, so a broken install fails loudly.
"""

from __future__ import annotations

import asyncio
import time

import torch
import uvloop
from rich.console import Console
from rich.table import Table

from p2p import P2P, CallKind, spawn_peers


async def _exchange_means(peers: list[P2P], size: int) -> tuple[float, bool]:
    """Every peer fetches every other peer's vector over RPC and averages; returns (seconds, all equal)."""
    vectors = {p.peer_id: torch.randn(size, generator=torch.Generator().manual_seed(i)) for i, p in enumerate(peers)}

    for p in peers:
        async def get_vector(_request, _ctx, me=p):
            return vectors[me.peer_id]
        p.register("demo.vector", get_vector)

    async def mean_at(p: P2P) -> torch.Tensor:
        async def fetch(q: P2P) -> torch.Tensor:
            return vectors[p.peer_id] if q is p else await p.call(q.address, "demo.vector")
        got = await asyncio.gather(*(fetch(q) for q in peers))  # same order everywhere: same float sums
        return torch.stack(got).mean(dim=0)

    t0 = time.perf_counter()
    means = await asyncio.gather(*(mean_at(p) for p in peers))
    elapsed = time.perf_counter() - t0
    return elapsed, all(torch.equal(m, means[0]) for m in means)


async def _stream(src: P2P, dst: P2P, mib: int) -> tuple[float, bool]:
    """Stream a tensor in 4 MiB chunks from dst to src; returns (MB/s, bit-exact)."""
    data = torch.randn(mib * (1 << 20) // 4)
    chunk = (4 << 20) // 4

    async def send_chunks(_request, _ctx):
        for i in range(0, data.numel(), chunk):
            yield data[i:i + chunk]

    dst.register("demo.stream", send_chunks, CallKind.SERVER_STREAM)
    t0 = time.perf_counter()
    async with await src.call_stream(dst.address, "demo.stream", None, timeout=60) as call:
        parts = [part async for part in call]
    elapsed = time.perf_counter() - t0
    return mib / elapsed, torch.equal(torch.cat(parts), data)


async def _main(n: int, mib: int, console: Console) -> bool:
    t0 = time.perf_counter()
    peers = await spawn_peers(n)
    started = time.perf_counter() - t0
    try:
        console.print(f"[bold]{n} peers[/] up in {started * 1e3:.1f} ms, e.g. {peers[0].address}")
        mean_s, equal = await _exchange_means(peers, 1 << 18)
        rate, exact = await _stream(peers[0], peers[-1], mib)
        rtts = []
        for _ in range(500):
            t = time.perf_counter()
            await peers[0].call(peers[1].address, "demo.vector", timeout=5)
            rtts.append(time.perf_counter() - t)
        rtts.sort()
    finally:
        await asyncio.gather(*(p.shutdown() for p in peers))
    table = Table(title="spotswarm p2p demo")
    table.add_column("check")
    table.add_column("result", justify="right")
    table.add_row(f"all-to-all mean of {n} x 1 MiB vectors", f"{mean_s * 1e3:.1f} ms, identical on every peer: {equal}")
    table.add_row(f"stream {mib} MiB tensor", f"{rate:,.0f} MB/s, bit-exact: {exact}")
    table.add_row("1 MiB unary call p50", f"{rtts[len(rtts) // 2] * 1e3:.2f} ms")
    console.print(table)
    return equal and exact


def run_demo(peers: int = 8, tensor_mib: int = 64) -> int:
    console = Console()
    ok = uvloop.run(_main(max(peers, 2), tensor_mib, console))
    console.print("[green]demo passed[/]" if ok else "[red]demo FAILED[/]")
    return 0 if ok else 1
