"""Preemption notices seen from the instance itself.

A cloud tells the machine it is about to take back before it tells anyone else: EC2 through the
instance metadata service (IMDSv2: ``spot/instance-action``, two minutes ahead, and the earlier
rebalance recommendation), GCE through its metadata server (``instance/preempted`` turns TRUE
thirty seconds before the machine is stopped).  A watcher on every instance polls (EC2) or
long-polls (GCE) it and hands the notice to the worker, which trains through most of it and
leaves gracefully; the supervisor learns of it from the worker.  Standard library only: this
runs in every worker process.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

logger = logging.getLogger(__name__)

IMDS_DEFAULT = "http://169.254.169.254/"
_TOKEN_TTL_S = 21600
GCE_METADATA_DEFAULT = "metadata.google.internal"  # GCE_METADATA_HOST overrides it, as for google-auth
GCE_PREEMPTION_NOTICE_S = 30.0  # GCE stops a preempted VM 30 s after the notice (the ACPI soft off)


@dataclass
class InstanceNotice:
    # "terminate", "stop", "hibernate" (EC2), "preempted" (GCE): the machine goes; "rebalance": it is at risk
    kind: str
    seen_at: float  # wall clock
    deadline_s: float | None  # seconds from seen_at to the action (None for a rebalance recommendation)


def _parse_time(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class ImdsClient:
    """The few IMDSv2 reads a spot instance needs, honouring ``AWS_EC2_METADATA_SERVICE_ENDPOINT``
    as the AWS SDKs do (how tests point an instance at its own fake metadata server)."""

    def __init__(self, endpoint: str | None = None, timeout: float = 2.0) -> None:
        base = endpoint or os.environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT") or IMDS_DEFAULT
        self.base = base.rstrip("/")
        self.timeout = timeout
        self._token: str | None = None
        self._token_expires = 0.0

    def _fetch_token(self) -> str:
        request = urllib.request.Request(f"{self.base}/latest/api/token", method="PUT",
                                         headers={"X-aws-ec2-metadata-token-ttl-seconds": str(_TOKEN_TTL_S)})
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            self._token = response.read().decode().strip()
        self._token_expires = time.monotonic() + _TOKEN_TTL_S - 60
        return self._token

    def get(self, path: str) -> str | None:
        """The metadata at ``path`` (under /latest/meta-data/), or None when it does not exist."""
        for attempt in range(2):
            token = self._token if self._token and time.monotonic() < self._token_expires else self._fetch_token()
            request = urllib.request.Request(f"{self.base}/latest/meta-data/{path}",
                                             headers={"X-aws-ec2-metadata-token": token})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return response.read().decode()
            except urllib.error.HTTPError as e:
                if e.code == 404:
                    return None
                if e.code == 401 and attempt == 0:  # the token expired early: fetch a new one once
                    self._token = None
                    continue
                raise
        return None

    def spot_action(self) -> InstanceNotice | None:
        text = self.get("spot/instance-action")
        if text is None:
            return None
        data = json.loads(text)
        now = time.time()
        return InstanceNotice(str(data.get("action", "terminate")), now, max(_parse_time(data["time"]) - now, 0.0))

    def rebalance(self) -> InstanceNotice | None:
        text = self.get("events/recommendations/rebalance")
        return None if text is None else InstanceNotice("rebalance", time.time(), None)


class NoticeWatcher:
    """Polls the instance's metadata every ``interval_s`` on a daemon thread; calls ``on_notice``
    once for the interruption and once for a rebalance recommendation.  An unreachable metadata
    service is logged once and polled again (it may come up after the worker)."""

    def __init__(self, on_notice: Callable[[InstanceNotice], None], interval_s: float = 2.0,
                 client: ImdsClient | None = None) -> None:
        self.on_notice = on_notice
        self.interval_s = interval_s
        self.client = client or ImdsClient()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="notice-watcher", daemon=True)
        self._seen: set[str] = set()

    def start(self) -> NoticeWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.client.timeout * 3 + self.interval_s)

    def poll_once(self) -> list[InstanceNotice]:
        """One look at the metadata; the notices not reported before."""
        found = []
        for kind, read in (("action", self.client.spot_action), ("rebalance", self.client.rebalance)):
            if kind in self._seen:
                continue
            notice = read()
            if notice is not None:
                self._seen.add(kind)
                found.append(notice)
        return found

    def _run(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                notices = self.poll_once()
                failing = False
            except (OSError, ValueError, KeyError) as e:  # unreachable, or a reply we cannot read
                if not failing:
                    logger.warning("instance metadata at %s unreadable: %s; polling on", self.client.base, e)
                failing = True
                notices = []
            for notice in notices:
                try:
                    self.on_notice(notice)
                except Exception:
                    logger.exception("handling the %s notice failed", notice.kind)
            if "action" in self._seen:
                return  # the machine is going: nothing more to watch for
            self._stop.wait(self.interval_s)


# ---- GCE: the metadata server's preempted flag -------------------------------------------------
class GceMetadataClient:
    """Reads of a GCE instance's metadata server (``Metadata-Flavor: Google``), honouring
    ``GCE_METADATA_HOST`` (``host[:port]``) as google-auth does: how tests point an instance at
    its own fake metadata server."""

    def __init__(self, host: str | None = None, timeout: float = 2.0) -> None:
        self.host = host or os.environ.get("GCE_METADATA_HOST") or GCE_METADATA_DEFAULT
        self.base = f"http://{self.host}/computeMetadata/v1"
        self.timeout = timeout

    def get(self, path: str, wait_s: float | None = None, last_etag: str | None = None) -> tuple[str, str | None]:
        """The value at ``path`` (under /computeMetadata/v1/) and its ETag.  With ``wait_s`` the
        server holds the request until the value's ETag differs from ``last_etag`` (from the
        current one when None) or ``wait_s`` passed: a long poll, one request per change."""
        query: dict[str, str] = {}
        if wait_s is not None:
            query.update(wait_for_change="true", timeout_sec=str(max(int(wait_s), 1)))
            if last_etag:
                query["last_etag"] = last_etag
        url = f"{self.base}/{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
        with urllib.request.urlopen(request, timeout=self.timeout + (wait_s or 0.0)) as response:
            if response.headers.get("Metadata-Flavor") != "Google":  # a proxy or a captive portal, not GCE
                raise ValueError(f"{self.base} answered without Metadata-Flavor: Google")
            return response.read().decode().strip(), response.headers.get("ETag")

    def preempted(self, wait_s: float | None = None, last_etag: str | None = None) -> tuple[bool, str | None]:
        """Whether GCE is preempting this instance (``instance/preempted`` is TRUE), and the ETag."""
        text, etag = self.get("instance/preempted", wait_s, last_etag)
        return text.upper() == "TRUE", etag


class GceNoticeWatcher:
    """Long-polls ``instance/preempted`` on a daemon thread and calls ``on_notice`` once, with
    ``InstanceNotice("preempted", now, deadline_s)``: GCE says no time, its window is a fixed 30 s.
    The first read does not wait (a preemption that came before the watcher is seen at once);
    then each request waits for the ETag to change.  An unreachable server is logged once and
    asked again every ``interval_s``."""

    def __init__(self, on_notice: Callable[[InstanceNotice], None], deadline_s: float = GCE_PREEMPTION_NOTICE_S,
                 interval_s: float = 2.0, wait_s: float = 60.0, client: GceMetadataClient | None = None) -> None:
        self.on_notice = on_notice
        self.deadline_s = deadline_s
        self.interval_s = interval_s
        self.wait_s = wait_s
        self.client = client or GceMetadataClient()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gce-notice-watcher", daemon=True)

    def start(self) -> GceNoticeWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching.  A long poll in flight is abandoned, not awaited (the thread is a daemon
        and reports nothing once stopped)."""
        self._stop.set()

    def _run(self) -> None:
        etag: str | None = None
        read_once = failing = False
        while not self._stop.is_set():
            try:
                preempted, etag = self.client.preempted(self.wait_s if read_once else None, etag)
                read_once, failing = True, False
            except (OSError, ValueError) as e:  # unreachable, or not a metadata server
                if not failing:
                    logger.warning("GCE metadata at %s unreadable: %s; asking again", self.client.base, e)
                read_once, failing, etag = False, True, None
                self._stop.wait(self.interval_s)
                continue
            if preempted and not self._stop.is_set():
                try:
                    self.on_notice(InstanceNotice("preempted", time.time(), self.deadline_s))
                except Exception:
                    logger.exception("handling the preemption notice failed")
                return  # the machine is going: nothing more to watch for


