"""Errors more than one layer raises."""

from __future__ import annotations

from typing import Any


class TrainError(RuntimeError):
    """A training run cannot start or continue; the message says why."""


# ---------------------------------------------------------------- the API's refusals
# in the OpenAI shape: {"error": {"message", "type", "param", "code"}}

class OpenAIError(Exception):
    """A refused request. `param` names the offending field (`messages[1].role`, `n`, ...)."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str, code: str | None = None) -> OpenAIError:
    """A 400 whose message starts with the field it is about."""
    return OpenAIError(f"{param}: {message}" if param else message, param=param, code=code)
