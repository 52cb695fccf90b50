"""The ``spotswarm`` command (``main``) and what its run subcommands do (``cluster``, ``token``)."""
