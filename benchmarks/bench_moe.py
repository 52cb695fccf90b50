"""Decentralized mixture-of-experts benchmark: training throughput through remote experts on loopback.

One expert server process and 8 client processes (``torch.set_num_threads(1)`` each).  Every client
loops: pick a random expert, forward its batch, ``out.sum().backward()`` (the server recomputes the
forward, backpropagates and steps the expert's Adam).  Two cases, as in hivemind's
``benchmark_throughput``: 4 ``ffn`` experts, hidden 256, batch 64; and 1 expert, hidden 1024, batch
2048.  The baseline is the same experts trained locally in this process (random expert, forward,
backward, Adam step), measured in the same run, alternating with the remote runs (3 rounds, 2 with
``--quick``; the best round of each is reported, every round is in the JSON).  ``empty_rtt_ms`` is
the median round trip of a 1-row forward through a ``nop`` expert (the whole path: client thread,
RPC, batching, runtime).  The server's ``max_batch_size`` is 256 rows (4 x batch, the rule of
hivemind's benchmark) in the small case and 2048 in the large one: merging 2048-row requests into
4096- or 8192-row batches measured 2-3x slower on this 2-core machine (with much system time; big
tensors are mmap'd and page-faulted afresh on every allocation).  Every process runs with
``OMP_WAIT_POLICY=PASSIVE``: idle OpenMP threads sleep instead of spinning.

``--vs-hivemind`` runs hivemind's measurement with the same settings from the separate virtualenv
(``make bench-env``; see ``_moe_hivemind.py``), each case within ``--hivemind-limit-s`` (900 s): a
case that runs past it (hivemind's 1 x ffn1024 case once hung for over 25 minutes here) is stopped
and reported, and the rest still runs.  Then the latency experiment: throughput as injected
per-hop latency grows, DMoE against a sequential model-parallel baseline (``_moe_latency.py``),
plotted to ``benchmarks/results/moe_latency.png``.

    python benchmarks/bench_moe.py [--quick] [--vs-hivemind [--hivemind-limit-s S]] [--skip-latency]

Prints tables, then one JSON line of figures.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
# Idle OpenMP threads sleep instead of spinning, in this process and every child (hivemind's too): on
# a shared 2-core machine spinning threads starve everything else (measured: 2-thread local training
# at 230 samples/s spinning vs 9,900 passive while other jobs ran).  Set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import _moe_latency  # noqa: E402
from _common import HIVEMIND_MISSING, ChildFailed, cpu_seconds, print_json, run_for_json  # noqa: E402
from _moe_roles import client_process, local_samples_per_s, serve_process  # noqa: E402

BENCH_PYTHON = ROOT / ".bench-venv" / "bin" / "python"
CLIENTS = 8


class Child:
    """A forked child process and our end of its pipe."""

    def __init__(self, target, *args) -> None:
        self.conn, child_end = mp.Pipe()
        self.proc = mp.get_context("fork").Process(target=target, args=(child_end, *args), daemon=True)
        self.proc.start()
        child_end.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, msg) -> None:
        self.conn.send(msg)

    def recv(self, timeout: float = 3600) -> dict:
        if not self.conn.poll(timeout):
            raise RuntimeError(f"child {self.proc.name} did not answer in {timeout} s")
        try:
            return self.conn.recv()
        except EOFError:
            raise RuntimeError(f"child {self.proc.name} exited with {self.proc.exitcode} before answering") from None

    def stop(self, timeout: float = 60) -> None:
        """Ask it to finish (None), then make sure it is gone."""
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def _log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def run_throughput(cases: list[dict], rtt_calls: int, server: Child, clients: list[Child]) -> None:
    """Per case, ``case["rounds"]`` rounds of (our clients against our server, then the local baseline in
    this process); the best round of each is reported (the machine is shared: best-of is the least
    noisy).  Fills each case dict in place, and ``cases[0]["rtt"]`` with the empty round trips."""
    addr = server.recv()["addr"]
    for c in clients:
        c.send({"cmd": "connect", "addr": addr})
    for c in clients:
        c.recv()
    _log("server up, clients connected")
    for case in cases:
        active = clients[:case["clients"]]
        for c in active:
            c.send({"cmd": "setup", "uids": [f"{case['name']}.{i}" for i in range(case["experts"])],
                    "hidden": case["hidden"], "batch": case["batch"]})
        for c in active:
            c.recv()
        _log(f"case {case['name']}: clients ready")
        rounds, case["rounds"] = case["rounds"], []
        for r in range(rounds):
            cpu0 = _cpu_seconds([server, *active])
            t0 = time.perf_counter()
            for i, c in enumerate(active):  # the start signal, as close together as we can
                c.send({"cmd": "run", "batches": case["batches"], "seed": 100 * r + i})
            results = [c.recv() for c in active]
            seconds = time.perf_counter() - t0
            cpu = {k: v - cpu0[k] for k, v in _cpu_seconds([server, *active]).items()}
            samples = sum(res["samples"] for res in results)
            local = local_samples_per_s("ffn", case["experts"], case["hidden"], case["batch"],
                                        case["local_batches"], seed=r)
            case["rounds"].append({"remote_samples_s": samples / seconds, "local_samples_s": local,
                                   "samples": samples, "seconds": seconds, "server_cpu_s": cpu[server.pid],
                                   "clients_cpu_s": sum(cpu.values()) - cpu[server.pid],
                                   "load_avg_1m": os.getloadavg()[0]})
            _log(f"case {case['name']} round {r}: remote {samples / seconds:,.0f}, local {local:,.0f} samples/s")
        best = max(case["rounds"], key=lambda x: x["remote_samples_s"])
        case.update(remote_samples_s=best["remote_samples_s"], samples=best["samples"], seconds=best["seconds"],
                    server_cpu_s=best["server_cpu_s"], clients_cpu_s=best["clients_cpu_s"],
                    local_samples_s=max(x["local_samples_s"] for x in case["rounds"]))
    clients[0].send({"cmd": "rtt", "n": rtt_calls, "hidden": 256})
    cases[0]["rtt"] = clients[0].recv()
    for c in clients:
        c.stop()
    server.send(None)
    server.recv()  # its batching stats: it shut down cleanly
    server.stop()


def _cpu_seconds(procs: list[Child]) -> dict[int, float]:
    """User + system CPU seconds of each process so far."""
    return {p.pid: cpu_seconds([p.pid]) for p in procs}


def bench_env_python() -> Path:
    """The benchmark virtualenv's interpreter (``make bench-env``); ChildFailed if hivemind does not import there."""
    try:
        ok = BENCH_PYTHON.exists() and subprocess.run([str(BENCH_PYTHON), "-c", "import hivemind"],
                                                      capture_output=True, timeout=120).returncode == 0
    except subprocess.TimeoutExpired:
        ok = False
    if not ok:
        raise ChildFailed(HIVEMIND_MISSING)
    return BENCH_PYTHON


