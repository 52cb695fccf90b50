"""Stand-ins for what the tests cannot run for real: the clouds' APIs and metadata servers, the
machines a cloud boots, an in-memory cloud and worker control for the fleet policy, a hand-set
clock.  Plain classes and context managers, no pytest fixtures: the conftests wrap them."""
