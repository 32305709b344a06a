"""POST /otlp/v1/traces: OpenTelemetry GenAI spans over OTLP/HTTP as traces (routes.py), the
two OTLP encodings in and out (codec.py), the route's OpenAPI shapes (schemas.py). The
conversion itself is flywheel.traces.otlp, which knows nothing of HTTP."""
