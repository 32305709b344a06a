"""Rollouts: play environments with a sampler, group trajectories, compute advantages."""
