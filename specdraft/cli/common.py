"""What every command of the CLI shares: the --pool and -m options, building a command's
options object from its parameters, and running its body under the exit-code rules."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Annotated, Optional

import typer

from specdraft.commands.io import CommandExit, exit_codes, quiet_libraries, sigterm_interrupts
from specdraft.commands.model_flag import profile_path

Pool = Annotated[Optional[str], typer.Option("--pool", "-p", help="TOML drafter-pool profile (or -m MODEL).",
                                             show_default=False)]
Model = Annotated[Optional[str], typer.Option("--model", "-m", help="A .gguf file, model folder or hub id, run with the built-in pool (lookup + suffix, normalhedge) instead of a --pool profile.", show_default=False)]
# Options generate and chat share.
System = Annotated[Optional[str], typer.Option("--system", "-s", help="System message of the chat (replaces the chat template's default one).", show_default=False)]
PolicyFlag = Annotated[Optional[str], typer.Option(help="Override \\[policy] name, e.g. normalhedge, ucb, fixed:lookup or normalhedge(reset=prompt).")]
DraftTokens = Annotated[Optional[int], typer.Option("--draft-tokens", "-k", help="Tokens drafted per round (K).")]
Temperature = Annotated[Optional[float], typer.Option(help="0 = greedy.")]
TopK = Annotated[Optional[int], typer.Option(help="Top-k filter (0 = off).")]
TopP = Annotated[Optional[float], typer.Option(help="Nucleus filter (1 = off).")]
RepeatPenalty = Annotated[Optional[float], typer.Option(help="Penalise tokens seen in the last --repeat-last-n tokens (llama.cpp's; 1 = off, 1.1 is usual). Output stays exactly what plain decoding with this penalty gives.", show_default=False)]
RepeatLastN = Annotated[Optional[int], typer.Option(help="Tokens --repeat-penalty looks back over, prompt included (-1 = all, default 64).", show_default=False)]
Seed = Annotated[Optional[int], typer.Option(help="Seed for sampling and random policies.")]


def options_of(cls, values: dict):
    """The command's options object from its parameters (`locals()`): every dataclass field
    is a parameter of the same name, so adding an option is one line in each place."""
    return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)})


def with_pool(options, model: str | None, optional: bool = False):
    """`options` with the profile to run: its --pool, or -m MODEL's built-in profile."""
    if optional and not (options.pool or model):
        return options
    return dataclasses.replace(options, pool=profile_path(options.pool, model))


def run_command(console, verbose: bool, body, sigterm: bool = False) -> None:
    """`sigterm`: SIGTERM stops the command as Ctrl-C does (a training run saves its
    checkpoint first) and exits 143."""
    try:
        with exit_codes(console), sigterm_interrupts() if sigterm else contextlib.nullcontext():
            quiet_libraries(verbose, console)
            code = body()
    except CommandExit as done:
        raise typer.Exit(done.code) from None
    raise typer.Exit(code)
