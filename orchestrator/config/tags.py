"""The tags (GCE: labels) every machine of a run carries: the source of truth for which machines a run
has, so a new supervisor finds the fleet of the one before it and adopts it."""

RUN_TAG = "spotswarm-run"
INSTANCE_TAG = "spotswarm-instance"
NODE_TYPE_TAG = "spotswarm-node-type"
