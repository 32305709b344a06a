"""Inference: the Sampler protocol and the local torch engine.

`LocalEngine` is imported on first use, so code that only speaks the Sampler protocol
(rollouts, scripted episodes) imports no torch."""

from flywheel.inference.sampler import Sample, Sampler, SamplingParams

__all__ = ["LocalEngine", "Sample", "Sampler", "SamplingParams"]


def __getattr__(name: str):
    if name == "LocalEngine":
        from flywheel.inference.engine import LocalEngine

        return LocalEngine
    raise AttributeError(f"module 'flywheel.inference' has no attribute {name!r}")
