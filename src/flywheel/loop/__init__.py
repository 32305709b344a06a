"""The continuous flywheel's logic: curation (traces -> RL / SFT / DPO / replay items), the
gate (the promotion rule), evaluation suites, one resumable cycle, and the loop's config.

Each is imported from its module. Traces live in `flywheel.traces`, model versions in
`flywheel.registry`; serving the production version and the daemon of `flywheel loop run`
are faces, in `flywheel.serve`.
"""
