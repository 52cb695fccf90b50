"""Processes of ``bench_moe.py``: an expert server and a client, plus the local baseline it runs itself.

``bench_moe.py`` forks them (``multiprocessing`` "fork" context) before it runs any torch work, so
they start in milliseconds with torch already imported.  Each talks to the parent over a
``multiprocessing`` pipe: the server sends its address, serves until it receives ``None``, and sends
its batching stats; a client answers commands (``connect``, ``setup``: build remote experts and warm
up, ``run``: the timed loop, ``rtt``: empty round trips) one reply each, until ``None``.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import sys
import time
from multiprocessing.connection import Connection

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import uvloop  # noqa: E402
from _common import percentile  # noqa: E402

from experts import ExpertBackend, ExpertClient, ExpertServer, RemoteExpert, create_expert  # noqa: E402


# ---- server ------------------------------------------------------------------------------------
def serve_process(conn: Connection, cases: list[dict], nop_hidden: int = 256, batch_timeout: float = 0.0) -> None:
    """Hosts every case's experts (``<case>.<i>``, ffn, Adam) and ``nop.0``."""
    uvloop.run(_serve(conn, cases, nop_hidden, batch_timeout))


async def _serve(conn: Connection, cases: list[dict], nop_hidden: int, batch_timeout: float) -> None:
    torch.manual_seed(0)
    backends = []
    for case in cases:
        backends += [ExpertBackend.from_kind(f"{case['name']}.{i}", "ffn", case["hidden"],
                                             optimizer=lambda p: torch.optim.Adam(p),
                                             max_batch_size=case["max_batch_size"]) for i in range(case["experts"])]
    backends.append(ExpertBackend.from_kind("nop.0", "nop", nop_hidden))
    server = await ExpertServer.create(backends, batch_timeout=batch_timeout)
    conn.send({"addr": server.address})
    stop = asyncio.Event()
    asyncio.get_running_loop().add_reader(conn.fileno(), stop.set)  # the parent's None: done
    await stop.wait()
    conn.recv()
    stats = server.stats
    await server.shutdown()
    conn.send({"stats": stats})


# ---- client ------------------------------------------------------------------------------------
def client_process(conn: Connection) -> None:
    torch.set_num_threads(1)
    client: ExpertClient | None = None
    addr = ""
    experts: list[RemoteExpert] = []
    x = torch.empty(0)
    while (cmd := conn.recv()) is not None:
        if cmd["cmd"] == "connect":
            client, addr = ExpertClient.create(), cmd["addr"]
            conn.send({"ok": True})
        elif cmd["cmd"] == "setup":
            experts = [RemoteExpert(uid, addr, client, forward_timeout=600, backward_timeout=600)
                       for uid in cmd["uids"]]
            x = torch.randn(cmd["batch"], cmd["hidden"])
            for e in experts:  # warm up: connection, and each expert's first (small) batch
                e(x[:16]).sum().backward()
            conn.send({"ready": True})
        elif cmd["cmd"] == "run":
            rng = random.Random(cmd["seed"])
            t0 = time.perf_counter()
            for _ in range(cmd["batches"]):
                out = rng.choice(experts)(x)
                out.sum().backward()
            conn.send({"seconds": time.perf_counter() - t0, "samples": cmd["batches"] * x.shape[0]})
        elif cmd["cmd"] == "rtt":
            conn.send(_round_trips(RemoteExpert("nop.0", addr, client), cmd["n"], cmd["hidden"]))
    if client is not None:
        client.shutdown()


def _round_trips(nop: RemoteExpert, n: int, hidden: int) -> dict:
    one = torch.randn(1, hidden)
    for _ in range(100):
        nop(one)
    lat, info = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        nop(one)
        lat.append(time.perf_counter() - t0)
    for _ in range(n):
        nop._info = None
        t0 = time.perf_counter()
        _ = nop.info
        info.append(time.perf_counter() - t0)
    return {"nop_forward_ms": statistics.median(lat) * 1e3, "nop_forward_p99_ms": percentile(lat, 0.99) * 1e3,
            "info_rpc_ms": statistics.median(info) * 1e3}


# ---- local baseline ----------------------------------------------------------------------------
def local_samples_per_s(kind: str, experts: int, hidden: int, batch: int, batches: int, seed: int = 0) -> float:
    """The same experts trained in this process: random expert, forward, backward, Adam step."""
    torch.manual_seed(0)
    modules = [create_expert(kind, hidden) for _ in range(experts)]
    optims = [torch.optim.Adam(m.parameters()) for m in modules]
    x = torch.randn(batch, hidden)
    rng = random.Random(seed)

    def step() -> None:
        i = rng.randrange(len(modules))
        modules[i](x).sum().backward()
        optims[i].step()
        optims[i].zero_grad(set_to_none=True)

    step()  # warm-up: allocator, first-touch of the weights
    t0 = time.perf_counter()
    for _ in range(batches):
        step()
    return batches * batch / (time.perf_counter() - t0)
