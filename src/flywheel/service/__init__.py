"""Service: the OpenAI-compatible server (core in `core.py`, FastAPI face in `app.py`),
trace capture (`traces.py`) and the registry hook (`production.py`).

FastAPI and uvicorn come with the `serve` extra; `flywheel.service.core` needs neither.
"""

from flywheel.service.core import OpenAIService
from flywheel.service.errors import OpenAIError
from flywheel.service.production import ProductionFollower, ProductionLookup, registry_lookup
from flywheel.service.traces import TraceEvent, TraceSink, TraceStoreSink, open_trace_sink

__all__ = ["OpenAIError", "OpenAIService", "ProductionFollower", "ProductionLookup", "TraceEvent", "TraceSink",
           "TraceStoreSink", "open_trace_sink", "registry_lookup"]
