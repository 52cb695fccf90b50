"""This machine's processes and ports: a process session or tree listed and ended (``processes``), a
condition waited for with a deadline (``wait``), a port a server may bind (``ports``), and a Ray head
started as a head machine starts one (``ray_head``).  The lowest room: it imports no other."""
