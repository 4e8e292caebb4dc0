"""`relay submit JOB.yaml`: submit a job spec; prints the job id."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from torchrelay.client.cli.common import OutputOpt, Output, client, console, dump, fail, handle_errors, print_json


@handle_errors
def submit(spec_file: Path = typer.Argument(..., help="job spec (YAML)"),
           set_: list[str] = typer.Option([], "--set", help="override a field: key=value, key.sub=value"),
           follow_: bool = typer.Option(False, "--follow", "-f", help="stream logs and progress until it ends"),
           dry_run: bool = typer.Option(False, "--dry-run", help="print the resolved spec (and what its executor "
                                        "would submit, e.g. a Slurm batch script); submit nothing"),
           profile: bool = typer.Option(False, "--profile", help="run the entrypoint here for two steps first and "
                                        "set resources.memory per worker from its memory figures"),
           output: Output = OutputOpt) -> None:
    """Submit a job; its workdir (relative to the spec file) is packed and uploaded."""
    from torchrelay.spec import JobSpec

    if not spec_file.is_file():
        fail(f"spec file {str(spec_file)!r} does not exist")
    spec = JobSpec.from_yaml_text(spec_file.read_text(), set_)
    if profile:
        spec = _profiled(spec, spec_file.resolve().parent)
    if dry_run:
        _dry_run(spec, output)
        return
    with client() as c:
        info = c.submit(spec, base_dir=spec_file.resolve().parent)
        if output == Output.json and not follow_:
            print_json(dump(info))
        else:
            print(info.id, flush=True)
        if follow_:
            from torchrelay.client.cli.follow import follow, print_outcome

            final = follow(c, info.id)
            print_outcome(final)
            if final.state.value != "SUCCEEDED":
                raise typer.Exit(1)


def _dry_run(spec: Any, output: Output) -> None:
    """The resolved spec; for a job of another executor than the agents, also what the server
    would submit for it (e.g. Slurm's batch script), asked of the server."""
    from torchrelay.spec import DEFAULT_EXECUTOR

    plan = None
    if spec.executor != DEFAULT_EXECUTOR:
        with client() as c:
            plan = c.dryrun(spec)
    if output == Output.json:  # the resolved spec; with another executor, {"executor", "spec", "submission"}
        print_json(plan or spec.to_public())
        return
    import yaml
    console.print(yaml.safe_dump(spec.to_public(), sort_keys=False), markup=False, highlight=False)
    if plan and plan.get("submission"):
        print(f"# what the {plan['executor']!r} executor would submit:")
        print(plan["submission"], end="", flush=True)  # as is: a console would wrap its long lines


def _profiled(spec, base_dir: Path):  # noqa: ANN001, ANN202 - JobSpec, imported lazily
    """``spec`` with ``resources.memory`` from a profile run (kept when the user gave more). Prints the figures."""
    from torchrelay.client.profile import describe_profile, profile_memory, recommended_memory
    from torchrelay.spec import format_memory

    figures = profile_memory(spec, base_dir)
    for line in describe_profile(figures):
        typer.echo(line, err=True)
    wanted = recommended_memory(figures)
    if spec.resources.memory >= wanted:
        return spec
    if spec.resources.memory:
        typer.echo(f"profile: resources.memory {format_memory(spec.resources.memory)} is below that: raised",
                   err=True)
    resources = spec.resources.model_copy(update={"memory": wanted})
    return spec.model_copy(update={"resources": resources})
