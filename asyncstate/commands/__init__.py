"""The subcommands of the `asyncstate` command, one module each (see `asyncstate.cli`)."""

__all__: list[str] = []
