"""averaging: butterfly all-reduce, load balancing by measured bandwidth, matchmaking over the DHT,
Moshpit All-Reduce and per-tensor compression; the data-parallel core of training."""
