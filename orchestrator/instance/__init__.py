"""What runs on one machine: the worker core and its Ray actor, the machine's own notice watcher, the
warm image the simulator forks workers from, and the ``worker``, ``expert-server`` and ``dht`` commands."""
