"""A run's settings: the cluster YAML's schema, how files and flags are read, what a cloud accepts in a
node type, and the whole file judged at once.  It imports no other room."""
