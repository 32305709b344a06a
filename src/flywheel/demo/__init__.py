"""The flagship demo (`make demo`, `flywheel demo`): a drifting world served, curated, trained,
gated and promoted by the flywheel. See demo/run.py."""
