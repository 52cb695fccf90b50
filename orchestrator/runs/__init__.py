"""A run on disk: its store, checkpoints, logs, pid, durable archive, figures and invariants.  Read by
the CLI, the dashboard and the checks without Ray."""
