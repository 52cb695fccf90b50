"""A peer that joins an all-reduce and SIGKILLs itself after sending a few chunks (run as a process)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import torch

from averaging import DecentralizedAverager
from averaging.allreduce import AllReduceRound
from dht import DHTNode
from p2p.codecs import encode


def die_after(chunks: int) -> None:
    original = AllReduceRound._send_chunks

    async def send_then_die(self, call, part, to_send, window):
        for sent, chunk in enumerate(to_send):
            if sent == chunks:
                os.kill(os.getpid(), signal.SIGKILL)  # a real, abrupt death in the middle of the round
            await window.acquire()
            await call.send(encode(chunk.codec, self.flat.flat[chunk.start:chunk.end]))
        await original(self, call, part, [], window)

    AllReduceRound._send_chunks = send_then_die


async def main(bootstrap: str, size: int) -> None:
    node = await DHTNode.create([bootstrap])
    averager = DecentralizedAverager([torch.full((size,), 1000.0)], node, "kill", target_group_size=4,
                                     min_matchmaking_time=20.0, chunk_size=1024)
    print("ready", flush=True)
    await averager.step(timeout=60)
    print("survived: the test expected this peer to die", flush=True)


if __name__ == "__main__":
    die_after(int(sys.argv[3]))
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
