"""The local spot market: instances as Ray actors (``actors``) or as Ray nodes of their own (``nodes``),
with lifetimes drawn from a preemption model or replayed from a trace."""
