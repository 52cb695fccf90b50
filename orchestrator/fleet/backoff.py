"""When the fleet may launch again after failures: launches the cloud refused, and instances that died
while booting (a broken image or boot script, a full disk).  Both back off exponentially instead of
buying machines as fast as they fail; a worker that starts resets both."""

from __future__ import annotations


class LaunchBackoff:
    #: clock seconds before the first relaunch after a failure (then doubling, up to an hour)
    base_s: float = 30.0

    def __init__(self) -> None:
        self.launch_failures = 0
        self.boot_failures = 0
        self.not_before = float("-inf")

    def may_launch(self, now: float) -> bool:
        return now >= self.not_before

    def launch_failed(self, now: float) -> float:
        """One more launch in a row failed: the seconds until the next one."""
        self.launch_failures += 1
        wait = min(self.base_s * 2 ** (self.launch_failures - 1), 3600.0)
        self.not_before = max(self.not_before, now + wait)
        return wait

    def boot_failed(self, now: float) -> float | None:
        """One more instance in a row died while booting: the seconds until the next launch, or None
        for the first (a machine reclaimed or killed while booting is relaunched at once)."""
        self.boot_failures += 1
        if self.boot_failures == 1:
            return None
        wait = min(self.base_s * 2 ** (self.boot_failures - 2), 3600.0)
        self.not_before = now + wait
        return wait

    def launched(self) -> None:
        self.launch_failures = 0

    def worker_started(self) -> None:
        self.boot_failures = 0
        self.launch_failures = 0
