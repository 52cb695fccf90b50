"""Security benchmark: what run membership costs on the hot paths, and what hostile connections cost a node.

Measured side by side in one run, membership on against membership off:

* empty RPC round trip (a child process serves an open node and a member node; this process calls both,
  in alternating batches);
* DHT get (two swarms in this process, one open, one of members; gets that traverse the swarm);
* all-reduce of 4 x 10M float32, two sets of peer processes, alternating rounds (``--quick``: fewer),
  and the byzantine levels (clip, verify) against off, membership on;
* members' attacks on averaging (issue 52's: a rogue reducer, a weight at the cap with large values, a
  claim of the whole vector, a leader rewriting weights) against each byzantine level;
* matchmaking with 5 declared leaders whose sockets never answer, against none (4 honest members);
* ``--training``: 4 collaborative workers, one attacking every round, against 4 honest ones.

Then strangers: a member DHT node in its own process takes 10,000 hostile TCP connections (silent,
garbage, huge declared headers, half handshakes) from ``tests/security/hostile_client.py`` in another
process; the figure is the node's resident memory growth (peak minus before), and whether it still
answers a member afterwards.

    python benchmarks/bench_security.py [--quick]

Every child has a time limit; past it the benchmark says so and prints the rest.  Last line: JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import psutil  # noqa: E402
import uvloop  # noqa: E402
from _common import (  # noqa: E402
    Child,
    ChildFailed,
    PeakSampler,
    emit,
    guarded,
    print_json,
    print_table,
    run_for_json,
    stop_all,
)

from p2p import P2P, Identity  # noqa: E402
from p2p.membership import Authority, Membership  # noqa: E402

HOSTILE = os.path.join(ROOT, "tests", "security", "hostile_client.py")
RUN = "bench"
CHILD_LIMIT_S = 120.0
TRAINING_LIMIT_S = 240.0
BYZANTINE_MODES = ("clip", "verify")  # against byzantine=off, all with membership on


def member(authority: Authority, identity: Identity) -> Membership:
    return Membership(authority.run, authority.public_key, authority.issue(identity.peer_id, 3600))


# ---- serving side (child process) --------------------------------------------------------------------
async def _serve(authority_path: str, with_dht: bool) -> None:
    """An open node and a member node answering "empty"; with ``with_dht`` a member DHT node instead."""
    from dht import DHTNode

    authority = Authority.from_file(authority_path, RUN, create=False)
    identity = Identity()
    nodes: list = []
    if with_dht:
        node = await DHTNode.create([], identity=identity, p2p_options={"membership": member(authority, identity)})
        nodes.append(node)
        addrs = [str(node.address)]
    else:
        open_node = await P2P.create("127.0.0.1", 0)
        member_node = await P2P.create("127.0.0.1", 0, identity=identity, membership=member(authority, identity))
        for n in (open_node, member_node):
            n.register("empty", _empty)
        nodes += [open_node, member_node]
        addrs = [str(open_node.address), str(member_node.address)]
    emit({"addrs": addrs, "pid": os.getpid()})
    stop = asyncio.Event()
    asyncio.get_running_loop().add_reader(sys.stdin.fileno(), stop.set)  # the parent closes stdin: done
    await stop.wait()
    for n in nodes:
        await n.shutdown()


async def _empty(request, ctx):
    return None


def start_server(authority_path: str, with_dht: bool = False) -> tuple[Child, dict]:
    """A ``--serve`` child (it stops when its stdin closes) and what it said it serves."""
    argv = [sys.executable, os.path.abspath(__file__), "--serve", authority_path] + (["--dht"] if with_dht else [])
    server = Child("the serving child", argv, quit_line=None)
    try:
        return server, server.recv("addrs", time.monotonic() + 60)
    except ChildFailed:
        server.kill()
        raise


# ---- RTT ---------------------------------------------------------------------------------------------
async def _rtt(addrs: list[str], authority: Authority, calls: int, batches: int) -> dict:
    identity = Identity()
    open_client = await P2P.create(client_mode=True)
    member_client = await P2P.create(client_mode=True, identity=identity, membership=member(authority, identity))
    pairs = {"off": (open_client, addrs[0]), "on": (member_client, addrs[1])}
    lat: dict[str, list[float]] = {"off": [], "on": []}
    try:
        for client, addr in pairs.values():
            for _ in range(300):  # warm up: connection, handshake, allocator
                await client.call(addr, "empty")
        for _ in range(batches):
            for mode, (client, addr) in pairs.items():
                for _ in range(calls):
                    t0 = time.perf_counter()
                    await client.call(addr, "empty")
                    lat[mode].append(time.perf_counter() - t0)
    finally:
        await open_client.shutdown()
        await member_client.shutdown()
    p50 = {m: statistics.median(v) * 1e6 for m, v in lat.items()}
    return {"rtt_off_us": p50["off"], "rtt_on_us": p50["on"], "membership_rtt_ratio": p50["on"] / p50["off"]}


def measure_rtt(authority_path: str, authority: Authority, quick: bool) -> dict:
    server, info = start_server(authority_path)
    try:
        return uvloop.run(asyncio.wait_for(_rtt(info["addrs"], authority, 500 if quick else 2000,
                                                6 if quick else 10), CHILD_LIMIT_S))
    finally:
        stop_all([server], grace=15)


# ---- DHT get -----------------------------------------------------------------------------------------
async def _swarm(n: int, authority: Authority | None) -> list:
    from dht import DHTNode

    nodes = []
    for _ in range(n):
        identity = Identity()
        options = {"membership": member(authority, identity)} if authority else None
        initial = [nodes[0].address] if nodes else []
        nodes.append(await DHTNode.create(initial, identity=identity, p2p_options=options))
    return nodes


async def _dht_get(authority: Authority, n: int, keys: int, rounds: int) -> dict:
    swarms = {"off": await _swarm(n, None), "on": await _swarm(n, authority)}
    lat: dict[str, list[float]] = {"off": [], "on": []}
    try:
        expiration = time.time() + 600
        for nodes in swarms.values():
            for k in range(keys):
                assert await nodes[k % n].store(f"key{k}", k, expiration), "a store failed"
        for _ in range(rounds):
            for mode, nodes in swarms.items():
                for k in range(keys):
                    reader = nodes[(k + 1) % n]
                    t0 = time.perf_counter()
                    found = await reader.get(f"key{k}", latest=True)
                    lat[mode].append(time.perf_counter() - t0)
                    assert found is not None and found.value == k, f"key{k} not found ({mode})"
    finally:
        for nodes in swarms.values():
            for node in nodes:
                await node.shutdown()
    p50 = {m: statistics.median(v) * 1e3 for m, v in lat.items()}
    return {"dht_get_off_ms": p50["off"], "dht_get_on_ms": p50["on"],
            "membership_dht_get_ratio": p50["on"] / p50["off"]}


def measure_dht(authority: Authority, quick: bool) -> dict:
    return uvloop.run(asyncio.wait_for(_dht_get(authority, 6 if quick else 10, 20 if quick else 40,
                                                5 if quick else 10), CHILD_LIMIT_S))


# ---- all-reduce --------------------------------------------------------------------------------------
def measure_allreduce(authority_path: str, quick: bool) -> dict:
    """Membership off and on, and the byzantine levels (membership on) side by side, alternating.  A
    ratio is the median of each repetition's ratio of medians: the modes of one repetition ran within
    seconds of each other, so a slow spell of this shared machine weighs on both sides of a ratio."""
    from bench_allreduce import PeerSet

    size = 10_000_000  # the hot path's size: smaller rounds are too short to compare on a noisy machine
    rounds, reps = (2, 2) if quick else (3, 8)
    sets: dict[str, PeerSet] = {}
    members = ["--membership-authority", authority_path, "--membership-run", RUN]
    modes = {"off": [], "on": members, **{m: [*members, "--byzantine", m] for m in BYZANTINE_MODES}}
    times: dict[str, list[list[float]]] = {mode: [] for mode in modes}  # per repetition
    errors: list[str] = []
    try:
        for mode, extra in modes.items():
            sets[mode] = PeerSet("ours", 4, size, round_timeout=CHILD_LIMIT_S, extra_args=extra)
        for rep in range(reps):
            for mode, peers in sets.items():
                run = peers.run(range(4), rounds, prefix=f"{mode}{rep}")
                errors += [f"{mode}: {e}" for e in run.errors]
                times[mode].append([r["round"] for r in run.rounds if r["ok"]])
    except ChildFailed as e:
        errors.append(str(e))
    finally:
        for peers in sets.values():
            peers.close()
    out: dict = {"allreduce_size": size, "allreduce_errors": errors[:5]}

    def ratio(mode: str, base: str) -> float | None:
        pairs = [statistics.median(a) / statistics.median(b) for a, b in zip(times[mode], times[base], strict=False)
                 if a and b]
        return statistics.median(pairs) if pairs else None

    for mode, rounds_of in times.items():
        if any(rounds_of):
            out[f"allreduce_{mode}_s"] = statistics.median(t for rep in rounds_of for t in rep)
    out["membership_allreduce_ratio"] = ratio("on", "off")
    for mode in BYZANTINE_MODES:
        out[f"byzantine_{mode}_allreduce_ratio"] = ratio(mode, "on")
    return out


# ---- silent leaders ---------------------------------------------------------------------------------
async def _silent_leaders(rounds: int) -> dict:
    """How long 4 members take to form their group, with 5 declarations of silent leaders made before
    theirs (each would be tried first) and without."""
    import torch

    from averaging import DecentralizedAverager
    from dht import DHTNode
    from dht.validation import owner_marker

    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    first = await DHTNode.create()
    nodes = [first] + [await DHTNode.create([str(first.address)]) for _ in range(3)]
    rogues = [await DHTNode.create([str(first.address)]) for _ in range(5)]
    times: dict[str, list[float]] = {"none": [], "silent": []}
    averagers: list[DecentralizedAverager] = []
    try:
        for r in range(rounds):
            for case in ("none", "silent"):
                prefix = f"{case}{r}"
                averagers = [DecentralizedAverager([torch.zeros(8)], n, prefix, target_group_size=4,
                                                   min_matchmaking_time=5.0) for n in nodes]
                if case == "silent":
                    now = first.clock.now()
                    for rogue in rogues:
                        subkey = owner_marker(rogue.p2p.identity.public_key) + str(rogue.peer_id)
                        await rogue.store(f"{prefix}.mm.all", {"a": f"{rogue.peer_id}@127.0.0.1:{port}", "t": now - 60,
                                                               "bw": 100.0, "h": ""}, now + 60, subkey=subkey)
                results = await asyncio.gather(*(a.step(timeout=10.0) for a in averagers))
                assert [x.group_size for x in results] == [4] * 4, "a group did not form"
                times[case].append(max(x.matchmaking_time for x in results))
                for a in averagers:
                    await a.shutdown()
                averagers = []
    finally:
        for a in averagers:
            await a.shutdown()
        for w in held:
            w.close()
        server.close()
        await asyncio.gather(*(n.shutdown() for n in reversed(rogues + nodes)))
    none, silent = statistics.median(times["none"]), statistics.median(times["silent"])
    return {"matchmaking_no_silent_leaders_s": none, "matchmaking_5_silent_leaders_s": silent}


def measure_silent_leaders(quick: bool) -> dict:
    return uvloop.run(asyncio.wait_for(_silent_leaders(2 if quick else 5), CHILD_LIMIT_S))


# ---- members' attacks on averaging -------------------------------------------------------------------
def measure_attacks(quick: bool) -> dict:
    """Each attack of issue 52 against each byzantine level (3 honest members, 1 rogue, in this process)."""
    from _attacks import ATTACKS, play

    logging.getLogger("averaging").setLevel(logging.ERROR)  # each caught rogue is a warning per member
    errors: dict[str, dict[str, float]] = {}
    caught: list[int | None] = []
    for attack in ATTACKS:
        errors[attack] = {}
        for mode in ("off", "clip", "verify"):
            game = uvloop.run(asyncio.wait_for(play(attack, mode), CHILD_LIMIT_S))
            errors[attack][mode] = game["error"]
    for _ in range(1 if quick else 3):  # a rogue reducer that cheats every round: the round it is caught
        game = uvloop.run(asyncio.wait_for(play("rogue reducer serves 1e30", "verify", rounds=2), CHILD_LIMIT_S))
        caught.append(game["caught_in"])
    return {"honest_part_error_max": errors,
            "rogue_reducer_caught_rounds": None if None in caught else max(caught)}


# ---- training with a member that attacks every round ------------------------------------------------
HOSTILE_WORKER = os.path.join(HERE, "_hostile_worker.py")


def _train(tmp: str, name: str, epochs: int, hostile: bool, byzantine: str) -> dict[int, float]:
    """4 collaborative workers (the last one hostile if asked) to ``epochs``; the honest three's mean
    loss per epoch."""
    common = ["worker", "--run", name, "--task", "synthetic", "--target-batch-size", "128", "--min-peers", "4",
              "--max-epochs", str(epochs), "--byzantine", byzantine, "--min-matchmaking-time", "1"]
    children: list[Child] = []
    try:
        first_address = None
        for i in range(4):
            script = [HOSTILE_WORKER] if hostile and i == 3 else ["-m", "orchestrator.cli.main"]
            argv = [sys.executable, *script, *common, "--seed", str(i),
                    "--report-file", os.path.join(tmp, f"{name}-{i}.jsonl"),
                    *(["--initial-peers", first_address] if first_address else [])]
            child = Child(f"{name} worker {i}", argv, stdin=False, quit_line=None)
            children.append(child)
            line = child.line(time.monotonic() + 60, "its address")
            first_address = first_address or line.split()[-1]
        deadline = time.monotonic() + TRAINING_LIMIT_S
        for child in children[:3]:
            child.finish(deadline)
    finally:
        stop_all(children, grace=10)
    per_epoch: dict[int, list[float]] = {}
    for i in range(3):  # the honest workers' (one batch each per epoch: their mean is less noisy)
        path = os.path.join(tmp, f"{name}-{i}.jsonl")
        for line in open(path) if os.path.exists(path) else []:
            record = json.loads(line)
            if record.get("kind") != "progress" and isinstance(record.get("loss"), (int, float)):
                per_epoch.setdefault(record["epoch"], []).append(record["loss"])
    return {e: sum(v) / len(v) for e, v in sorted(per_epoch.items())}


def measure_training(quick: bool) -> dict:
    """The loss of a run whose fourth member attacks every round (it sends x50 chunks and, as reducer,
    serves 1e30) against an honest run's, both with byzantine=verify: the ratio of their mean losses over
    the epochs both reached, each epoch's loss the honest workers' mean (and over the second half alone,
    where the losses are small and the ratio noisier); the full size adds the attacked run with
    byzantine=off, where nothing stops the attack."""
    epochs = 4 if quick else 16
    runs = {"honest": (False, "verify"), "attacked": (True, "verify")}
    if not quick:
        runs["attacked_off"] = (True, "off")
    with tempfile.TemporaryDirectory() as tmp:
        losses = {name: _train(tmp, name, epochs, hostile, level) for name, (hostile, level) in runs.items()}
    out: dict = {"training_epochs": epochs, **{f"training_loss_{name}": v for name, v in losses.items()}}
    common = sorted(set(losses["honest"]) & set(losses["attacked"]))
    if not common:
        out["training_error"] = f"no epoch reached by both runs: {({k: sorted(v) for k, v in losses.items()})}"
        return out

    def ratio(name: str, epochs: list[int]) -> float | None:
        if not all(e in losses[name] for e in epochs):
            return None
        return sum(losses[name][e] for e in epochs) / sum(losses["honest"][e] for e in epochs)

    late = common[len(common) // 2:]  # where losses are small, a ratio of two runs is noisier
    out["training_epochs_compared"] = common
    out["training_loss_ratio_attacked_vs_honest"] = ratio("attacked", common)
    out["training_loss_ratio_attacked_vs_honest_second_half"] = ratio("attacked", late)
    if "attacked_off" in losses:
        out["training_loss_ratio_attacked_off_vs_honest"] = ratio("attacked_off", common)
    return out
    def mean(name: str) -> float:
        return sum(losses[name][e] for e in common) / len(common)
    out["training_epochs_compared"] = common
    out["training_loss_ratio_attacked_vs_honest"] = mean("attacked") / mean("honest")
    if "attacked_off" in losses and all(e in losses["attacked_off"] for e in common):
        out["training_loss_ratio_attacked_off_vs_honest"] = mean("attacked_off") / mean("honest")
    return out


# ---- hostile connections -----------------------------------------------------------------------------
async def _still_serves(addr: str, authority: Authority) -> bool:
    from dht import DHTNode

    identity = Identity()
    node = await DHTNode.create([addr], identity=identity, client_mode=True,
                                p2p_options={"membership": member(authority, identity)})
    try:
        ok = await node.store("after-the-attack", 1, time.time() + 60)
        found = await node.get("after-the-attack", latest=True)
        return bool(ok) and found is not None and found.value == 1
    finally:
        await node.shutdown()


def measure_hostile(authority_path: str, authority: Authority, count: int) -> dict:
    server, info = start_server(authority_path, with_dht=True)
    out: dict = {"hostile_connections": count}
    try:
        addr = info["addrs"][0]
        uvloop.run(asyncio.wait_for(_still_serves(addr, authority), 60))  # warm: imports, first connection
        node = psutil.Process(info["pid"])
        before = node.memory_info().rss
        sampler = PeakSampler(lambda: node.memory_info().rss, period=0.02)
        hostport = addr.split("@")[-1]
        argv = [sys.executable, HOSTILE, "--address", hostport, "--count", str(count),
                "--concurrency", "1000", "--mode", "mixed"]
        try:
            out["attacker"] = run_for_json("the attacker", argv, CHILD_LIMIT_S)
        except ChildFailed as e:
            out["attacker"] = {"error": str(e)[-500:]}
        peak = sampler.stop()
        out["hostile_mem_growth_mb"] = (peak - before) / 2**20
        out["served_after_attack"] = uvloop.run(asyncio.wait_for(_still_serves(addr, authority), 60))
    finally:
        stop_all([server], grace=15)
    return out


# ---- main --------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller run, under 60 s")
    parser.add_argument("--serve", metavar="AUTHORITY", help=argparse.SUPPRESS)
    parser.add_argument("--dht", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hostile", type=int, help="hostile connections (default 10000; --quick 2000)")
    parser.add_argument("--training", action="store_true", help="only the training run with an attacking member")
    args = parser.parse_args()
    if args.serve:
        uvloop.run(_serve(args.serve, args.dht))
        return
    if args.training:
        figures = guarded("training", measure_training, args.quick)
        print_training(figures)
        print_json(figures)
        return
    with tempfile.TemporaryDirectory() as tmp:
        authority_path = os.path.join(tmp, "authority.key")
        authority = Authority.from_file(authority_path, RUN)
        figures: dict = {"quick": args.quick}
        figures.update(guarded("rtt", measure_rtt, authority_path, authority, args.quick))
        figures.update(guarded("dht", measure_dht, authority, args.quick))
        figures.update(guarded("allreduce", measure_allreduce, authority_path, args.quick))
        figures.update(guarded("attacks", measure_attacks, args.quick))
        figures.update(guarded("silent_leaders", measure_silent_leaders, args.quick))
        count = args.hostile or (2000 if args.quick else 10_000)
        figures.update(guarded("hostile", measure_hostile, authority_path, authority, count))
    print_figures(figures)
    print_json(figures)


def print_figures(f: dict) -> None:
    def fmt(key: str, digits: int = 3) -> str:
        v = f.get(key)
        return f"{v:.{digits}f}" if isinstance(v, (int, float)) else "-"

    size = f.get("allreduce_size", 0) // 1_000_000
    rows = [
        ("empty RPC RTT p50 (us), off / on", f"{fmt('rtt_off_us', 1)} / {fmt('rtt_on_us', 1)}", ""),
        ("  ratio on / off", fmt("membership_rtt_ratio"), "<= 1.10"),
        ("DHT get p50 (ms), off / on", f"{fmt('dht_get_off_ms')} / {fmt('dht_get_on_ms')}", ""),
        ("  ratio on / off", fmt("membership_dht_get_ratio"), "<= 1.10"),
        (f"all-reduce 4 x {size}M (s), off / on", f"{fmt('allreduce_off_s')} / {fmt('allreduce_on_s')}", ""),
        ("  ratio on / off", fmt("membership_allreduce_ratio"), "<= 1.10"),
        ("  byzantine=clip / off (s)", f"{fmt('allreduce_clip_s')}; ratio {fmt('byzantine_clip_allreduce_ratio')}",
         "<= 1.15"),
        ("  byzantine=verify / off (s)",
         f"{fmt('allreduce_verify_s')}; ratio {fmt('byzantine_verify_allreduce_ratio')}", "<= 1.5"),
        ("group of 4 formed (s), no / 5 silent leaders",
         f"{fmt('matchmaking_no_silent_leaders_s')} / {fmt('matchmaking_5_silent_leaders_s')}", ""),
        (f"memory growth, {f.get('hostile_connections', 0):,} hostile conns (MB)", fmt("hostile_mem_growth_mb", 1),
         "<= 64"),
        ("node serves a member afterwards", str(f.get("served_after_attack", "-")), "True"),
    ]
    print_table(["<52", ">22"], ["figure", "value", "target"], rows)
    attacks = f.get("honest_part_error_max")
    if isinstance(attacks, dict):
        print("\nHonest members' largest distance from the honest mean after one round with one rogue, in units")
        print("of the farthest honest input's (1: within the honest spread):")
        print_table(["<30", ">12", ">12", ">12"], ["attack", "off", "clip", "verify"],
                    [(a, *(f"{v[m]:.3g}" for m in ("off", "clip", "verify"))) for a, v in attacks.items()])
        print(f"rogue reducer caught in round: {f.get('rogue_reducer_caught_rounds')} (target <= 1)")
    for key, value in f.items():
        if key.endswith("_error") or (key == "allreduce_errors" and value):
            print(f"{key}: {value}")


def print_training(f: dict) -> None:
    runs = [k.removeprefix("training_loss_") for k in f if k.startswith("training_loss_") and isinstance(f[k], dict)]
    epochs = sorted({e for r in runs for e in f[f"training_loss_{r}"]})
    print_table([">6", *([">14"] * len(runs))], ["epoch", *runs],
                [(e, *(f"{f[f'training_loss_{r}'][e]:.4f}" if e in f[f"training_loss_{r}"] else "-" for r in runs))
                 for e in epochs])
    ratio = f.get("training_loss_ratio_attacked_vs_honest")
    if ratio is None:
        print(f"training: {f.get('training_error')}")
        return
    epochs = f.get("training_epochs_compared") or [0]
    print(f"loss attacked / honest (verify), mean of epochs {epochs[0]}-{epochs[-1]}: {ratio:.3f} (target <= 1.10); "
          f"second half alone: {f.get('training_loss_ratio_attacked_vs_honest_second_half', 0):.3f}")
    if f.get("training_loss_ratio_attacked_off_vs_honest") is not None:
        print(f"  the same attack with byzantine=off: {f['training_loss_ratio_attacked_off_vs_honest']:.3g}")


if __name__ == "__main__":
    main()
