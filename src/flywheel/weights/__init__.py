"""Weights move by version: a learner publishes (tensors, version); samplers pick up the
newest between batches. Transports: in-process, shared memory between local processes,
broadcast over a torch.distributed group (broadcast.py, imported where used)."""

from flywheel.weights.base import WeightTransport
from flywheel.weights.inprocess import InProcessTransport
from flywheel.weights.shm import NoFreeBuffer, SharedMemoryTransport, TornRead
from flywheel.weights.shm_reader import SharedMemoryReader

__all__ = ["InProcessTransport", "NoFreeBuffer", "SharedMemoryReader", "SharedMemoryTransport", "TornRead",
           "WeightTransport"]
