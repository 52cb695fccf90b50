"""Cloud Storage for the tests: ``gcp-storage-emulator`` (the package on the index), its HTTP server in
this process on a loopback port; gcsfs speaks to it anonymously (``checkpoint.endpoint_url``)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from orchestrator.host.ports import free_port


@contextmanager
def gcs_emulator(bucket: str | None = None) -> Iterator[str]:
    """An in-memory emulator (holding ``bucket``, if named): its URL while it runs."""
    from gcp_storage_emulator.server import create_server

    logging.getLogger("gcp_storage_emulator").setLevel(logging.WARNING)  # a line per request otherwise
    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
