"""A peer in its own process for tests that kill it: prints its address, streams until killed."""

from __future__ import annotations

import asyncio
import sys

import torch

from p2p import P2P, CallKind


async def main() -> None:
    node = await P2P.create()

    async def chunks(size, ctx):
        block = torch.ones(size)
        while True:
            yield block

    async def echo(request, ctx):
        return request

    node.register("chunks", chunks, CallKind.SERVER_STREAM)
    node.register("echo", echo)
    print(node.address, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
