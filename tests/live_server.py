"""A flywheel HTTP server for a test: the app on a free port in a background thread, with the
official `openai` client pointed at it (no retries, so a failure shows at once)."""

from __future__ import annotations

import openai

from flywheel.serve.app import create_app
from flywheel.serve.background import BackgroundServer


def serve_openai(service, timeout_s: float = 60, **app_options) -> tuple[BackgroundServer, openai.OpenAI]:
    """(server, client) for `service` (an OpenAIService), `app_options` passed to create_app.
    The caller stops the server (`srv.stop()`, in a `finally`) and closes the service."""
    srv = BackgroundServer(create_app(service, **app_options)).start()
    return srv, openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=timeout_s)