def instance_watch(provider_type: str, notice_period_s: float) -> dict[str, Any] | None:
    """What a cloud instance's worker watches for its own notice (``WorkerActor.start``'s
    ``watch``), or None where the supervisor tells the workers (the local simulator).  GCE's
    window is 30 s; a shorter ``spot.notice_period_s`` is honoured (the tests' fake GCE)."""
    if provider_type == "aws":
        return {"kind": "aws", "interval_s": 2.0}
    if provider_type == "gcp":
        return {"kind": "gcp", "interval_s": 2.0, "deadline_s": min(GCE_PREEMPTION_NOTICE_S, notice_period_s)}
    return None


def start_watcher(watch: dict[str, Any], on_notice: Callable[[InstanceNotice], None]) -> Any:
    """Start the watcher ``watch`` names (``instance_watch``'s answer; no kind means EC2's)."""
    kind = watch.get("kind", "aws")
    interval_s = float(watch.get("interval_s", 2.0))
    if kind == "gcp":
        deadline_s = float(watch.get("deadline_s", GCE_PREEMPTION_NOTICE_S))
        return GceNoticeWatcher(on_notice, deadline_s=deadline_s, interval_s=interval_s).start()
    if kind == "aws":
        return NoticeWatcher(on_notice, interval_s=interval_s).start()
    raise ValueError(f"no notice watcher for {kind!r} (known: aws, gcp)")
