"""The `flywheel serve` process: the OpenAI-compatible server (core in `core.py`, FastAPI face in
`app.py` with its routers), trace capture (`traces.py`, ingestion workers), the registry hook
(`production.py`), the fine-tuning and managed-flywheel routes over finetuning/'s core, and
the one way to assemble a server (`builder.py` build_server: for `flywheel serve`, the daemon,
the demo and the tests).

FastAPI and uvicorn come with the `serve` extra; `flywheel.serve.core` needs neither.
"""

from flywheel.serve.core import OpenAIService
from flywheel.serve.production import ProductionFollower, ProductionLookup, registry_lookup
from flywheel.serve.traces import TraceEvent, TraceSink, TraceStoreSink, open_trace_sink

__all__ = ["OpenAIService", "ProductionFollower", "ProductionLookup", "TraceEvent", "TraceSink",
           "TraceStoreSink", "open_trace_sink", "registry_lookup"]