def run_hivemind(case: dict, limit_s: float) -> dict:
    cmd = [str(bench_env_python()), str(HERE / "_moe_hivemind.py"), "--num-experts", str(case["experts"]),
           "--hid-dim", str(case["hidden"]), "--num-clients", str(case["clients"]), "--batch-size", str(case["batch"]),
           "--num-batches-per-client", str(case["batches"]), "--max-batch-size", str(case["max_batch_size"]),
           "--rtt", "200"]
    return run_for_json(f"hivemind {case['name']} case", cmd, limit_s)


def run_latency(server: Child, latencies_ms: list[int], window: float) -> dict:
    """The delaying server is a forked child; the trainers run in this process (torch is loaded already)."""
    addr = server.recv()["addr"]
    result = _moe_latency.measure(addr, [ms / 1e3 for ms in latencies_ms], window)
    server.send(None)
    server.recv()
    server.stop()
    return result


def plot_latency(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    ax.plot(result["latency_ms"], result["dmoe_samples_s"], "o-",
            label=f"DMoE ({result['trainers']} async trainers, k={result['k_best']} of {result['grid']})")
    ax.plot(result["latency_ms"], result["model_parallel_samples_s"], "s--", label="model parallel (sequential)")
    ax.set_xlabel("injected latency per hop (ms)")
    ax.set_ylabel("training samples / s")
    ax.set_yscale("log")
    ax.set_title(f"{result['layers']} remote layers, hidden {result['hidden']}, batch {result['batch']}, loopback")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def make_cases(q: bool) -> list[dict]:
    return [
        {"name": "small", "experts": 4, "hidden": 256, "batch": 64, "max_batch_size": 256, "clients": CLIENTS,
         "batches": 32 if q else 256, "local_batches": 150 if q else 1000, "rounds": 2 if q else 3},
        # --quick: 2 clients x 1 batch here (16,384 samples would take most of the minute alone)
        {"name": "large", "experts": 1, "hidden": 1024, "batch": 2048, "max_batch_size": 2048,
         "clients": 2 if q else CLIENTS, "batches": 1 if q else 2, "local_batches": 2 if q else 8,
         "rounds": 1 if q else 3},
    ]


def measure(cases: list[dict], q: bool, skip_latency: bool) -> dict | None:
    """Throughput (fills ``cases``), then the latency experiment's result (None if skipped)."""
    # Every child is forked now, before this process runs any torch work (a fork after OpenMP started
    # its threads would leave the child's thread pool broken), and they start without importing anything.
    server = Child(serve_process, [{k: c[k] for k in ("name", "experts", "hidden", "max_batch_size")} for c in cases])
    clients = [Child(client_process) for _ in range(CLIENTS)]
    latency_server = None if skip_latency else Child(_moe_latency.serve_process)
    try:
        run_throughput(cases, rtt_calls=300 if q else 2000, server=server, clients=clients)
        _log("spotswarm and local throughput measured")
        if latency_server is None:
            return None
        latency = run_latency(latency_server, [0, 50, 200] if q else [0, 10, 25, 50, 100, 150, 200],
                              window=1.0 if q else 5.0)
        _log("latency experiment done")
        return latency
    finally:
        for child in [server, *clients, *([latency_server] if latency_server else [])]:
            if child.proc.is_alive():
                child.proc.kill()
                child.proc.join()


def add_hivemind(cases: list[dict], q: bool, limit_s: float) -> None:
    """hivemind's measurement per case, each within ``limit_s`` (its 1 x ffn1024 case has hung for
    more than 25 minutes here): a case past it is stopped and reported, and the others still run."""
    for case in cases:
        if q and case["name"] == "large":
            continue  # hivemind needs minutes for this case; full runs only
        try:
            hm = run_hivemind(case, limit_s)
        except ChildFailed as e:
            case["hivemind_error"] = str(e).splitlines()[0]
            _log(f"hivemind case {case['name']}: {case['hivemind_error']}")
            continue
        case["hivemind_samples_s"] = hm["samples_s"]
        case["hivemind_benchmark_throughput_samples_s"] = hm["benchmark_throughput_samples_s"]
        case["hivemind_nop_forward_ms"] = hm.get("nop_forward_ms")
        case["hivemind_version"] = hm["hivemind_version"]
        _log(f"hivemind case {case['name']} measured")


def print_report(cases: list[dict], latency: dict | None, png: Path) -> None:
    small = cases[0]
    print(f"{'case':<34}{'remote':>10}{'local':>10}{'remote/local':>14}{'hivemind':>10}{'ours/hm':>9}")
    for c in cases:
        hm = c.get("hivemind_samples_s")
        label = f"{c['experts']} x ffn{c['hidden']}, batch {c['batch']}, {c['clients']} clients"
        hm_text = f"{hm:,.0f}" if hm else "-"
        ratio_text = f"{c['remote_samples_s'] / hm:.2f}" if hm else "-"
        print(f"{label:<34}{c['remote_samples_s']:>10,.0f}{c['local_samples_s']:>10,.0f}"
              f"{c['remote_samples_s'] / c['local_samples_s']:>14.2f}{hm_text:>10}{ratio_text:>9}")
        if "hivemind_error" in c:
            print(f"  hivemind, {c['name']} case: {c['hivemind_error']}")
    for c in cases:
        print(f"  {c['name']}: {c['samples']:,} samples in {c['seconds']:.2f} s; CPU seconds used: server "
              f"{c['server_cpu_s']:.2f}, clients {c['clients_cpu_s']:.2f} (2 cores = {2 * c['seconds']:.2f} available)")
    rtt = small["rtt"]
    print(f"empty round trip (1-row nop forward): {rtt['nop_forward_ms']:.3f} ms median, "
          f"{rtt['nop_forward_p99_ms']:.3f} ms p99; expert.info RPC {rtt['info_rpc_ms']:.3f} ms"
          + (f"; hivemind nop forward {small['hivemind_nop_forward_ms']:.2f} ms"
             if small.get("hivemind_nop_forward_ms") else ""))
    if small.get("hivemind_benchmark_throughput_samples_s"):
        print(f"hivemind {small['hivemind_version']}, its own method (start-up included): "
              f"{small['hivemind_benchmark_throughput_samples_s']:,.0f} samples/s")
    print("targets: remote >= 5,200 samples/s and >= 0.40 of local (small case); empty round trip <= 1 ms")
    if latency:
        print(f"\n{'latency/hop (ms)':<18}{'model parallel':>16}{'DMoE':>10}   samples/s -> {png.relative_to(ROOT)}")
        for lat, mp, dm in zip(latency["latency_ms"], latency["model_parallel_samples_s"],
                               latency["dmoe_samples_s"], strict=True):
            print(f"{lat:<18.0f}{mp:>16,.1f}{dm:>10,.1f}")


def figures_of(args: argparse.Namespace, cases: list[dict], latency: dict | None, png: Path) -> dict:
    small, large = cases
    rtt = small["rtt"]
    figures: dict = {
        "remote_samples_s": small["remote_samples_s"], "local_samples_s": small["local_samples_s"],
        "empty_rtt_ms": rtt["nop_forward_ms"],
    }
    if args.vs_hivemind:
        figures["hivemind_samples_s"] = small.get("hivemind_samples_s")
        figures["hivemind_benchmark_throughput_samples_s"] = small.get("hivemind_benchmark_throughput_samples_s")
        figures["hivemind_empty_rtt_ms"] = small.get("hivemind_nop_forward_ms")
        figures.update({f"{c['name']}_hivemind_error": c["hivemind_error"] for c in cases if "hivemind_error" in c})
    figures.update({
        "remote_fraction_of_local": small["remote_samples_s"] / small["local_samples_s"],
        "empty_rtt_p99_ms": rtt["nop_forward_p99_ms"], "info_rpc_ms": rtt["info_rpc_ms"],
        "large_remote_samples_s": large["remote_samples_s"], "large_local_samples_s": large["local_samples_s"],
    })
    if large.get("hivemind_samples_s"):
        figures["large_hivemind_samples_s"] = large["hivemind_samples_s"]
    if latency:
        figures["latency"] = {k: latency[k] for k in ("latency_ms", "model_parallel_samples_s", "dmoe_samples_s")}
        figures["latency_png"] = str(png.relative_to(ROOT))
    figures.update(quick=args.quick, clients=CLIENTS, small_samples=small["samples"], large_samples=large["samples"],
                   small_rounds=[[r["remote_samples_s"], r["local_samples_s"]] for r in small["rounds"]],
                   large_rounds=[[r["remote_samples_s"], r["local_samples_s"]] for r in large["rounds"]],
                   load_avg_1m=os.getloadavg()[0])
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller run, under 60 s")
    parser.add_argument("--vs-hivemind", action="store_true", help="also run hivemind's measurement (bench venv)")
    parser.add_argument("--skip-latency", action="store_true", help="skip the latency experiment")
    parser.add_argument("--hivemind-limit-s", type=float, default=900.0,
                        help="seconds each hivemind case may run before it is stopped and reported (default 900)")
    args = parser.parse_args()
    cases = make_cases(args.quick)
    latency = measure(cases, args.quick, args.skip_latency)
    if args.vs_hivemind:
        add_hivemind(cases, args.quick, args.hivemind_limit_s)
    png = HERE / "results" / "moe_latency.png"
    if latency is not None:
        plot_latency(latency, png)
    print_report(cases, latency, png)
    print_json(figures_of(args, cases, latency, png), digits=3)


if __name__ == "__main__":
    main()
