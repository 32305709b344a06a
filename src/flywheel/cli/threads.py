"""`--threads` on every command that runs torch, and the one place its default is chosen
(flywheel/threads.py: the CPUs this process may use, less those other processes keep busy)."""

from __future__ import annotations

import typer

THREADS_HELP = ("torch threads (default: the CPUs this process may use, by affinity and cgroup quota, less "
                "those other processes keep busy at start; OMP_NUM_THREADS also sets it)")


def threads_option(default: int | None = None) -> typer.models.OptionInfo:
    return typer.Option(default, "--threads", min=1, help=THREADS_HELP)


def set_threads(threads: int | None) -> int:
    """Set this process's torch threads (`threads`, else the chosen default) and say so on
    stderr (stdout may be a command's answer, as `$(flywheel model demo-base)` is); returns it."""
    from flywheel.threads import use_threads

    return use_threads(threads, log=lambda m: typer.echo(m, err=True))
