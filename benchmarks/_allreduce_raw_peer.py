"""One raw-socket peer of ``bench_allreduce.py``: moves an all-reduce's bytes, does no arithmetic.

Peer i owns part i of the vector (``--parts`` gives every part's size).  Reduce-scatter volume:
it sends its slice of part j to peer j and receives every other peer's slice of part i; then
all-gather volume: it sends part i to every peer and receives part j from peer j.  Each pair
shares one TCP connection; every pair runs concurrently (one sending and one receiving thread
per remote peer, ``sendall`` / ``recv_into`` into preallocated buffers).  A peer starts its
all-gather sends once its own part has fully arrived, as a reducer of whole parts would
(``--overlap``: at once, as a perfectly pipelined reducer could: the pure transport's time).

Protocol with the parent (lines on stdin, one JSON object per line on stdout): it prints
``{"port": p}``; ``peers h:p,h:p,...`` connects the mesh; ``go <k>`` runs once and prints
``{"t_start", "t_end"}`` (``time.monotonic``, shared by all processes on the machine); ``quit``.
"""

from __future__ import annotations

import argparse
import resource
import socket
import sys
import threading
import time

import numpy as np
from _common import emit


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k


def exchange(me: int, parts: list[int], socks: dict[int, socket.socket], part, inbox: memoryview,
             overlap: bool) -> list[str]:
    """One all-reduce's worth of bytes with every other peer at once; returns the errors."""
    n = len(parts)
    mine = part(me)
    nbytes = parts[me] * 4
    rs_left = [n - 1]
    lock = threading.Lock()
    rs_done = threading.Event()
    if n == 1 or overlap:
        rs_done.set()
    errors: list[str] = []

    def sender(j: int) -> None:
        try:
            socks[j].sendall(part(j))  # reduce-scatter: my slice of part j
            rs_done.wait()
            socks[j].sendall(mine)  # all-gather: my reduced part
        except OSError as e:
            errors.append(f"send to {j}: {e}")

    def receiver(j: int, slot: int) -> None:
        try:
            recv_exact(socks[j], inbox[slot * nbytes:(slot + 1) * nbytes])
            with lock:
                rs_left[0] -= 1
                if rs_left[0] == 0:
                    rs_done.set()
            recv_exact(socks[j], part(j))
        except OSError as e:
            errors.append(f"recv from {j}: {e}")
            rs_done.set()

    others = [j for j in range(n) if j != me]
    threads = [threading.Thread(target=sender, args=(j,)) for j in others]
    threads += [threading.Thread(target=receiver, args=(j, k)) for k, j in enumerate(others)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--parts", required=True, help="comma-separated part sizes (elements)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--client", default="", help="comma-separated indices of peers that only dial")
    parser.add_argument("--overlap", action="store_true",
                        help="start the all-gather sends at once instead of after my part arrived")
    args = parser.parse_args()
    me = args.index
    parts = [int(x) for x in args.parts.split(",")]
    n = len(parts)
    clients = {int(x) for x in args.client.split(",") if x}
    offsets = np.concatenate([[0], np.cumsum(parts)]).astype(np.int64)
    vec = np.ones(int(offsets[-1]) * 4, dtype=np.uint8)  # the vector's bytes
    inbox = np.ones(max(parts[me], 1) * 4 * max(n - 1, 1), dtype=np.uint8)  # slices of my part
    vview, iview = memoryview(vec), memoryview(inbox)

    def part(j: int) -> memoryview:
        return vview[int(offsets[j]) * 4:int(offsets[j + 1]) * 4]

    def dials(a: int, b: int) -> bool:  # does a dial b?
        if a in clients or b in clients:
            return a in clients
        return a < b

    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((args.host, 0))
    listener.listen(64)
    emit({"port": listener.getsockname()[1]})

    socks: dict[int, socket.socket] = {}
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        if cmd[0] == "peers":
            addrs = cmd[1].split(",")
            for j in range(n):
                if j != me and dials(me, j):
                    host, port = addrs[j].rsplit(":", 1)
                    s = socket.create_connection((host, int(port)), timeout=30)
                    s.sendall(me.to_bytes(4, "little"))
                    socks[j] = s
            expected = sum(1 for j in range(n) if j != me and dials(j, me))
            listener.settimeout(30)
            for _ in range(expected):
                s, _addr = listener.accept()
                j = int.from_bytes(s.recv(4, socket.MSG_WAITALL), "little")
                socks[j] = s
            for s in socks.values():
                s.settimeout(None)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            emit({"connected": sorted(socks)})
        elif cmd[0] == "go":
            cpu0 = time.process_time()
            t_start = time.monotonic()
            errors = exchange(me, parts, socks, part, iview, args.overlap)
            t_end = time.monotonic()
            emit({"go": int(cmd[1]), "t_start": t_start, "t_end": t_end, "cpu_s": time.process_time() - cpu0,
                  "errors": errors})
    for s in socks.values():
        s.close()
    listener.close()
    emit({"rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss})


if __name__ == "__main__":
    main()
