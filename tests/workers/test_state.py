"""State hand-off between two real DHT peers on loopback, while the donor keeps training."""

from __future__ import annotations

import pytest
import torch

from dht import DHTNode, SignatureValidator
from p2p import Identity
from workers.state import StateSharer

pytestmark = pytest.mark.timeout(60)


class Donor:
    """A stand-in training loop: its epoch and parameters change between calls."""

    def __init__(self) -> None:
        self.epoch = 2

    def state(self) -> tuple[int, dict]:
        return self.epoch, {"params": [torch.full((1000,), float(self.epoch))], "step": self.epoch}


async def _node(initial=()) -> tuple[DHTNode, SignatureValidator]:
    identity = Identity()
    signer = SignatureValidator(identity)
    node = await DHTNode.create(list(initial), identity=identity, validators=[signer])
    return node, signer


async def test_a_donor_that_moved_on_since_its_advert_still_hands_over_its_fresher_state():
    donor_node, donor_signer = await _node()
    taker_node, taker_signer = await _node([str(donor_node.address)])
    donor = Donor()
    giver = StateSharer(donor_node, "run", donor_signer, donor.state)
    taker = StateSharer(taker_node, "run", taker_signer, lambda: (0, {}))
    try:
        await giver.advertise(2)
        donor.epoch = 3  # trained on after advertising: the advert says 2, the donor holds 3
        epoch, state = await taker.download(min_epoch=2)
        assert epoch == 3 and state["step"] == 3
        assert torch.equal(state["params"][0], torch.full((1000,), 3.0))
    finally:
        giver.close()
        taker.close()
        await taker_node.shutdown()
        await donor_node.shutdown()


async def test_tensors_come_from_the_snapshot_the_metadata_described():
    donor_node, donor_signer = await _node()
    taker_node, _ = await _node([str(donor_node.address)])
    donor = Donor()
    giver = StateSharer(donor_node, "run", donor_signer, donor.state)
    try:
        meta = await taker_node.p2p.call(str(donor_node.address), giver.meta_method, None, timeout=10)
        assert meta["epoch"] == 2
        donor.epoch = 4  # the donor steps between the metadata and the tensors
        async with await taker_node.p2p.call_stream(str(donor_node.address), giver.data_method,
                                                    {"epoch": 2, "idx": [0]}, timeout=10) as call:
            items = [item async for item in call]
        assert len(items) == 1 and items[0]["h"] == meta["sums"][0]
        assert torch.equal(items[0]["t"], torch.full((1000,), 2.0))
    finally:
        giver.close()
        await taker_node.shutdown()
        await donor_node.shutdown()
