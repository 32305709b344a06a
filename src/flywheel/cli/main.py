"""Entry point of the `flywheel` command."""

from __future__ import annotations

import typer

from flywheel.cli import data, demo, economics, env, generate, loop, model, registry, traces, train
from flywheel.cli import flywheels, jobs, keys, serve, swe, worker
from flywheel.cli.help import reflow_help

app = typer.Typer(help="flywheel: continuous post-training of agentic language models.",
                  no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)
app.add_typer(model.app, name="model")
app.add_typer(data.app, name="data")
app.add_typer(env.app, name="env")
app.add_typer(swe.app, name="swe")
app.add_typer(economics.app, name="economics")
app.add_typer(traces.app, name="traces")
app.add_typer(registry.app, name="registry")
app.add_typer(registry.app, name="models", hidden=True)  # the old name, kept as an alias
app.add_typer(loop.app, name="loop")
app.add_typer(jobs.files_app, name="files")
app.add_typer(jobs.jobs_app, name="jobs")
app.add_typer(flywheels.app, name="flywheels")
app.add_typer(keys.app, name="keys")
app.command("generate")(generate.generate)
app.command("demo")(demo.demo)
app.command("serve")(serve.serve)
app.command("worker")(worker.worker)
app.command("sft", context_settings=train.OVERRIDES)(train.sft)
app.command("dpo", context_settings=train.OVERRIDES)(train.dpo)
app.command("rl", context_settings=train.OVERRIDES)(train.rl)
reflow_help(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
