"""How machines are created: the provider contract (``base``), what the clouds share (``cloud``), EC2
(``aws``), GCE (``gcp``), and the boot script every machine runs (``bootstrap``).  The local simulator
lives in ``sim/``; which one a run gets, in ``fleet/registry.py``."""
