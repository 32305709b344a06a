"""Environments: the Env API, tools and their parsing, rubrics, the registry and built-ins.

An `Environment` is a family of tasks plus a way to play one episode on a task (`Env`, used
once then dropped). Tools are plain Python functions; tool calls are parsed from the
assistant's text by `flywheel.models.tool_calls` (Hermes convention by default); a `Rubric`
turns an episode into a reward.
"""

from flywheel.envs.base import Env, EnvGroupBuilder, Environment, StepResult
from flywheel.envs.registry import list_envs, load_env
from flywheel.envs.rubric import Rubric
from flywheel.envs.tools import Tool, ToolError, tool

__all__ = ["Env", "EnvGroupBuilder", "Environment", "Rubric", "StepResult",
           "Tool", "ToolError", "list_envs", "load_env", "tool"]
