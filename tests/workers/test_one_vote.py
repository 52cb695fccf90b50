"""One vote per epoch: a member whose round failed it but not the others never averages again for
that epoch while they may have stepped.  Five peers count with a quorum of three; peer C loses one
part of the first round (A and B hold its average and step), and the late D and E start just as it
fails: C, D and E are three, and averaging together they would step apart from A and B."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from averaging.allreduce import AllReduceRound
from dht import DHT
from tests.workers.local_dhts import signed_dhts
from workers.collaborative import CollaborativeOptimizer

pytestmark = pytest.mark.timeout(90)
PEERS, SIZE = 5, 64


class LosesOnePartOnce(AllReduceRound):
    """Its first round loses another member's part: that member's answer never comes back to us
    (the reducer drops us as a sender, the others get the part averaged)."""

    rounds: list[bool] = []  # per round run: whether it lost a part
    failed = threading.Event()

    async def run(self, deadline: float):
        first = not LosesOnePartOnce.rounds
        LosesOnePartOnce.rounds.append(first)
        try:
            return await super().run(deadline)
        finally:
            if first:
                LosesOnePartOnce.failed.set()

    async def _exchange(self, j: int, deadline: float) -> None:
        if LosesOnePartOnce.rounds == [True] and j == next(i for i in range(self.group.size)
                                                           if i != self.group.my_index):
            self._drop(j, "the test cut this part")
            self.outcome.unaveraged.add(j)
            return
        await super()._exchange(j, deadline)


def test_a_member_whose_round_failed_it_waits_for_the_state_of_those_that_stepped(wait_for):
    dhts: list[DHT] = []
    opts: list[CollaborativeOptimizer] = []
    params = [torch.nn.Parameter(torch.zeros(SIZE)) for _ in range(PEERS)]
    gradients = [torch.full((SIZE,), float(i + 1)) for i in range(PEERS)]
    try:
        signed_dhts(PEERS, into=dhts)
        for param, dht in zip(params, dhts, strict=True):
            opts.append(CollaborativeOptimizer(torch.optim.SGD([param], lr=1.0), dht, "vote",
                                               target_batch_size=PEERS * 8, min_matchmaking_time=0.5,
                                               averaging_timeout=20, load_state_on_start=False))
        opts[2].averager.round_class = LosesOnePartOnce

        def all_seen() -> bool:
            for opt in opts:
                opt.keep_alive()
            return all(opt.tracker.view().live_peers == PEERS for opt in opts)

        wait_for(all_seen, 30, "every view to hold five peers")
        done = threading.Barrier(PEERS + 1)

        def train(i: int) -> None:
            try:
                if i >= 3:  # D and E: late, they start as C's first round fails
                    LosesOnePartOnce.failed.wait(60)
                deadline = time.monotonic() + 60  # bounded: a peer that never steps fails the assertions below
                while time.monotonic() < deadline:
                    params[i].grad = gradients[i].clone()
                    opts[i].step(2)
                    if opts[i].epoch > 0:
                        return
                    time.sleep(0.001)  # a micro-batch's compute: five busy loops would starve two cores
            finally:
                done.wait()

        threads = [threading.Thread(target=train, args=(i,), daemon=True) for i in range(PEERS)]
        for t in threads:
            t.start()
        done.wait(timeout=80)

        assert LosesOnePartOnce.rounds[0] is True  # C's first round did lose a part
        assert [opt.epoch for opt in opts] == [1] * PEERS
        assert opts[0].history[-1].group_id == opts[1].history[-1].group_id  # A and B stepped together
        # C averaged for epoch 0 once: it loaded A's and B's state instead of forming a second group
        assert LosesOnePartOnce.rounds == [True]
        assert opts[2].history == []
        assert all(torch.equal(p, params[0]) for p in params)  # the same parameters everywhere, bit for bit
    finally:
        for opt in reversed(opts):
            opt.prepare_to_leave()
        for dht in dhts:
            dht.shutdown()
