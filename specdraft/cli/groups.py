"""The command groups: `profile init`, `calibrate costs`, `datastore build`, `train head` and
`train steer`."""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Annotated, Optional

import typer

from specdraft.cli.examples import epilog
from specdraft.cli.common import Model, Pool, options_of, run_command, with_pool
from specdraft.commands.io import err_console
from specdraft.commands.model_flag import head_out, profile_path

profile_app = typer.Typer(no_args_is_help=True, help="Profiles: a target, its pool of drafters and the policy.")


@profile_app.command("init", epilog=epilog("profile init"))
def profile_init(
    model: Annotated[str, typer.Argument(help="A .gguf file, model folder or hub id (org/name).", show_default=False)],
) -> None:
    """Print a commented profile for MODEL with the built-in pool, to edit and run with --pool (`specdraft profile init m.gguf > my.toml`)."""
    from specdraft.commands.model_flag import default_profile_text

    console = err_console()
    run_command(console, False, lambda: _print(default_profile_text(model)))


def _print(text: str) -> int:
    sys.stdout.write(text)
    sys.stdout.flush()
    return 0


calibrate_app = typer.Typer(no_args_is_help=True, help="Measure what the planner plans with.")


@calibrate_app.command("costs", epilog=epilog("calibrate costs"))
def calibrate_costs(
    pool: Pool = None,
    model: Model = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Time the target's verify at every width again and keep the curve (run it on a quiet machine); the table goes to stdout."""
    from specdraft.commands.calibrate_costs import run_calibrate_costs

    console = err_console()
    run_command(console, verbose, lambda: run_calibrate_costs(profile_path(pool, model), console))


datastore_app = typer.Typer(no_args_is_help=True, help="Datastores the suffix drafter drafts from.")


@datastore_app.command("build", epilog=epilog("datastore build"))
def datastore_build(
    files: Annotated[list[str], typer.Argument(help="Text, JSONL or source files, or folders of them.", show_default=False)],
    out: Annotated[str, typer.Option(help="Folder to write the datastore to.", show_default=False)],
    depth: Annotated[int, typer.Option(help="Longest context suffix the store can match, in tokens.")] = 32,
    pool: Pool = None,
    model: Model = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Tokenize files with the pool's target tokenizer into a store that suffix drafters read (their store key)."""
    from specdraft.commands.datastore import DatastoreOptions, run_datastore_build

    console = err_console()
    options = options_of(DatastoreOptions, locals())
    run_command(console, verbose, lambda: run_datastore_build(with_pool(options, model), console))


train_app = typer.Typer(no_args_is_help=True, help="Train drafters from the frozen target.")


@train_app.command("head", epilog=epilog("train head"))
def train_head(
    data: Annotated[list[str], typer.Option("--data", help="Training text: JSONL (a prompt and an answer become a chat exchange; `generate --json` output works), text or source files, or folders of them; more may follow as arguments.", show_default=False)],
    out: Annotated[Optional[str], typer.Option(help="Folder for the head (a `head` drafter's path; with -m MODEL, by default the model's heads folder, so that -m runs it).", show_default=False)] = None,
    epochs: Annotated[Optional[float], typer.Option(help="Passes over the data (default 4).", show_default=False)] = None,
    steps: Annotated[Optional[int], typer.Option(help="Optimizer steps (overrides --epochs).", show_default=False)] = None,
    minutes: Annotated[Optional[float], typer.Option(help="Train for about this many minutes: the steps that fit, timed on the first steps (at most --epochs or --steps).", show_default=False)] = None,
    lr: Annotated[float, typer.Option(help="Peak learning rate.")] = 1e-3,
    draft_vocab: Annotated[int, typer.Option("--draft-vocab", help="Rows of the head's readout: the most frequent target tokens of the data.")] = 8192,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per training sequence.")] = 512,
    batch_sequences: Annotated[int, typer.Option("--batch", help="Sequences per optimizer step.")] = 8,
    unroll: Annotated[int, typer.Option(help="n > 1: also train draft steps 2..n (at most 4) on the head's own predictions (n forwards per step).")] = 1,
    fuse_layers: Annotated[Optional[str], typer.Option("--fuse-layers", help="Also read the target's hidden states after these layers, comma-separated (e.g. 2,15: EAGLE-3's fused features); default: the final feature only.", show_default=False)] = None,
    bf16: Annotated[Optional[bool], typer.Option("--bf16/--fp32", help="bf16 autocast of the head's forward and readout (default: where bf16 matmuls are native: CUDA GPUs with bf16, CPUs with AVX512-BF16 or AMX).", show_default=False)] = None,
    max_tokens: Annotated[Optional[int], typer.Option("--max-tokens", help="Use at most this many tokens of the data.", show_default=False)] = None,
    chat: Annotated[Optional[bool], typer.Option("--chat/--raw", help="Format prompt/answer pairs in the chat template (default: when the tokenizer has one).", show_default=False)] = None,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda\\[:N].")] = "auto",
    features: Annotated[Optional[str], typer.Option(help="Folder for the target's cached features (default: under the cache folder).", show_default=False)] = None,
    restart: Annotated[bool, typer.Option("--restart", help="Ignore a saved training state in --out and start over.")] = False,
    seed: Annotated[int, typer.Option(help="Seed for initialisation, batching and noise.")] = 0,
    more: Annotated[Optional[list[str]], typer.Argument(help="More training files or folders (as for --data).", show_default=False)] = None,
    pool: Pool = None,
    model: Model = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Train an EAGLE-style draft head for the pool's target (for a `head` drafter)."""
    from specdraft.commands.train_head import TrainHeadOptions, run_train_head

    console = err_console()
    data = [*data, *(more or [])]  # `--data a b c` reads as --data a plus arguments b c
    options = options_of(TrainHeadOptions, locals())

    def run() -> int:
        return run_train_head(replace(with_pool(options, model), out=head_out(out, model)), console)

    run_command(console, verbose, run, sigterm=True)


@train_app.command("steer", epilog=epilog("train steer"))
def train_steer(
    drafter: Annotated[str, typer.Option(help="The pool's pretrained drafter to steer (a `model` or `steered` drafter's name).", show_default=False)],
    data: Annotated[list[str], typer.Option("--data", help="Training text, as for `train head`; more may follow as arguments.", show_default=False)],
    out: Annotated[str, typer.Option(help="Folder for the steering (a `steered` drafter's steering).", show_default=False)],
    epochs: Annotated[Optional[float], typer.Option(help="Passes over the data (default 1).", show_default=False)] = None,
    steps: Annotated[Optional[int], typer.Option(help="Optimizer steps (overrides --epochs).", show_default=False)] = None,
    minutes: Annotated[Optional[float], typer.Option(help="Train for about this many minutes: the steps that fit, timed on the first steps (at most --epochs or --steps).", show_default=False)] = None,
    lr: Annotated[float, typer.Option(help="Peak learning rate of the drafter.")] = 5e-5,
    steer_lr_factor: Annotated[float, typer.Option("--steer-lr-factor", help="The steering's learning rate as a multiple of --lr.")] = 10.0,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per training sequence.")] = 256,
    batch_sequences: Annotated[int, typer.Option("--batch", help="Sequences per optimizer step.")] = 2,
    max_draft: Annotated[Optional[int], typer.Option("--max-draft", help="K: the drafter learns to draft up to K tokens from a block's start (default: the profile's draft_tokens).", show_default=False)] = None,
    layers: Annotated[Optional[str], typer.Option(help="The target's low,mid,high hidden-state indices (default 2, L/2, L-2).", show_default=False)] = None,
    steer_size: Annotated[Optional[int], typer.Option("--steer-size", help="Width of the steering vector (default: 256, or the drafter's hidden size if smaller).", show_default=False)] = None,
    freeze_drafter: Annotated[bool, typer.Option("--freeze-drafter", help="Train only the steering; the drafter keeps its pretrained weights.")] = False,
    train_layers: Annotated[Optional[int], typer.Option("--train-layers", help="Train only the drafter's last N decoder layers (with the steering); the rest keep their pretrained weights.", show_default=False)] = None,
    steering: Annotated[bool, typer.Option("--steering/--no-steering", help="--no-steering: the distilled baseline (same data and steps, plain KL).")] = True,
    bf16: Annotated[Optional[bool], typer.Option("--bf16/--fp32", help="bf16 autocast of the drafter's forward (default: on CUDA and on CPUs with native bf16).", show_default=False)] = None,
    max_tokens: Annotated[Optional[int], typer.Option("--max-tokens", help="Use at most this many tokens of the data.", show_default=False)] = None,
    chat: Annotated[Optional[bool], typer.Option("--chat/--raw", help="Format prompt/answer pairs in the chat template (default: when the tokenizer has one).", show_default=False)] = None,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda\\[:N].")] = "auto",
    features: Annotated[Optional[str], typer.Option(help="Folder for the target's cached features (default: under the cache folder).", show_default=False)] = None,
    restart: Annotated[bool, typer.Option("--restart", help="Ignore a saved training state in --out and start over.")] = False,
    seed: Annotated[int, typer.Option(help="Seed for initialisation, batching and offsets.")] = 0,
    more: Annotated[Optional[list[str]], typer.Argument(help="More training files or folders (as for --data).", show_default=False)] = None,
    pool: Pool = None,
    model: Model = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Train SD2 steering for a pretrained drafter (for a `steered` drafter), or the distilled baseline."""
    from specdraft.commands.train_steer import TrainSteerOptions, run_train_steer

    console = err_console()
    data = [*data, *(more or [])]
    options = options_of(TrainSteerOptions, locals())
    run_command(console, verbose, lambda: run_train_steer(with_pool(options, model), console), sigterm=True)
