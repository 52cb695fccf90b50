"""The instance-side notice watcher against a fake IMDSv2 (aiohttp, real HTTP): it presents a
session token, finds the interruption notice and the rebalance recommendation, and reports each once."""

from __future__ import annotations

import threading

import pytest

from orchestrator.host.wait import wait_for
from orchestrator.instance.notices import ImdsClient, NoticeWatcher

pytestmark = pytest.mark.timeout(30)


def test_client_uses_a_token_and_reads_the_notice(fake_imds, monkeypatch):
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", fake_imds.url)
    client = ImdsClient()  # the endpoint from the environment, as the AWS SDKs take it
    assert client.get("instance-id") == "i-0123456789abcdef0"
    assert client.spot_action() is None and client.rebalance() is None
    fake_imds.announce("terminate", 120)
    notice = client.spot_action()
    assert notice.kind == "terminate" and 115 <= notice.deadline_s <= 121
    fake_imds.tokens.clear()  # the token expired: the client fetches a new one and reads again
    assert client.get("instance-id") == "i-0123456789abcdef0"
    assert len(fake_imds.tokens) == 1


def test_watcher_reports_each_notice_once_then_stops(fake_imds):
    seen = []
    done = threading.Event()

    def on_notice(notice) -> None:
        seen.append(notice.kind)
        if notice.kind == "terminate":
            done.set()

    watcher = NoticeWatcher(on_notice, interval_s=0.05, client=ImdsClient(fake_imds.url)).start()
    try:
        fake_imds.rebalance = {"noticeTime": "2026-11-23T10:00:00Z"}
        fake_imds.announce("terminate", 30)
        assert done.wait(10)
        reads = len(fake_imds.reads)
        watcher._thread.join(timeout=5)
        assert not watcher._thread.is_alive()  # nothing more to watch once the machine is going
        assert sorted(seen) == ["rebalance", "terminate"] and len(fake_imds.reads) == reads
    finally:
        watcher.stop()


def test_unreachable_metadata_is_not_fatal(caplog):
    watcher = NoticeWatcher(lambda n: None, interval_s=0.05, client=ImdsClient("http://127.0.0.1:9", timeout=0.2))
    watcher.start()
    wait_for(lambda: "unreadable" in caplog.text, 10, "the watcher's first failed poll")
    assert watcher._thread.is_alive()
    watcher.stop()
    assert not watcher._thread.is_alive()
