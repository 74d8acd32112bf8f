"""The `specdraft` command line: Typer options in, library calls out, exit codes back.

No logic lives here; each command fills an options object and calls its runner in
`specdraft.commands`. Help text is Rich markup (Typer's default mode): a literal bracket
is written `\\[` (tests/test_cli.py checks every help string renders what it says).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from typing import Annotated, Optional

import typer

from specdraft import __version__
from specdraft.config.default_pool import profile_path
from specdraft.commands.io import CommandExit, err_console, exit_codes, quiet_libraries, sigterm_interrupts

app = typer.Typer(
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Lossless speculative decoding with a pool of drafters picked online by a learning policy.",
)

Pool = Annotated[Optional[str], typer.Option("--pool", "-p", help="TOML drafter-pool profile (or -m MODEL).",
                                             show_default=False)]
Model = Annotated[Optional[str], typer.Option("--model", "-m", help="A .gguf file, model folder or hub id, run with the built-in pool (lookup + suffix, normalhedge) instead of a --pool profile.", show_default=False)]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"specdraft {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True,
                                                    help="Print the version and exit.")] = None,
) -> None:
    """specdraft: faster local generation, same tokens."""


@app.command()
def generate(
    prompt: Annotated[Optional[str], typer.Argument(help="Prompt text; read from stdin when omitted.")] = None,
    each_line: Annotated[bool, typer.Option("--each-line", help="Treat every stdin line as its own prompt.")] = False,
    keep_empty: Annotated[bool, typer.Option("--keep-empty", help="With --each-line: answer an empty or unusable line with an empty line (with --json: a record with an error field), so output line N belongs to input line N.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="One JSON object per prompt on stdout.")] = False,
    chat: Annotated[Optional[bool], typer.Option("--chat/--raw", help="Wrap the prompt in the tokenizer's chat template (default: when it has one).", show_default=False)] = None,
    panel: Annotated[Optional[bool], typer.Option("--panel/--no-panel", help="Live panel on stderr (default: when both stdout and stderr are a terminal).", show_default=False)] = None,
    stats: Annotated[bool, typer.Option("--stats", help="Print a one-line summary per prompt on stderr.")] = False,
    policy: Annotated[Optional[str], typer.Option(help="Override \\[policy] name, e.g. normalhedge, ucb, fixed:lookup or normalhedge(reset=prompt).")] = None,
    draft_tokens: Annotated[Optional[int], typer.Option("--draft-tokens", "-k", help="Tokens drafted per round (K).")] = None,
    temperature: Annotated[Optional[float], typer.Option(help="0 = greedy.")] = None,
    top_k: Annotated[Optional[int], typer.Option(help="Top-k filter (0 = off).")] = None,
    top_p: Annotated[Optional[float], typer.Option(help="Nucleus filter (1 = off).")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", "-n", help="Generation budget per prompt.")] = None,
    truncate: Annotated[bool, typer.Option("--truncate", help="Keep the end of a prompt too long for the model's context instead of refusing it.")] = False,
    seed: Annotated[Optional[int], typer.Option(help="Seed for sampling and random policies.")] = None,
    policy_state: Annotated[Optional[str], typer.Option("--policy-state", help="JSON file: start from the learned policy state in it (if present) and save it back.")] = None,
    pool: Pool = None,
    model: Model = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show library logs on stderr.")] = False,
) -> None:
    """Generate text for a prompt, streaming it to stdout as it is committed."""
    from specdraft.commands.generate import GenerateOptions, run_generate

    console = err_console()
    options = _options(GenerateOptions, locals())
    _run(console, verbose, lambda: run_generate(_with_pool(options, model), console))


@app.command()
def bench(
    pool: Annotated[Optional[str], typer.Option("--pool", "-p", help="TOML drafter-pool profile (optional with --replay).")] = None,
    data: Annotated[Optional[str], typer.Option(help="Prompts: .jsonl (prompt, task, id), .csv (prompt column) or text (one per line).")] = None,
    policies: Annotated[Optional[str], typer.Option(help="Comma-separated, e.g. ucb,normalhedge,fixed:lookup,\"normalhedge(reset=prompt)\" (default: the profile's policy and each drafter fixed).")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", "-n")] = None,
    limit: Annotated[Optional[int], typer.Option(help="Use only the first N prompts.")] = None,
    repeat: Annotated[int, typer.Option(help="Measured passes over the prompts (after one warm-up); with --engine vllm, runs of each configuration, interleaved and pooled.")] = 1,
    baseline: Annotated[Optional[str], typer.Option(help="transformers: also time transformers' greedy, assisted and prompt-lookup generation (stock kernels); transformers-packed: the same over specdraft's packed target; llama.cpp: llama-cpp-python's plain and prompt-lookup decoding of the target's GGUF file; several: comma-separated.")] = None,
    out: Annotated[Optional[str], typer.Option(help="Write every measurement and the summary as JSON.")] = None,
    csv_file: Annotated[Optional[str], typer.Option("--csv", help="Write the summary table as CSV.")] = None,
    plot: Annotated[Optional[str], typer.Option(help="Draw speedups and regret curves to a PNG (needs matplotlib).")] = None,
    replay: Annotated[Optional[str], typer.Option(help="Replay policies offline over a trace instead of running models.")] = None,
    chat: Annotated[Optional[bool], typer.Option("--chat/--raw", show_default=False)] = None,
    seed: Annotated[Optional[int], typer.Option()] = None,
    temperature: Annotated[Optional[float], typer.Option(help="Over the profile's: > 0 benches sampling (outputs are then not compared with plain decoding's).", show_default=False)] = None,
    skip: Annotated[int, typer.Option(help="Leave the first N prompts out of the summary; they still run (and warm drafters that learn from earlier answers).")] = 0,
    versus: Annotated[Optional[str], typer.Option(help="Also show every row's speed as a ratio to this configuration, e.g. fixed:lookup.")] = None,
    engine: Annotated[str, typer.Option(help="specdraft: its own engine; vllm: vLLM plain, vLLM's ngram (and suffix) speculation and specdraft's proposer, each in a fresh vLLM engine.")] = "specdraft",
    concurrency: Annotated[Optional[str], typer.Option(help="With --engine vllm: requests in flight, comma-separated, e.g. 1,8,32 (default 1).")] = None,
    model: Model = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Measure speedup over plain decoding on a dataset, live or replayed from a trace."""
    from specdraft.commands.bench import BenchOptions, run_bench_command

    console = err_console()
    options = _options(BenchOptions, locals())
    _run(console, verbose, lambda: run_bench_command(_with_pool(options, model, optional=True), console))


