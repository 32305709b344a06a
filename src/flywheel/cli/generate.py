"""`flywheel generate`: sample completions from a local model."""

from __future__ import annotations

from pathlib import Path

import typer

from flywheel.cli.errors import user_errors
from flywheel.cli.options import set_threads, threads_option


def generate(model: Path = typer.Option(..., "--model", help="local model folder"),
             prompt: list[str] = typer.Option(..., "--prompt", "-p", help="prompt text (repeatable)"),
             n: int = typer.Option(1, "-n", min=1, help="samples per prompt"),
             temperature: float = typer.Option(1.0, min=0.0), top_p: float = typer.Option(1.0),
             top_k: int = typer.Option(0, min=0), max_tokens: int = typer.Option(32, min=1),
             stop: list[str] = typer.Option([], "--stop", help="stop string (repeatable)"),
             chat: bool = typer.Option(False, help="wrap each prompt as a user message with the chat template"),
             seed: int = typer.Option(None), threads: int = threads_option(),
             show_logprobs: bool = typer.Option(False, "--logprobs")) -> None:
    """Sample from a local model with the LocalEngine."""
    with user_errors():
        from flywheel.inference import LocalEngine, SamplingParams

        engine = LocalEngine.from_path(str(model), seed=seed)
        set_threads(threads)  # after the load: a missing model is the one line said
        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                                max_tokens=max_tokens, stop=tuple(stop))
        if chat:
            from flywheel.models import ChatRenderer

            renderer = ChatRenderer(engine.tokenizer)
            ids = [renderer.prompt_ids([{"role": "user", "content": p}]) for p in prompt]
        else:
            ids = [engine.encode(p) for p in prompt]
        for p, samples in zip(prompt, engine.generate(ids, params)):
            typer.echo(f"prompt: {p!r}")
            for j, s in enumerate(samples):
                typer.echo(f"  [{j}] {s.text!r}  ({len(s.token_ids)} tokens, {s.finish_reason})")
                if show_logprobs:
                    typer.echo("      logprobs: " + " ".join(f"{x:.2f}" for x in s.logprobs))
