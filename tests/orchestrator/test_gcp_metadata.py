"""The instance-side GCE notice watcher against a fake metadata server (aiohttp, real HTTP): it
sends ``Metadata-Flavor: Google``, honours GCE_METADATA_HOST, long-polls ``instance/preempted``
(one request per change, not a poll every few seconds) and reports the preemption once."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

import pytest

from orchestrator.host.wait import wait_for
from orchestrator.instance.notices import (
    GCE_PREEMPTION_NOTICE_S,
    GceMetadataClient,
    GceNoticeWatcher,
    NoticeWatcher,
    instance_watch,
    start_watcher,
)

pytestmark = pytest.mark.timeout(30)


def until(predicate, timeout: float = 10.0) -> None:
    wait_for(predicate, timeout, "the metadata server or the watcher", every=0.02)


def test_client_reads_the_flag_with_the_header_from_gce_metadata_host(gce_metadata, monkeypatch):
    monkeypatch.setenv("GCE_METADATA_HOST", gce_metadata.host)
    client = GceMetadataClient()  # the host from the environment, as google-auth takes it
    assert client.base == f"http://{gce_metadata.host}/computeMetadata/v1"
    assert client.get("instance/zone")[0] == "projects/123456789/zones/us-central1-a"
    assert client.preempted() == (False, gce_metadata.etag)
    gce_metadata.preempt()
    assert client.preempted() == (True, gce_metadata.etag)
    with pytest.raises(urllib.error.HTTPError, match="403"):  # the server's side of the bargain: no header, no data
        urllib.request.urlopen(f"http://{gce_metadata.host}/computeMetadata/v1/instance/preempted", timeout=5)


def test_watcher_long_polls_and_reports_the_preemption_once(gce_metadata):
    seen = []
    done = threading.Event()

    def on_notice(notice) -> None:
        seen.append(notice)
        done.set()

    watcher = GceNoticeWatcher(on_notice, client=GceMetadataClient(gce_metadata.host), wait_s=20).start()
    try:
        until(lambda: gce_metadata.waiting == 1)  # one request held by the server, waiting for a change
        assert [wait for _, _, wait in gce_metadata.reads] == [False, True]
        before = time.time()
        gce_metadata.preempt()
        assert done.wait(5)
        [notice] = seen
        assert (notice.kind, notice.deadline_s) == ("preempted", GCE_PREEMPTION_NOTICE_S)
        assert notice.seen_at - before < 2  # the long poll answers at once, not at the next poll
        watcher._thread.join(timeout=5)
        assert not watcher._thread.is_alive()  # nothing more to watch once the machine is going
        assert len(gce_metadata.reads) == 2
    finally:
        watcher.stop()


def test_a_preemption_before_the_watcher_started_is_seen_at_once(gce_metadata):
    gce_metadata.preempt()
    seen = []
    watcher = GceNoticeWatcher(seen.append, deadline_s=12.0, client=GceMetadataClient(gce_metadata.host)).start()
    watcher._thread.join(timeout=5)
    assert [(n.kind, n.deadline_s) for n in seen] == [("preempted", 12.0)]
    assert [wait for _, _, wait in gce_metadata.reads] == [False]


def test_a_stopped_watcher_reports_nothing(gce_metadata):
    seen = []
    watcher = GceNoticeWatcher(seen.append, client=GceMetadataClient(gce_metadata.host), wait_s=20).start()
    until(lambda: gce_metadata.waiting == 1)
    watcher.stop()
    gce_metadata.preempt()
    watcher._thread.join(timeout=5)
    assert not watcher._thread.is_alive() and seen == []


def test_unreachable_metadata_is_not_fatal(caplog):
    watcher = GceNoticeWatcher(lambda n: None, interval_s=0.05,
                               client=GceMetadataClient("127.0.0.1:9", timeout=0.2)).start()
    until(lambda: "unreadable" in caplog.text)
    assert watcher._thread.is_alive()
    watcher.stop()
    watcher._thread.join(timeout=5)
    assert not watcher._thread.is_alive()


def test_the_worker_watches_what_its_cloud_says(monkeypatch):
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", "http://127.0.0.1:9/")  # never a real metadata service
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:9")
    assert instance_watch("local", 120) is None
    assert instance_watch("aws", 120) == {"kind": "aws", "interval_s": 2.0}
    assert instance_watch("gcp", 120) == {"kind": "gcp", "interval_s": 2.0, "deadline_s": 30.0}  # GCE's 30 s
    assert instance_watch("gcp", 12)["deadline_s"] == 12  # a shorter window (the tests' fake GCE)
    aws = start_watcher({"interval_s": 60}, lambda n: None)  # no kind: EC2's, as before
    gcp = start_watcher({"kind": "gcp", "interval_s": 60, "deadline_s": 12}, lambda n: None)
    try:
        assert isinstance(aws, NoticeWatcher) and isinstance(gcp, GceNoticeWatcher) and gcp.deadline_s == 12
        assert gcp.client.host == "127.0.0.1:9"
    finally:
        aws.stop()
        gcp.stop()
    with pytest.raises(ValueError, match="azure"):
        start_watcher({"kind": "azure"}, lambda n: None)
