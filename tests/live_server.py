"""A flywheel HTTP server for a test, built the one way servers are (serve/builder.py) around a
service the test made, on a free port in a background thread, with the official `openai`
client pointed at it (no retries, so a failure shows at once)."""

from __future__ import annotations

import openai

from flywheel.serve.builder import Server, ServerConfig, build_server


def serve_openai(service, timeout_s: float = 60, **options) -> tuple[Server, openai.OpenAI]:
    """(server, client) for `service` (an OpenAIService), `options` ServerConfig's (trace_store,
    fine_tuning, ...). The caller closes the server (`srv.close()`, in a `finally`) and the service."""
    srv = build_server(ServerConfig(service=service, **options)).start()
    return srv, openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=timeout_s)
