"""The `specdraft` command line: Typer options in, library calls out, exit codes back.

No logic lives here; each command fills an options object and calls its runner in
`specdraft.commands`. The command groups (profile, datastore, train) are in groups.py, what
every command shares (--pool, -m, the exit-code rules) in common.py. Help text is Rich markup (Typer's default mode): a literal bracket
is written `\\[` (tests/test_cli.py checks every help string renders what it says).
"""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from specdraft import __version__
from specdraft.cli.common import (DraftTokens, Model, PolicyFlag, Pool, RepeatLastN, RepeatPenalty, Seed, System,
                                  Temperature, TopK, TopP, options_of, run_command, with_pool)
from specdraft.commands.model_flag import profile_path
from specdraft.cli.examples import epilog
from specdraft.cli.groups import calibrate_app, datastore_app, profile_app, train_app
from specdraft.commands.io import err_console

app = typer.Typer(
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Lossless speculative decoding with a pool of drafters picked online by a learning policy.",
)

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


@app.command(epilog=epilog("generate"))
def generate(
    prompt: Annotated[Optional[str], typer.Argument(help="Prompt text; read from stdin when omitted. Piped stdin and a PROMPT together make one prompt: the piped text, a blank line, then PROMPT.")] = None,
    each_line: Annotated[bool, typer.Option("--each-line", help="Treat every stdin line as its own prompt.")] = False,
    keep_empty: Annotated[bool, typer.Option("--keep-empty", help="With --each-line: answer an empty or unusable line with an empty answer (with --json: a record with an error field), so answer N belongs to input line N.")] = False,
    separator: Annotated[Optional[str], typer.Option("--separator", help="With --each-line, plain text: written after every answer's last line (default: a blank line; '' for none; escapes such as '\\0' or '\\n---\\n' are read).", show_default=False)] = None,
    json_output: Annotated[bool, typer.Option("--json", help="One JSON object per prompt on stdout.")] = False,
    chat: Annotated[Optional[bool], typer.Option("--chat/--raw", help="Wrap the prompt in the tokenizer's chat template (default: when it has one).", show_default=False)] = None,
    panel: Annotated[Optional[bool], typer.Option("--panel/--no-panel", help="Live panel on stderr (default: when both stdout and stderr are a terminal).", show_default=False)] = None,
    stats: Annotated[bool, typer.Option("--stats", help="Print a one-line summary per prompt on stderr.")] = False,
    policy: PolicyFlag = None,
    draft_tokens: DraftTokens = None,
    temperature: Temperature = None,
    top_k: TopK = None,
    top_p: TopP = None,
    repeat_penalty: RepeatPenalty = None,
    repeat_last_n: RepeatLastN = None,
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", "-n", help="Generation budget per prompt.")] = None,
    truncate: Annotated[bool, typer.Option("--truncate", help="Keep the end of a prompt too long for the model's context instead of refusing it.")] = False,
    seed: Seed = None,
    policy_state: Annotated[Optional[str], typer.Option("--policy-state", help="JSON file: start from the learned policy state in it (if present) and save it back.")] = None,
    system: System = None,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="End the answer at this string (repeatable; added to the profile's).", show_default=False)] = None,
    pool: Pool = None,
    model: Model = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show library logs on stderr.")] = False,
) -> None:
    """Generate text for a prompt, streaming it to stdout as it is committed."""
    from specdraft.commands.generate import GenerateOptions, run_generate

    console = err_console()
    options = options_of(GenerateOptions, locals())
    run_command(console, verbose, lambda: run_generate(with_pool(options, model), console))


