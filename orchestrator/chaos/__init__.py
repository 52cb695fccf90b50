"""Chaos runs: faults injected into a local ``nodes``-mode run while its invariants are checked."""
