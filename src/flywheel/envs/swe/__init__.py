"""SWE-style agentic tasks without Docker: SWE-bench instances from real repositories, a
pytest harness in the bubblewrap sandbox, and the `swe` environment (bash as the only tool).

instance.py (the JSONL format), sources.py (pinned projects, git repositories, folders),
prepared.py (a cached venv per repository version), workspace.py (bases and linked
workspaces), harness.py (evaluate, validate), synthesize.py (SWE-smith-style instances).
"""
