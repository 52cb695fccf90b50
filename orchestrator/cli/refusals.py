"""What ``up`` and ``resume`` refuse with: one message, exit 2, nothing created or launched."""

from __future__ import annotations


class NotStarted(RuntimeError):
    """``up`` or ``resume`` refused before anything was created or launched."""


class ResumeError(NotStarted):
    """``resume``'s TARGET names no run this machine has or can restore; nothing was started."""
