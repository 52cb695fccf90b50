"""hivemind's ``benchmark_throughput`` measurement, rebuilt on hivemind's public API (the script is not
shipped in its wheel).  Run ONLY with the separate virtualenv's interpreter (``make bench-env``):

    .bench-venv/bin/python benchmarks/_moe_hivemind.py --num-experts 4 --hid-dim 256 --num-clients 8 \\
        --batch-size 64 --num-batches-per-client 64

Same settings and procedure as hivemind's benchmark: a ``hivemind.moe.Server`` hosting ``ffn``
experts (TorchScript, Adam, ``max_batch_size = 4 * batch_size``, ``num_clients // 2`` connection
handlers) and ``num_clients`` processes, each calling random experts with ``torch.set_num_threads(1)``
and doing forward + backward of ``out.sum()``.  Two figures: hivemind's own (examples / time from
server ready to clients finished, client start-up included) and the steady state measured the way
``bench_moe.py`` measures spotswarm (clients warmed up first, then timed from a common start).
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import statistics
import sys
import time

import torch


def _client(index, can_start, ready, go, results, maddrs, peer_id, num_experts, batch_size, hid_dim, num_batches,
            rtt):
    from hivemind.moe.client.expert import RemoteExpert
    from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
    from hivemind.moe.expert_uid import ExpertInfo
    from hivemind.p2p import P2P

    torch.set_num_threads(1)
    can_start.wait()
    t_created = time.perf_counter()
    p2p = RemoteExpertWorker.run_coroutine(P2P.create(initial_peers=maddrs))
    experts = [RemoteExpert(ExpertInfo(uid=f"expert.{i}", peer_id=peer_id), p2p) for i in range(num_experts)]
    dummy = torch.randn(batch_size, hid_dim)
    rng = random.Random(index)
    t0 = time.perf_counter()
    rng.choice(experts)(dummy).sum().backward()  # warm-up batch: counted in hivemind's own figure only
    warmup = time.perf_counter() - t0
    figures = {"setup_s": t0 - t_created, "warmup_s": warmup}
    if rtt:
        nop = RemoteExpert(ExpertInfo(uid="nop.0", peer_id=peer_id), p2p)
        one = torch.randn(1, hid_dim)
        for _ in range(20):
            nop(one)
        lat = []
        for _ in range(rtt):
            t = time.perf_counter()
            nop(one)
            lat.append(time.perf_counter() - t)
        figures["nop_forward_ms"] = statistics.median(lat) * 1e3
    ready.wait()
    go.wait()
    t0 = time.perf_counter()
    for _ in range(num_batches):
        rng.choice(experts)(dummy).sum().backward()
    figures["seconds"] = time.perf_counter() - t0
    results.put((index, figures))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-experts", type=int, default=16)
    p.add_argument("--num-clients", type=int, default=128)
    p.add_argument("--num-batches-per-client", type=int, default=16)
    p.add_argument("--hid-dim", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--max-batch-size", type=int, default=None)
    p.add_argument("--num-handlers", type=int, default=None)
    p.add_argument("--rtt", type=int, default=0, help="empty round trips (1-row nop forwards) client 0 measures")
    args = p.parse_args()

    import hivemind
    from hivemind.moe.server import ModuleBackend, Server
    from hivemind.moe.server.layers import name_to_block
    from hivemind.utils.tensor_descr import BatchTensorDescriptor

    max_batch_size = args.max_batch_size or args.batch_size * 4
    num_handlers = max(1, args.num_handlers or args.num_clients // 2)
    ctx = mp.get_context("fork")
    can_start = ctx.Event()
    ready = ctx.Barrier(args.num_clients + 1)
    go = ctx.Event()
    results = ctx.Queue()

    server_dht = hivemind.DHT(start=True)  # a separate process
    clients = [ctx.Process(target=_client, daemon=True, args=(
        i, can_start, ready, go, results, server_dht.get_visible_maddrs(), server_dht.peer_id, args.num_experts,
        args.batch_size, args.hid_dim, args.num_batches_per_client, args.rtt if i == 0 else 0))
        for i in range(args.num_clients)]
    for c in clients:  # as in hivemind's benchmark: clients are forked first and wait for the server
        c.start()
    experts = {}
    for i in range(args.num_experts):
        module = torch.jit.script(name_to_block["ffn"](args.hid_dim))
        experts[f"expert.{i}"] = ModuleBackend(
            name=f"expert.{i}", module=module, optimizer=torch.optim.Adam(module.parameters()),
            args_schema=(BatchTensorDescriptor(args.hid_dim),), outputs_schema=BatchTensorDescriptor(args.hid_dim),
            max_batch_size=max_batch_size)
    nop = name_to_block["nop"](args.hid_dim)
    experts["nop.0"] = ModuleBackend(name="nop.0", module=nop, optimizer=None,
                                     args_schema=(BatchTensorDescriptor(args.hid_dim),),
                                     outputs_schema=BatchTensorDescriptor(args.hid_dim), max_batch_size=max_batch_size)
    server = Server(dht=server_dht, module_backends=experts, num_connection_handlers=num_handlers, device="cpu")
    server.start()
    server.ready.wait()
    t_ready = time.perf_counter()
    can_start.set()
    try:
        ready.wait(timeout=600)
        t_all_ready = time.perf_counter()
        go.set()
        t_go = time.perf_counter()
        figures = dict(results.get(timeout=3600) for _ in clients)
        t_done = time.perf_counter()
        for c in clients:
            c.join(timeout=60)
    finally:
        for c in clients:
            if c.is_alive():
                c.terminate()
        server.shutdown()
        server.join()
        server_dht.shutdown()

    samples = args.batch_size * args.num_clients * args.num_batches_per_client
    steady = samples / (t_done - t_go)
    # hivemind's own figure: from server ready to clients finished, start-up and the warm-up batch included
    own = (samples + args.batch_size * args.num_clients) / ((t_all_ready - t_ready) + (t_done - t_go))
    out = {"samples_s": steady, "benchmark_throughput_samples_s": own, "samples": samples,
           "num_experts": args.num_experts, "num_clients": args.num_clients, "batch_size": args.batch_size,
           "hid_dim": args.hid_dim, "max_batch_size": max_batch_size, "num_handlers": num_handlers,
           "hivemind_version": hivemind.__version__}
    if "nop_forward_ms" in figures.get(0, {}):
        out["nop_forward_ms"] = figures[0]["nop_forward_ms"]
    print(f"hivemind {hivemind.__version__}: {steady:,.0f} samples/s steady, {own:,.0f} samples/s by its own method",
          file=sys.stderr)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