@app.command()
def trace(
    data: Annotated[str, typer.Option(help="Prompts file (jsonl, csv or text).")],
    out: Annotated[str, typer.Option(help="Trace file to write (JSON lines).")],
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", "-n")] = None,
    limit: Annotated[Optional[int], typer.Option()] = None,
    chat: Annotated[Optional[bool], typer.Option("--chat/--raw", show_default=False)] = None,
    pool: Pool = None,
    model: Model = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Decode each prompt once and score every drafter on it, for offline replay."""
    from specdraft.commands.trace import run_trace_command

    console = err_console()
    _run(console, verbose, lambda: run_trace_command(profile_path(pool, model), data, out, max_new_tokens, limit,
                                                     chat, console))


@app.command()
def export(
    out: Annotated[str, typer.Option(help="Folder to write the target to (transformers layout).")],
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16.")] = "bfloat16",
    force: Annotated[bool, typer.Option("--force", help="Replace --out when it exists and is not empty.")] = False,
    pool: Pool = None,
    model: Model = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Write the profile's target as a plain transformers folder (config, safetensors, tokenizer) that vLLM and other engines load as is."""
    from specdraft.commands.export import run_export_command

    console = err_console()
    _run(console, verbose, lambda: run_export_command(profile_path(pool, model), out, dtype, force, console))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve(
    ctx: typer.Context,
    port: Annotated[int, typer.Option(help="Port of the OpenAI-compatible server.")] = 8000,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    dtype: Annotated[str, typer.Option(help="auto (float32 on a CPU, bfloat16 on CUDA), float32, bfloat16 or float16.")] = "auto",
    policy_state: Annotated[Optional[str], typer.Option("--policy-state", help="JSON file: start from the learned policy state in it (if present) and save it back while serving.")] = None,
    log_every: Annotated[float, typer.Option("--log-every", help="Seconds between the proposer's log lines (acceptance, drafters' shares) on stderr; 0 = none.")] = 10.0,
    pool: Pool = None,
    model: Model = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Serve the profile's target with vLLM (OpenAI-compatible API), its pool and policy drafting per request. Arguments after -- go to vLLM."""
    from specdraft.commands.serve import ServeOptions, run_serve_command

    console = err_console()
    opts = ServeOptions(pool, port, host, dtype, policy_state, log_every, tuple(ctx.args))
    _run(console, verbose, lambda: run_serve_command(_with_pool(opts, model), console))


@app.command("calibrate-beta")
def calibrate_beta(
    data: Annotated[Optional[str], typer.Option(help="Calibration prompts (to record a trace).")] = None,
    trace_file: Annotated[Optional[str], typer.Option("--trace", help="Reuse this trace (recorded and saved here if missing).")] = None,
    grid: Annotated[Optional[str], typer.Option(help="Comma-separated values to try.")] = None,
    reward: Annotated[Optional[str], typer.Option(help="bd or be (UCB-family reward).")] = None,
    param: Annotated[str, typer.Option(help="Parameter to tune: beta, or e.g. gamma (exp3), discount (ducb), window (swucb), c (halving), eta (hedge).")] = "beta",
    policy: Annotated[Optional[str], typer.Option(help="Policy to tune (default: the profile's, else ucb).")] = None,
    write: Annotated[bool, typer.Option("--write", help="Write the best value into the profile's \\[policy] table.")] = False,
    limit: Annotated[Optional[int], typer.Option()] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", "-n")] = None,
    chat: Annotated[Optional[bool], typer.Option("--chat/--raw", show_default=False)] = None,
    pool: Pool = None,
    model: Model = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Find the best UCB exploration strength (or another parameter) by offline replay."""
    from specdraft.commands.calibrate import CalibrateOptions, run_calibrate

    console = err_console()
    options = _options(CalibrateOptions, locals())
    _run(console, verbose, lambda: run_calibrate(_with_pool(options, model), console))


profile_app = typer.Typer(no_args_is_help=True, help="Profiles: a target, its pool of drafters and the policy.")
app.add_typer(profile_app, name="profile")


@profile_app.command("init")
def profile_init(
    model: Annotated[str, typer.Argument(help="A .gguf file, model folder or hub id (org/name).", show_default=False)],
) -> None:
    """Print a commented profile for MODEL with the built-in pool, to edit and run with --pool (`specdraft profile init m.gguf > my.toml`)."""
    from specdraft.config.default_pool import default_profile_text

    console = err_console()
    _run(console, False, lambda: _print(default_profile_text(model)))


def _print(text: str) -> int:
    sys.stdout.write(text)
    sys.stdout.flush()
    return 0


datastore_app = typer.Typer(no_args_is_help=True, help="Datastores the suffix drafter drafts from.")
app.add_typer(datastore_app, name="datastore")


@datastore_app.command("build")
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
    options = _options(DatastoreOptions, locals())
    _run(console, verbose, lambda: run_datastore_build(_with_pool(options, model), console))


train_app = typer.Typer(no_args_is_help=True, help="Train drafters from the frozen target.")
app.add_typer(train_app, name="train")


@train_app.command("head")
def train_head(
    data: Annotated[list[str], typer.Option("--data", help="Training text: JSONL (a prompt and an answer become a chat exchange; `generate --json` output works), text or source files, or folders of them; more may follow as arguments.", show_default=False)],
    out: Annotated[str, typer.Option(help="Folder for the head (a `head` drafter's path).", show_default=False)],
    epochs: Annotated[Optional[float], typer.Option(help="Passes over the data (default 4).", show_default=False)] = None,
    steps: Annotated[Optional[int], typer.Option(help="Optimizer steps (overrides --epochs).", show_default=False)] = None,
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
    options = _options(TrainHeadOptions, locals())
    _run(console, verbose, lambda: run_train_head(_with_pool(options, model), console), sigterm=True)


@train_app.command("steer")
def train_steer(
    drafter: Annotated[str, typer.Option(help="The pool's pretrained drafter to steer (a `model` or `steered` drafter's name).", show_default=False)],
    data: Annotated[list[str], typer.Option("--data", help="Training text, as for `train head`; more may follow as arguments.", show_default=False)],
    out: Annotated[str, typer.Option(help="Folder for the steering (a `steered` drafter's steering).", show_default=False)],
    epochs: Annotated[Optional[float], typer.Option(help="Passes over the data (default 1).", show_default=False)] = None,
    steps: Annotated[Optional[int], typer.Option(help="Optimizer steps (overrides --epochs).", show_default=False)] = None,
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
    options = _options(TrainSteerOptions, locals())
    _run(console, verbose, lambda: run_train_steer(_with_pool(options, model), console), sigterm=True)


def _options(cls, values: dict):
    """The command's options object from its parameters (`locals()`): every dataclass field
    is a parameter of the same name, so adding an option is one line in each place."""
    return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)})


def _with_pool(options, model: str | None, optional: bool = False):
    """`options` with the profile to run: its --pool, or -m MODEL's built-in profile."""
    if optional and not (options.pool or model):
        return options
    return dataclasses.replace(options, pool=profile_path(options.pool, model))


def _run(console, verbose: bool, body, sigterm: bool = False) -> None:
    """`sigterm`: SIGTERM stops the command as Ctrl-C does (a training run saves its
    checkpoint first) and exits 143."""
    try:
        with exit_codes(console), sigterm_interrupts() if sigterm else contextlib.nullcontext():
            quiet_libraries(verbose, console)
            code = body()
    except CommandExit as done:
        raise typer.Exit(done.code) from None
    raise typer.Exit(code)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:  # Ctrl-C outside a command body (e.g. during imports)
        sys.exit(130)
