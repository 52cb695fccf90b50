"""Floods by one member or address: silent connections and trickled frames leave others served."""

from __future__ import annotations

import asyncio

import pytest
import torch

from p2p import Limits

from .test_prehandshake import MiB, RawMember, authority, closed_by_peer, echo, nodes, size, until  # noqa: F401

pytestmark = pytest.mark.timeout(60)
KiB = 1 << 10


async def test_silent_connections_from_one_address_leave_a_member_room_to_get_in(nodes):  # noqa: F811
    node = await nodes(limits=Limits(max_half_open=32, max_half_open_per_address=4, handshake_timeout=30.0))
    node.register("echo", echo)
    held = []
    for _ in range(60):  # more than the node's whole cap, all from one stranger's address
        held.append(await asyncio.open_connection(node.address.host, node.address.port,
                                                  local_addr=("127.0.0.66", 0)))
    try:
        # the node holds at most half its cap (where the per-address bound starts) plus that bound
        await until(lambda: node.num_half_open <= 16 + 4, 10)
        newcomer = await nodes()
        assert await newcomer.call(node.address, "echo", 7, timeout=10) == 7
    finally:
        for _, writer in held:
            writer.close()



async def test_a_trickled_frame_is_closed_and_another_members_small_call_is_served_meanwhile(nodes, authority):  # noqa: F811
    limits = Limits(max_pending_frame_bytes=256 * MiB, frame_floor_rate=256 * KiB, frame_rate_grace=0.3,
                    frame_rate_window=0.3)
    node = await nodes(limits=limits)
    node.register("size", size)
    hog = await RawMember.connect(node, authority)
    hog.declare("size", 250 * MiB)  # almost all of the budget, then a trickle far under the floor
    await until(lambda: node.frame_budget.reserved >= 250 * MiB)
    honest = await nodes()
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await honest.call(node.address, "size", torch.zeros(MiB, dtype=torch.uint8), timeout=10) == MiB
    assert loop.time() - started < 1.0  # served from the spare budget, not after the hog
    hog.writer.write(b"x" * KiB)
    assert await closed_by_peer(hog.reader)  # under the floor: closed, its budget taken back
    hog.close()
    await until(lambda: node.frame_budget.reserved == 0)
