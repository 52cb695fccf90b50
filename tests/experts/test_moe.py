"""RemoteMixtureOfExperts against servers on loopback: exactness, k_min, dead and dying experts."""

from __future__ import annotations

import concurrent.futures
import copy
import itertools
import time
from pathlib import Path

import pytest
import torch

from experts import ExpertBackend, NotEnoughExperts, RemoteMixtureOfExperts, declare_experts
from experts.grid import make_uid

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.timeout(90)


def frozen(uid: str, hidden: int, kind: str = "ffn") -> ExpertBackend:
    return ExpertBackend.from_kind(uid, kind, hidden, optimizer=lambda p: torch.optim.SGD(p, lr=0.0))


def reference_mixture(moe: RemoteMixtureOfExperts, modules: dict[tuple[int, ...], torch.nn.Module],
                      x: torch.Tensor, k: int) -> torch.Tensor:
    """The same layer computed locally: brute-force top-k by summed grid scores, softmax over them."""
    scores = moe.proj(x).split(moe.grid_size, dim=1)
    rows = []
    for r in range(x.shape[0]):
        total = {c: sum(s[r, i] for s, i in zip(scores, c, strict=True)) for c in modules}
        best = sorted(total, key=lambda c: float(total[c].detach()), reverse=True)[:k]
        weights = torch.softmax(torch.stack([total[c] for c in best]), dim=0)
        rows.append(sum(w * modules[c](x[r:r + 1])[0] for w, c in zip(weights, best, strict=True)))
    return torch.stack(rows)


