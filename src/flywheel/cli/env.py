"""`flywheel env list|show|try`: inspect environments and play a few episodes."""

from __future__ import annotations

import json

import typer

from flywheel.cli.errors import user_errors

app = typer.Typer(help="Inspect environments and play episodes.", no_args_is_help=True)


def _settings(pairs: list[str]) -> dict:
    import yaml

    out = {}
    for item in pairs:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected key=value")
        out[key] = yaml.safe_load(value)
    return out


@app.command("list")
def list_() -> None:
    """List the built-in environments."""
    from flywheel.envs import list_envs

    for name, path in list_envs().items():
        typer.echo(f"{name:15s} {path}")


@app.command("show")
def show(name: str, set_: list[str] = typer.Option([], "--set", help="env setting key=value (repeatable)")) -> None:
    """Describe an environment: settings, tools, reward, and one task."""
    with user_errors():
        from flywheel.envs import load_env

        env = load_env(name, **_settings(set_))
        typer.echo(json.dumps(env.info(), indent=2, default=str))
        task = env.tasks("test", n=1)[0]
        typer.echo("example task:")
        typer.echo(json.dumps({"id": task.id, "prompt": task.prompt, "answer": task.answer}, indent=2, default=str))


@app.command("try")
def try_(name: str,
         policy: str = typer.Option("scripted", help="'scripted' or a local model folder"),
         k: int = typer.Option(3, "-k", min=1, help="episodes to play"),
         split: str = typer.Option("test"), seed: int = typer.Option(0),
         temperature: float = typer.Option(0.0, min=0.0), max_tokens: int = typer.Option(256, min=1),
         set_: list[str] = typer.Option([], "--set", help="env setting key=value (repeatable)")) -> None:
    """Play k episodes and print each transcript with its reward."""
    with user_errors():
        import asyncio

        from rich.console import Console

        from flywheel.envs import load_env
        from flywheel.envs.runner import play_many

        env = load_env(name, **_settings(set_))
        if policy == "scripted":
            actor = env.scripted_policy()
        else:
            from flywheel.envs.model_policy import ModelPolicy
            from flywheel.inference import LocalEngine, SamplingParams

            actor = ModelPolicy(LocalEngine.from_path(policy, seed=seed),
                                SamplingParams(temperature=temperature, max_tokens=max_tokens))
        results = asyncio.run(play_many(env, env.tasks(split, n=k, seed=seed), actor, concurrency=k))
        console = Console()
        for i, r in enumerate(results):
            console.rule(f"episode {i + 1}: task {r.task.id}  reward {r.reward:g}" + (f"  error: {r.error}" if r.error else ""))
            if isinstance(r.transcript, str):
                console.print(r.transcript, markup=False)
            else:
                for m in r.transcript:
                    console.print(f"[bold]{m['role']}[/]: ", end="")
                    console.print(str(m.get("content", "")), markup=False)
            shown = {k_: v for k_, v in r.metrics.items() if v}
            console.print(f"metrics: {shown}", markup=False)
        mean = sum(r.reward for r in results) / len(results)
        console.print(f"mean reward {mean:.3f} over {len(results)} episodes")
