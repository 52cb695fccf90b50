"""What runs on the head: the supervisor, its policy, the workers' Ray control, the experts' placement,
the run's authority, and which provider a run gets."""
