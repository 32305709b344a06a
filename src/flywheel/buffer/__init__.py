"""Trajectory buffers between rollout workers and the learner."""

from flywheel.buffer.versioned import VersionedBuffer

__all__ = ["VersionedBuffer"]