@app.command(epilog=epilog("chat"))
def chat(
    system: System = None,
    json_output: Annotated[bool, typer.Option("--json", help="One JSON object per turn on stdout (with prefill_tokens: only a turn's new tokens are prefilled).")] = False,
    stats: Annotated[bool, typer.Option("--stats", help="A one-line summary per answer on stderr.")] = False,
    panel: Annotated[bool, typer.Option("--panel/--no-panel", help="A one-line live status on stderr while the answer streams: drafter, accepted length, tok/s.")] = False,
    policy: PolicyFlag = None,
    draft_tokens: DraftTokens = None,
    temperature: Temperature = None,
    top_k: TopK = None,
    top_p: TopP = None,
    repeat_penalty: RepeatPenalty = None,
    repeat_last_n: RepeatLastN = None,
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", "-n", help="Budget per answer.")] = None,
    seed: Seed = None,
    pool: Pool = None,
    model: Model = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Chat with the model over several turns (on a terminal: /help for commands; piped: one turn per line)."""
    from specdraft.commands.chat import ChatOptions, run_chat

    console = err_console()
    options = options_of(ChatOptions, locals())
    run_command(console, verbose, lambda: run_chat(with_pool(options, model), console))


@app.command(epilog=epilog("bench"))
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
    seed: Seed = None,
    temperature: Annotated[Optional[float], typer.Option(help="Over the profile's: > 0 benches sampling (outputs are then not compared with plain decoding's).", show_default=False)] = None,
    skip: Annotated[int, typer.Option(help="Leave the first N prompts out of the summary; they still run (and warm drafters that learn from earlier answers).")] = 0,
    versus: Annotated[Optional[str], typer.Option(help="Also show every row's speed as a ratio to this configuration, e.g. fixed:lookup.")] = None,
    engine: Annotated[str, typer.Option(help="specdraft: its own engine; vllm: vLLM plain, vLLM's ngram (and suffix) speculation and specdraft's proposer, each in a fresh vLLM engine.")] = "specdraft",
    concurrency: Annotated[Optional[str], typer.Option(help="With --engine vllm: requests in flight, comma-separated, e.g. 1,8,32 (default 1).")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="A first look in about a minute: 4 prompts, 32 tokens each, plain decoding against the profile's policy only.")] = False,
    model: Model = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="The wide table (acceptance by position, regret, time split, draft lengths) and library logs.")] = False,
) -> None:
    """Measure speedup over plain decoding on a dataset, live or replayed from a trace."""
    from specdraft.commands.bench import BenchOptions, run_bench_command

    console = err_console()
    options = options_of(BenchOptions, locals())
    run_command(console, verbose, lambda: run_bench_command(with_pool(options, model, optional=True), console))


@app.command(epilog=epilog("trace"))
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
    run_command(console, verbose, lambda: run_trace_command(profile_path(pool, model), data, out, max_new_tokens, limit,
                                                     chat, console))


@app.command(epilog=epilog("export"))
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
    run_command(console, verbose, lambda: run_export_command(profile_path(pool, model), out, dtype, force, console))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, epilog=epilog("serve"))
def serve(
    ctx: typer.Context,
    port: Annotated[int, typer.Option(help="Port of the OpenAI-compatible server.")] = 8000,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    dtype: Annotated[str, typer.Option(help="auto (float32 on a CPU, bfloat16 on CUDA), float32, bfloat16 or float16.")] = "auto",
    policy_state: Annotated[Optional[str], typer.Option("--policy-state", help="JSON file: start from the learned policy state in it (if present) and save it back while serving.")] = None,
    log_every: Annotated[float, typer.Option("--log-every", help="Seconds between the proposer's log lines (acceptance, drafters' shares) on stderr; 0 = none.")] = 10.0,
    engine: Annotated[str, typer.Option(help="specdraft: its own engine, the model and learned policy kept loaded, one request decoding at a time; vllm: vLLM's server with the pool as its proposer, many requests at once.")] = "specdraft",
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", "-n", help="With --engine specdraft: the most tokens a request may ask for (default: the profile's).", show_default=False)] = None,
    temperature: Annotated[Optional[float], typer.Option(help="With --engine specdraft: the temperature every request decodes at (default: the profile's; a request asking another is refused).", show_default=False)] = None,
    pool: Pool = None,
    model: Model = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Serve the target behind an OpenAI-compatible API (/v1/completions, /v1/chat/completions, streaming), on specdraft's own engine or (--engine vllm) vLLM's. Arguments after -- go to vLLM."""
    from specdraft.commands.serve import ServeOptions, run_serve_command

    console = err_console()
    opts = ServeOptions(pool, port, host, dtype, policy_state, log_every, tuple(ctx.args), engine, max_new_tokens,
                        temperature)
    run_command(console, verbose, lambda: run_serve_command(with_pool(opts, model), console))


@app.command("calibrate-beta", epilog=epilog("calibrate-beta"))
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
    options = options_of(CalibrateOptions, locals())
    run_command(console, verbose, lambda: run_calibrate(with_pool(options, model), console))


app.add_typer(profile_app, name="profile")
app.add_typer(calibrate_app, name="calibrate")
app.add_typer(datastore_app, name="datastore")
app.add_typer(train_app, name="train")


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:  # Ctrl-C outside a command body (e.g. during imports)
        sys.exit(130)
