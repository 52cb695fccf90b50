"""A training worker (``spotswarm worker`` flags) whose averaging attacks every round: as a sender it
sends each chunk times 50 (under the 100x norm screen), as a reducer it serves 1e30 for its part.
bench_security.py --training runs it beside honest workers."""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from averaging import DecentralizedAverager  # noqa: E402
from averaging.allreduce import AllReduceRound  # noqa: E402
from averaging.partition import Chunk  # noqa: E402


class Hostile(AllReduceRound):
    def _outgoing(self, chunk: Chunk) -> dict:
        payload = super()._outgoing(chunk)
        return {**payload, "d": payload["d"] * 50}

    async def serve(self, *args: Any, **kwargs: Any) -> Any:
        async for payload in super().serve(*args, **kwargs):
            yield {**payload, "d": torch.full_like(payload["d"], 1e30)}


if __name__ == "__main__":
    DecentralizedAverager.round_class = Hostile
    from orchestrator.cli.main import main

    sys.exit(main(sys.argv[1:]))
