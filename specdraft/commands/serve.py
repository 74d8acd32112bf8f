"""`specdraft serve`: an OpenAI-compatible server of the profile's target.

`--engine specdraft` (the default): specdraft's own engine keeps the model and the learned
policy loaded and decodes one request at a time (serving/resident.py); the policy state is
saved back on exit with `--policy-state`. `--engine vllm`: vLLM's server with specdraft's
pool and policy as its speculative proposer (serving/), for many requests at once; the
profile, the policy state and vLLM itself are checked before anything starts, the server runs
as a child process and Ctrl-C stops it cleanly; arguments after `--` go to vLLM unchanged."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from specdraft.commands.io import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, warner
from specdraft.errors import UsageError


@dataclasses.dataclass
class ServeOptions:
    pool: str
    port: int = 8000
    host: str = "127.0.0.1"
    dtype: str = "auto"
    policy_state: str | None = None
    log_every: float = 10.0
    vllm_args: tuple[str, ...] = ()
    engine: str = "specdraft"
    max_new_tokens: int | None = None
    temperature: float | None = None


def run_serve_command(opts: ServeOptions, console: Console) -> int:
    if opts.engine not in ("specdraft", "vllm"):
        raise UsageError(f'--engine {opts.engine}: expected "specdraft" or "vllm"')
    if not 0 <= opts.port < 65536:
        raise UsageError(f"--port {opts.port}: expected 0..65535 (0: any free port)")
    if opts.engine == "specdraft":
        return _serve_resident(opts, console)
    return _serve_vllm(opts, console)


def _serve_resident(opts: ServeOptions, console: Console) -> int:
    from specdraft.commands.generate import load_policy_state, read_policy_state, save_policy_state
    from specdraft.profile import load_profile
    from specdraft.runtime import build_runtime
    from specdraft.serving.resident import Resident, serve_forever
    from specdraft.ui.progress import loading

    if opts.vllm_args:
        raise UsageError("arguments after -- go to vLLM: use them with --engine vllm")
    profile = load_profile(opts.pool).with_overrides(max_new_tokens=opts.max_new_tokens,
                                                     temperature=opts.temperature)
    state = read_policy_state(opts.policy_state)
    with loading(console):
        runtime = build_runtime(profile)
    if state is not None:
        load_policy_state(runtime.engine.driver, state, opts.policy_state, profile.decode.draft_tokens)
    name = Path(profile.target.describe()).stem
    resident = Resident(runtime, name)
    say = lambda url: console.print(f'serving {profile.target.describe()} as model "{name}" on {url} (one request '  # noqa: E731
                                    f"at a time; Ctrl-C stops)", markup=False, highlight=False)
    try:
        serve_forever(resident, opts.host, opts.port, say)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    finally:
        if opts.policy_state:
            save_policy_state(runtime.engine.driver, Path(opts.policy_state))
    return EXIT_OK


def _serve_vllm(opts: ServeOptions, console: Console) -> int:
    from specdraft.commands.generate import check_policy_state, read_policy_state
    from specdraft.profile import load_profile, refuse_penalty
    from specdraft.serving import launch
    from specdraft.serving.pool import check_calibration, served_drafters

    if opts.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise UsageError(f"--dtype {opts.dtype}: expected auto, float32, bfloat16 or float16")
    profile = load_profile(opts.pool)
    refuse_penalty(profile, "serve --engine vllm (its requests carry their own repetition_penalty)")
    served, left_out = served_drafters(profile)
    warn = warner(console)
    for name, why in left_out.items():
        warn(f'drafter "{name}" left out under vLLM ({why})')
    state = read_policy_state(opts.policy_state)
    if state is not None:
        check_policy_state(served, state, opts.policy_state)
        check_calibration(served, state, opts.policy_state)
    launch.require_vllm()
    dtype = opts.dtype if opts.dtype != "auto" else ("bfloat16" if launch.cuda_available() else "float32")
    model = launch.exported_target(profile, dtype)
    name = Path(opts.pool).stem
    command = launch.server_command(model, name, profile.decode.draft_tokens, opts.port, opts.host, dtype,
                                    list(opts.vllm_args))
    env = launch.child_environment(launch.proposer_environment(
        Path(opts.pool), Path(opts.policy_state) if opts.policy_state else None, opts.log_every))
    console.print(f'serving {profile.target.describe()} as model "{name}" on http://{opts.host}:{opts.port}/v1 '
                  f"(drafters: {', '.join(d.name for d in served.drafters)}; Ctrl-C stops)", markup=False)
    # stdout carries no text of ours here, and vLLM's logs are logs: both of its streams go to stderr.
    server = subprocess.Popen(command, env=env, stdout=sys.stderr)
    try:
        code = server.wait()
    except KeyboardInterrupt:
        stop(server)
        return EXIT_INTERRUPTED
    return EXIT_OK if code == 0 else EXIT_FAILURE


def stop(server: subprocess.Popen) -> None:
    """Ctrl-C: in a terminal the server has it too (same process group) and shuts down by
    itself; a signal sent to this process alone is passed on after a moment (a second
    SIGINT would cut vLLM's own shutdown short). Then insist."""
    for sig, wait in ((None, 5), (signal.SIGINT, 25), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        if server.poll() is not None:
            return
        try:
            if sig is not None:
                server.send_signal(sig)
            server.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
        except KeyboardInterrupt:  # another Ctrl-C: stop waiting politely
            continue
