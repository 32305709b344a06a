"""Inference: the Sampler protocol and the local torch engine."""

from flywheel.inference.engine import LocalEngine
from flywheel.inference.sampler import Sample, Sampler, SamplingParams

__all__ = ["LocalEngine", "Sample", "Sampler", "SamplingParams"]
