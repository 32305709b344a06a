"""Errors more than one layer raises."""


class TrainError(RuntimeError):
    """A training run cannot start or continue; the message says why."""
