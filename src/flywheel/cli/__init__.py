"""The `flywheel` command line: one module per sub-command, heavy imports inside commands."""
