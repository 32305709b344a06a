"""Stopping training loops early: a wall-clock budget, or a graceful stop asked of the whole
process (the loop daemon's SIGTERM). Imports nothing heavy, so faces can use it."""

from __future__ import annotations

import threading
import time

_STOP = threading.Event()  # a graceful stop asked of every training loop in this process


def request_stop() -> None:
    """Ask running training loops to stop after their current step (SIGTERM handlers call this).
    A loop that stops this way still checkpoints and writes its final model."""
    _STOP.set()


def stop_requested() -> bool:
    return _STOP.is_set()


def clear_stop() -> None:
    _STOP.clear()


def interrupted(step: int, total: int) -> bool:
    """A stop request ended the loop before its last step: the run checkpoints and returns
    without evaluating or writing a final model, so a resume continues exactly from here."""
    return _STOP.is_set() and step < total


def interrupted_message(step: int, total: int, checkpoint) -> str:
    return f"interrupted at step {step} of {total}; checkpoint {checkpoint}; resume=true continues from it"


class Deadline:
    """A wall-clock budget counted from construction (this process only: a resumed run gets
    its budget afresh), also passed once a stop is requested. `None` seconds never run out."""

    def __init__(self, seconds: float | None):
        self.end = None if seconds is None else time.monotonic() + seconds

    def passed(self) -> bool:
        return _STOP.is_set() or (self.end is not None and time.monotonic() >= self.end)
