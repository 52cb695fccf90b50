"""The latency experiment of the DMoE paper: throughput as per-hop network latency grows.

Latency is injected in user space: the expert server sleeps ``latency`` before handling each request
(the request's hop) and again before replying (the reply's hop); DHT lookups are not delayed.  Two
models of ``LAYERS`` remote layers (``ffn``, hidden ``HIDDEN``) train on batches of ``BATCH`` rows:

* model parallel: one trainer runs the layers one after another (``RemoteExpert`` per layer), so
  every hop's latency adds up in each step;
* DMoE: ``TRAINERS`` independent trainers, each with ``RemoteMixtureOfExperts`` layers (grid of 4,
  ``k_best`` = 2, chosen experts called in parallel); asynchronous training lets them run at once.

``bench_moe.py`` forks ``serve_process`` (it sends its address over the pipe and serves until it
receives ``None``), runs ``measure`` itself and draws the PNG.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from multiprocessing.connection import Connection

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import uvloop  # noqa: E402
from torch import nn  # noqa: E402

from dht import DHT  # noqa: E402
from experts import ExpertBackend, ExpertClient, ExpertServer, RemoteExpert, RemoteMixtureOfExperts  # noqa: E402

LAYERS, HIDDEN, BATCH, GRID, K_BEST, TRAINERS = 4, 64, 32, 4, 2, 16


class DelayedExpertServer(ExpertServer):
    """Sleeps ``latency`` on the way in and again on the way out of every expert call."""

    latency = 0.0

    async def rpc_forward(self, request, ctx):
        await asyncio.sleep(self.latency)
        result = await super().rpc_forward(request, ctx)
        await asyncio.sleep(self.latency)
        return result

    async def rpc_backward(self, request, ctx):
        await asyncio.sleep(self.latency)
        result = await super().rpc_backward(request, ctx)
        await asyncio.sleep(self.latency)
        return result


def serve_process(conn: Connection) -> None:
    uvloop.run(_serve(conn))


async def _serve(conn: Connection) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    uids = [f"mp{layer}.0" for layer in range(LAYERS)]
    uids += [f"dmoe{layer}.{i}" for layer in range(LAYERS) for i in range(GRID)]
    backends = [ExpertBackend.from_kind(uid, "ffn", HIDDEN, optimizer=lambda p: torch.optim.Adam(p, lr=1e-4))
                for uid in uids]
    server = await DelayedExpertServer.create(backends, initial_peers=[], update_period=600)

    async def set_latency(request, ctx):
        server.latency = float(request)
        return server.latency

    server.p2p.register("bench.set_latency", set_latency)
    conn.send({"addr": server.address})
    stop = asyncio.Event()
    asyncio.get_running_loop().add_reader(conn.fileno(), stop.set)
    await stop.wait()
    conn.recv()
    await server.shutdown()
    conn.send({"stopped": True})


def _timed(run_step, threads: int, window: float) -> float:
    """samples/s of ``threads`` loops of ``run_step`` that start steps until ``window`` seconds pass."""
    done = [0] * threads
    errors: list[BaseException] = []
    t0 = time.perf_counter()

    def loop(i: int) -> None:
        try:
            while time.perf_counter() - t0 < window or done[i] == 0:
                run_step(i)
                done[i] += 1
        except BaseException as e:  # reported by the measuring thread
            errors.append(e)

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return sum(done) * BATCH / (time.perf_counter() - t0)


def measure(addr: str, latencies: list[float], window: float) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dht = DHT(initial_peers=[addr], client_mode=True)
    client = ExpertClient.from_dht(dht)
    head = nn.Linear(HIDDEN, 1)
    timeout = 60.0
    mp_model = nn.Sequential(*(RemoteExpert(f"mp{layer}.0", addr, client, forward_timeout=timeout,
                                            backward_timeout=timeout) for layer in range(LAYERS)), head)
    dmoe_models = [nn.Sequential(*(RemoteMixtureOfExperts(HIDDEN, [GRID], f"dmoe{layer}", k_best=K_BEST, k_min=1,
                                                          forward_timeout=timeout, backward_timeout=timeout,
                                                          dht=dht, client=client) for layer in range(LAYERS)),
                                 nn.Linear(HIDDEN, 1)) for _ in range(TRAINERS)]
    x, y = torch.randn(BATCH, HIDDEN), torch.randn(BATCH, 1)

    def step(model: nn.Module) -> None:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        model.zero_grad(set_to_none=True)

    step(mp_model)
    for m in dmoe_models:
        step(m)
    out = {"latency_ms": [], "model_parallel_samples_s": [], "dmoe_samples_s": []}
    for latency in latencies:
        client.run(client.p2p.call(addr, "bench.set_latency", latency, timeout=10))
        out["latency_ms"].append(latency * 1e3)
        out["model_parallel_samples_s"].append(_timed(lambda _: step(mp_model), 1, window))
        out["dmoe_samples_s"].append(_timed(lambda i: step(dmoe_models[i]), TRAINERS, window))
        print(f"latency {latency * 1e3:5.0f} ms: model parallel {out['model_parallel_samples_s'][-1]:8.0f}, "
              f"DMoE {out['dmoe_samples_s'][-1]:8.0f} samples/s", file=sys.stderr, flush=True)
    dht.shutdown()
    out.update(layers=LAYERS, hidden=HIDDEN, batch=BATCH, grid=GRID, k_best=K_BEST, trainers=TRAINERS, window_s=window)
    return out