def test_mixture_matches_a_local_reference_when_all_experts_answer(start_server, client_dht):
    torch.manual_seed(0)
    grid, hidden = (2, 3), 12
    coords = list(itertools.product(*map(range, grid)))
    backends = {c: frozen(make_uid("ffn", c), hidden) for c in coords}
    local = {c: copy.deepcopy(b.module) for c, b in backends.items()}
    start_server([backends[c] for c in coords if c[0] == 0])
    start_server([backends[c] for c in coords if c[0] == 1])

    moe = RemoteMixtureOfExperts(hidden, grid, "ffn", k_best=3, k_min=3, forward_timeout=20, dht=client_dht)
    ref_moe = copy.deepcopy(moe.proj)
    x = torch.randn(10, hidden, requires_grad=True)
    w = torch.randn(10, hidden)
    out = moe(x)
    (out * w).sum().backward()
    assert all(len(c) == 3 for c in moe.last_call.chosen) and not moe.last_call.failed
    assert moe.last_call.backward_answered == moe.last_call.answered

    x_ref = x.detach().clone().requires_grad_()
    holder = copy.copy(moe)
    holder.proj = ref_moe
    ref = reference_mixture(holder, local, x_ref, 3)
    (ref * w).sum().backward()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(moe.proj.weight.grad, ref_moe.weight.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(moe.proj.bias.grad, ref_moe.bias.grad, atol=1e-5, rtol=1e-4)

    leading = moe(torch.randn(2, 3, hidden))  # any leading shape
    assert leading.shape == (2, 3, hidden)


def test_fewer_than_k_min_answers_is_an_error_or_zeros(start_server, client_dht):
    torch.manual_seed(1)
    hidden = 8
    alive = frozen("ffn.0", hidden)
    alive_local = copy.deepcopy(alive.module)
    start_server([alive])
    # declared but nobody listens there: a crashed server whose records have not expired yet
    gone = start_server([frozen("ffn.9", hidden)])
    dead_address = gone.address
    gone.shutdown()
    client_dht.run_coroutine(lambda node: declare_experts(node, ["ffn.1", "ffn.2"], dead_address, time.time() + 60))

    x = torch.randn(4, hidden)
    strict = RemoteMixtureOfExperts(hidden, [3], "ffn", k_best=3, k_min=2, forward_timeout=10, dht=client_dht)
    with pytest.raises(NotEnoughExperts, match="fewer than k_min=2"):
        strict(x)
    assert strict.last_call.answered == {"ffn.0"} and set(strict.last_call.failed) == {"ffn.1", "ffn.2"}

    lenient = RemoteMixtureOfExperts(hidden, [3], "ffn", k_best=3, k_min=2, forward_timeout=10, dht=client_dht,
                                     allow_zero_outputs=True)
    assert torch.equal(lenient(x), torch.zeros(4, hidden))

    one = RemoteMixtureOfExperts(hidden, [3], "ffn", k_best=3, k_min=1, forward_timeout=10, dht=client_dht)
    one.proj.load_state_dict(strict.proj.state_dict())
    y = one(x)  # the only live expert answers alone: softmax over it gives it weight 1
    y.sum().backward()
    torch.testing.assert_close(y, alive_local(x), atol=1e-5, rtol=1e-4)
    assert one.last_call.answered == {"ffn.0"} and one.last_call.backward_answered == {"ffn.0"}


def test_a_server_killed_mid_forward_leaves_the_rest_answering_within_the_timeout(
        start_server, client_dht, dht_boot, server_process):
    torch.manual_seed(2)
    hidden = 8
    healthy = {i: frozen(f"ffn.{i}", hidden) for i in (0, 1)}
    local = {(i,): copy.deepcopy(b.module) for i, b in healthy.items()}
    start_server(list(healthy.values()))
    victim = server_process("--expert-cls", "stall", "--custom-module", str(HERE / "custom_experts.py"),
                            "--hidden-dim", str(hidden), "--expert-uids", "ffn.2", "--num-threads", "1",
                            "--initial-peers", *dht_boot.addresses)
    victim.address  # noqa: B018 - waits until it is up and declared

    forward_timeout = 30.0
    moe = RemoteMixtureOfExperts(hidden, [3], "ffn", k_best=3, k_min=2, forward_timeout=forward_timeout,
                                 timeout_after_k_min=20.0, dht=client_dht)
    x = torch.randn(5, hidden, requires_grad=True)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        future = pool.submit(moe, x)
        victim.wait_line("FORWARD_STARTED", timeout=30)  # the victim is inside its expert's forward
        assert victim.kill() == -9
        out = future.result(timeout=forward_timeout)
        elapsed = time.monotonic() - started
    assert elapsed < forward_timeout
    assert moe.last_call.answered == {"ffn.0", "ffn.1"} and set(moe.last_call.failed) == {"ffn.2"}
    out.sum().backward()
    assert moe.last_call.backward_answered == {"ffn.0", "ffn.1"}
    # the answer is the mixture of the survivors alone
    holder = copy.copy(moe)
    ref = reference_mixture(holder, local, x.detach(), 2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


def test_a_dead_holder_is_replaced_by_another_replica_within_the_same_call(start_server, client_dht):
    torch.manual_seed(4)
    hidden = 8
    backends = {i: frozen(f"ffn.{i}", hidden) for i in (0, 1)}
    local = {(i,): copy.deepcopy(b.module) for i, b in backends.items()}
    servers = [start_server([copy.deepcopy(b) for b in backends.values()], update_period=30) for _ in range(2)]
    moe = RemoteMixtureOfExperts(hidden, [2], "ffn", k_best=2, k_min=2, forward_timeout=10, backward_timeout=10,
                                 dht=client_dht)
    found = {e.address for row in moe.find_experts([torch.zeros(1, 2).numpy()]) for e in row}
    assert len(found) == 1  # beam search names one holder: the newest declaration of the prefix
    dead = next(s for s in servers if s.address in found)
    alive = next(s for s in servers if s is not dead)
    dead.shutdown(withdraw=False)  # a crash: its records stay in the DHT until they expire

    x = torch.randn(6, hidden, requires_grad=True)
    out = moe(x)  # every expert is found at the dead server, and every call goes on to the other holder
    out.sum().backward()
    assert moe.last_call.answered == moe.last_call.backward_answered == {"ffn.0", "ffn.1"}
    assert not moe.last_call.failed
    torch.testing.assert_close(out, reference_mixture(copy.copy(moe), local, x.detach(), 2), atol=1e-5, rtol=1e-4)
    assert requests(alive) == {"forward": 2, "backward": 2}
    stats = moe.take_stats()
    assert stats["calls_meeting_k_min"] == 1 and stats["failovers"] == 2

    moe(torch.randn(3, hidden))  # the dead server is passed over at once now: no more failovers
    assert moe.take_stats()["failovers"] == 0 and requests(alive)["forward"] == 4


def requests(server) -> dict[str, int]:
    stats = server.server.stats.values()
    return {way: int(sum(s[f"requests_{way}"] for s in stats)) for way in ("forward", "backward")}
