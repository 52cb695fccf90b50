"""Preemption notices seen from the instance itself.

A cloud tells the machine it is about to take back before it tells anyone else: EC2 through the
instance metadata service (IMDSv2: ``spot/instance-action``, two minutes ahead, and the earlier
rebalance recommendation).  A watcher on every instance polls it and hands the notice to the
worker, which trains through most of it and leaves gracefully; the supervisor learns of it from
the worker.  Standard library only: this runs in every worker process.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

logger = logging.getLogger(__name__)

IMDS_DEFAULT = "http://169.254.169.254/"
_TOKEN_TTL_S = 21600


@dataclass
class InstanceNotice:
    kind: str  # "terminate", "stop", "hibernate" (the machine goes) or "rebalance" (it is at risk)
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
