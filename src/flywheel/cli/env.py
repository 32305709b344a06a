"""`flywheel env list|show|try|demos|synth-bugs`: inspect environments, play a few episodes, write
scripted demonstrations as SFT data, make code_repair tasks."""

from __future__ import annotations

import json

import typer

from flywheel.cli.errors import user_errors
from flywheel.cli.options import set_threads, threads_option

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
    """Describe an environment: settings, tools, reward, and the verifier task shape (what
    feedback sends to have a failed trace replayed here), with one real task as example."""
    with user_errors():
        from flywheel.envs import load_env
        from flywheel.envs.verifier_task import verifier_task_example, verifier_task_fields
        from flywheel.loop.curation_rules import CurationConfig
        from flywheel.loop.feedback_check import trusted_env

        settings = _settings(set_)
        env = load_env(name, **settings)
        typer.echo(json.dumps(env.info(), indent=2, default=str))
        typer.echo(f'verifier task: feedback `"verifier": {{"env": {json.dumps(name)}, "task": {{...}}}}` has a '
                   "failed trace replayed and graded here; the task's fields:")
        for f in verifier_task_fields(env):
            typer.echo(f"  {f.name:10s}{'required' if f.required else 'optional'}  {f.text}")
        if settings:
            typer.echo("note: a verifier names no settings: it is replayed with this environment's defaults")
        if not trusted_env(name, CurationConfig()):
            typer.echo(f"note: not a built-in: a loop replays it only if its config lists {name!r} in "
                       "curation.environments")
        typer.echo("example verifier:")
        typer.echo(json.dumps({"env": name, "task": verifier_task_example(env)}, indent=2, default=str))


@app.command("try")
def try_(name: str,
         policy: str = typer.Option("scripted", help="'scripted' or a local model folder"),
         k: int = typer.Option(3, "-k", min=1, help="episodes to play"),
         split: str = typer.Option("test"), seed: int = typer.Option(0),
         temperature: float = typer.Option(0.0, min=0.0), max_tokens: int = typer.Option(256, min=1),
         set_: list[str] = typer.Option([], "--set", help="env setting key=value (repeatable)"),
         threads: int = threads_option()) -> None:
    """Play k episodes and print each transcript with its reward."""
    with user_errors():
        import asyncio

        from rich.console import Console

        from flywheel.envs import load_env
        from flywheel.rollout.play import play

        env = load_env(name, **_settings(set_))
        if policy == "scripted":
            actor = env.scripted_policy()
        else:
            from flywheel.envs.model_policy import ModelPolicy
            from flywheel.inference import LocalEngine, SamplingParams

            actor = ModelPolicy(LocalEngine.from_path(policy, seed=seed),
                                SamplingParams(temperature=temperature, max_tokens=max_tokens))
            set_threads(threads)
        results = asyncio.run(play(env, env.tasks(split, n=k, seed=seed), actor, concurrency=k))
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


@app.command("demos")
def demos(name: str,
          out: str = typer.Option(..., "--out", help="JSONL file to write (OpenAI chat SFT rows)"),
          n: int = typer.Option(1000, "-n", help="tasks to play (one episode each)"),
          split: str = typer.Option("train"), seed: int = typer.Option(0, help="seeds the task choice"),
          min_reward: float = typer.Option(1.0, help="keep episodes scoring at least this"),
          bare: bool = typer.Option(False, "--bare", help="drop the system message and the tool schemas: "
                                                           "much shorter rows for a cheap first SFT stage"),
          set_: list[str] = typer.Option([], "--set", help="env setting key=value (repeatable)")) -> None:
    """Play the env's scripted policy on N tasks; write each solved episode as an SFT row
    (messages with tool_calls and tool results, plus the tools), for `flywheel sft`."""
    with user_errors():
        from flywheel.envs import load_env
        from flywheel.rollout.demos import make_demos

        if n < 1:
            raise ValueError(f"-n must be at least 1, got {n}")
        env = load_env(name, **_settings(set_))
        rows, report = make_demos(env, n, split=split, seed=seed, min_reward=min_reward, out=out, bare=bare)
        typer.echo(f"{report.summary()} -> {out} ({len(rows)} rows, {report.seconds:.1f} s)")
        if not rows:
            raise ValueError(f"no episode was kept, so {out} is empty")


@app.command("synth-bugs")
def synth_bugs(repo: str = typer.Argument(..., help="a folder or git repository with pytest-style tests, or a "
                                                    "bundled corpus name (minilib)"),
               out: str = typer.Option(..., "--out", help="JSONL file to write (code_repair instances)"),
               max_: int = typer.Option(100, "--max", min=1, help="instances to keep at most"),
               seed: int = typer.Option(0, help="seeds the order in which mutation sites are tried"),
               rev: str = typer.Option(None, help="commit of a git repository (default HEAD)"),
               unsafe: bool = typer.Option(False, "--unsafe",
                                           help="run tests without bubblewrap (weaker isolation)")) -> None:
    """Make code_repair tasks by mutating REPO's functions and keeping mutants its tests catch.

    REPO works when its tests are test_*.py files of plain test functions (no fixtures) run from its root.
    """
    with user_errors():
        from flywheel.envs.repo import write_instances
        from flywheel.envs.synth_bugs import synthesize
        from flywheel.sandbox import SandboxError

        try:
            instances, report = synthesize(repo, max_n=max_, seed=seed, rev=rev, unsafe=True if unsafe else None)
        except SandboxError as e:
            raise ValueError(f"sandbox: {e}") from None
        if not instances:
            raise ValueError(f"{repo}: none of the {report.tried} mutants tried broke a test")
        write_instances(out, instances)
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(report.kinds.items()))
        typer.echo(f"{len(instances)} instances -> {out} ({report.tried} of {report.sites} mutation sites tried, "
                   f"{report.no_failure} broke no test, {report.timed_out} timed out; {report.tests} tests; "
                   f"{kinds}; {report.seconds:.1f} s)")
