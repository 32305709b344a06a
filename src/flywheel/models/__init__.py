"""Models: load any local Hugging Face causal LM, build tiny ones, render chats as token ids."""

from flywheel.models.chat import ChatRenderer, ChatTemplateError, Conversation, ToolsNotRendered
from flywheel.models.loading import ModelLoadError, load, load_tokenizer
from flywheel.models.tiny import TinySpec, build_tiny_model

__all__ = ["ChatRenderer", "ChatTemplateError", "Conversation", "ModelLoadError", "TinySpec", "ToolsNotRendered",
           "build_tiny_model", "load", "load_tokenizer"]
