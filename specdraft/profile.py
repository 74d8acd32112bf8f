"""The TOML drafter-pool profile: parsing, validation and the frozen dataclasses it becomes.

A profile has four sections, each mapped onto one dataclass: `[target]` (ModelSpec),
`[decode]` (DecodeConfig), `[policy]` (PolicyConfig) and `[[drafters]]` (DrafterConfig,
whose kind-specific keys each drafter kind reads itself). Everything is checked once,
here, so the rest of the code can trust its inputs; every error names the file and the
key path (`drafters[2].kind: ...`) and becomes exit code 2. Checks that need a loaded
model (a drafter's tokenizer, a layer count against the target's depth) happen when the
pool is built and raise the same ProfileError.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from specdraft.config.model_spec import ModelSpec, parse_model_spec
from specdraft.config.tables import Table
from specdraft.drafters.registry import DrafterConfig, parse_drafter
from specdraft.errors import ProfileError, UsageError
from specdraft.learning.planner import pool_arms
from specdraft.learning.policies import COMMON_OPTIONS, check_policy, option_value
from specdraft.storage.regular_files import is_regular, read_regular_text

# Below this, logits / temperature overflow float32 (1e-39 gives inf, then NaN probabilities);
# such a temperature is greedy decoding in all but name, so 0 is asked for instead.
MIN_TEMPERATURE = 1e-3
# A penalty outside these bounds flattens the distribution into noise (or makes a repeated
# token certain); a window past this many tokens is what -1 (the whole context) is for.
MIN_REPEAT_PENALTY, MAX_REPEAT_PENALTY, MAX_REPEAT_WINDOW = 0.1, 10.0, 1 << 16
DEFAULT_POLICY = "normalhedge"  # a profile with drafters and no [policy] (docs/policies.md)
PROFILE_LIMIT = 4 << 20  # bytes: a profile is a page of TOML; /dev/zero or a model file is refused


@dataclass(frozen=True)
class DecodeConfig:
    draft_tokens: int = 5
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0  # 0 disables top-k filtering
    top_p: float = 1.0  # 1.0 disables nucleus filtering
    # The target's logits of tokens among the last `repeat_last_n` of the context (-1: all of
    # it) divided by this when positive, multiplied when not (llama.cpp's); 1.0 disables it.
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None
    stop: tuple[str, ...] = ()
    feedback: str = "exact"  # greedy alignment: "exact" (argmax agreement) or "soft" (T = 1 overlap)
    kv_cache: str = "auto"  # "dynamic" | "static" | "auto" (static on CUDA, where graphs need it)
    cuda_graphs: bool = True  # replay small feeds as CUDA graphs (static cache on CUDA only)
    # How model drafters run their own forwards: "lean" (lean/decoder.py: Llama-shaped models,
    # without transformers' per-op overhead), "transformers", or "auto" (lean on a CPU where
    # the model allows it; CUDA graphs remove the same overhead on a GPU).
    drafter_core: str = "auto"
    # The target's float linear layers on a CPU: "onednn" (packed_linear.py: weights reordered
    # once for oneDNN, several times faster at decode widths), "torch" (nn.Linear), or "auto"
    # (oneDNN where the model and CPU allow it).
    linear_kernel: str = "auto"
    # "measure": time the target's forward at every verify width once per model and machine
    # (kept on disk), plan with that curve and pad a verify to a cheaper wider width;
    # "line": fit a line to this run's verify timings, never pad.
    verify_costs: str = "measure"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class PolicyConfig:
    name: str = "random"
    options: Mapping[str, Any] = field(default_factory=dict)  # checked by the policy itself


@dataclass(frozen=True)
class Profile:
    file: Path
    target: ModelSpec
    decode: DecodeConfig
    policy: PolicyConfig
    drafters: tuple[DrafterConfig, ...]

    @property
    def arms(self) -> list[str]:
        """The arms its policy chooses among, in order (`learning/planner.pool_arms`): the
        drafters, then the plain arm where the policy allows a plain round."""
        return pool_arms([d.name for d in self.drafters],
                         bool(option_value(self.policy.name, self.policy.options, "allow_none")))

    def with_overrides(self, **decode_overrides: Any) -> "Profile":
        """Apply command-line flags over the profile's values; None means 'not given'."""
        given = {k: v for k, v in decode_overrides.items() if v is not None}
        policy = given.pop("policy", None)
        decode = dataclasses.replace(self.decode, **given)
        _check_decode(decode, self.file, prefix="")
        profile = dataclasses.replace(self, decode=decode)
        if policy is not None:
            profile = dataclasses.replace(profile, policy=parse_policy_flag(policy, profile))
        return profile


def refuse_penalty(profile: Profile, what: str) -> None:
    """A ProfileError when `profile` sets a repetition penalty that `what` would not apply."""
    decode = profile.decode
    if decode.repeat_penalty != 1.0 and decode.repeat_last_n != 0:
        raise ProfileError(str(profile.file), "decode.repeat_penalty",
                           f"{what} decodes without a repetition penalty: set it to 1 (or leave it out) to compare")


def load_profile(file: str | Path) -> Profile:
    """Read and validate a profile file; raises ProfileError with file and key path."""
    path = Path(file)
    shown = str(file)
    try:
        text = read_regular_text(path, limit=PROFILE_LIMIT)
    except FileNotFoundError:
        raise ProfileError(shown, None, "profile file not found") from None
    except (OSError, ValueError) as exc:
        cause = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        hint = " (a model file? a profile is a TOML text file)" if _looks_like_model(path) else ""
        raise ProfileError(shown, None, f"cannot read profile: {cause}{hint}") from None
    return parse_profile(text, path)


def _looks_like_model(path: Path) -> bool:
    if not is_regular(path):  # a FIFO would block this open
        return False
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF" or path.suffix in (".gguf", ".safetensors", ".bin")
    except OSError:
        return False


def parse_profile(text: str, path: Path) -> Profile:
    shown = str(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(shown, None, f"TOML syntax error: {exc}") from None
    except RecursionError:  # tomli parses nested arrays and tables recursively
        raise ProfileError(shown, None, "TOML nested too deeply to be a profile") from None
    root = Table(data, shown, "")
    base = path.resolve().parent

    target_data = root.get("target", dict)
    if target_data is None:
        raise ProfileError(shown, "target", "missing section [target]")
    target = parse_model_spec(Table(target_data, shown, "target"), base)
    decode = _parse_decode(Table(root.get("decode", dict, {}), shown, "decode"))

    drafters_data = root.get("drafters", list, [])
    drafters = tuple(parse_drafter(Table(d, shown, f"drafters[{i}]"), base) for i, d in enumerate(drafters_data))
    seen: dict[str, int] = {}
    for i, d in enumerate(drafters):
        if d.name in seen:
            raise ProfileError(
                shown, f"drafters[{i}].name", f'duplicate drafter name "{d.name}" (also drafters[{seen[d.name]}])'
            )
        seen[d.name] = i

    policy_table = Table(root.get("policy", dict, {}), shown, "policy")
    name = policy_table.get("name", str, DEFAULT_POLICY if drafters else "fixed")
    options = {k: v for k, v in policy_table.data.items() if k != "name"}
    root.finish()
    profile = Profile(path, target, decode, PolicyConfig(name, options), drafters)
    _check_policy(profile.policy, profile, flag=False)
    return profile


def parse_policy_flag(flag: str, profile: Profile) -> PolicyConfig:
    """`--policy ucb` or `--policy fixed:ngram` over the profile's policy, validated."""
    config = policy_from_flag(flag, profile.policy)
    _check_policy(config, profile, flag=True)
    return config


def policy_from_flag(flag: str, base: PolicyConfig) -> PolicyConfig:
    """`NAME`, `NAME:DRAFTER`, either followed by `(KEY=VALUE; ...)` options, applied over
    `base` (not validated): options keep their base values only when the name is unchanged,
    since another policy's own parameters would not fit; the options every policy shares
    carry over, except `evaluate`, whose default differs. VALUEs are TOML values, and a bare
    word is a string: `normalhedge(reset=prompt)`, `ucb(beta=0.1; reward=be)`."""
    head, paren, rest = flag.partition("(")
    name, _, arg = head.strip().partition(":")
    options = dict(base.options)
    if name != base.name:
        options = {k: v for k, v in options.items() if k in COMMON_OPTIONS and k != "evaluate"}
    if arg:
        options["drafter"] = arg
    if paren:
        options.update(_flag_options(flag, rest))
    return PolicyConfig(name, options)


def _flag_options(flag: str, text: str) -> dict[str, Any]:
    if not text.endswith(")"):
        raise UsageError(f"policy {flag!r}: options go in one pair of parentheses: NAME(KEY=VALUE; ...)")
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text[:-1].split(";"))):
        key, equals, value = (p.strip() for p in item.partition("="))
        if not equals or not key:
            raise UsageError(f"policy {flag!r}: expected KEY=VALUE, got {item!r}")
        try:
            options[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            options[key] = value  # a bare word: a string
    return options


def split_policy_flags(text: str) -> list[str]:
    """`--policies` entries: split at commas outside parentheses."""
    flags, depth, current = [], 0, ""
    for char in text:
        depth += (char == "(") - (char == ")")
        if char == "," and depth == 0:
            flags.append(current)
            current = ""
        else:
            current += char
    return [f.strip() for f in [*flags, current] if f.strip()]


def _check_policy(config: PolicyConfig, profile: Profile, flag: bool) -> None:
    """The policy's own problems, as ProfileErrors at `policy.KEY` (or `--policy (NAME.KEY)`)."""
    file = str(profile.file)
    problems = check_policy(config.name, config.options, [d.name for d in profile.drafters])
    if problems and problems[0][0] == "name":
        raise ProfileError(file, "--policy" if flag else "policy.name", problems[0][1])
    if not profile.drafters and config.name != "fixed":
        raise ProfileError(file, "--policy" if flag else "policy.name",
                           f"{config.name} chooses among drafters and the pool has none (a profile without "
                           "[[drafters]] decodes plainly)")
    if problems:
        option, message = problems[0]
        raise ProfileError(file, f"--policy ({config.name}.{option})" if flag else f"policy.{option}", message)


def _parse_decode(table: Table) -> DecodeConfig:
    stop = table.get("stop", (list, str), [])
    if isinstance(stop, str):
        stop = [stop]
    if not all(isinstance(s, str) and s for s in stop):
        raise table.error("stop", "expected a list of non-empty strings")
    decode = DecodeConfig(
        draft_tokens=table.get("draft_tokens", int, 5),
        max_new_tokens=table.get("max_new_tokens", int, 256),
        temperature=table.get("temperature", (int, float), 0.0),
        top_k=table.get("top_k", int, 0),
        top_p=table.get("top_p", (int, float), 1.0),
        repeat_penalty=table.get("repeat_penalty", (int, float), 1.0),
        repeat_last_n=table.get("repeat_last_n", int, 64),
        seed=table.get("seed", int, None),
        stop=tuple(stop),
        feedback=table.choice("feedback", ("exact", "soft"), "exact"),
        kv_cache=table.choice("kv_cache", ("auto", "dynamic", "static"), "auto"),
        cuda_graphs=table.get("cuda_graphs", bool, True),
        drafter_core=table.choice("drafter_core", ("auto", "lean", "transformers"), "auto"),
        linear_kernel=table.choice("linear_kernel", ("auto", "onednn", "torch"), "auto"),
        verify_costs=table.choice("verify_costs", ("measure", "line"), "measure"),
    )
    table.finish()
    _check_decode(decode, table.file, prefix="decode.")
    return decode


def _check_decode(decode: DecodeConfig, file: Path | str, prefix: str) -> None:
    checks = (
        ("draft_tokens", 1 <= decode.draft_tokens <= 64, "must be between 1 and 64"),
        ("max_new_tokens", decode.max_new_tokens >= 1, "must be at least 1"),
        ("temperature", decode.temperature == 0.0 or MIN_TEMPERATURE <= decode.temperature <= 100.0,
         f"must be 0 (greedy) or from {MIN_TEMPERATURE} to 100"),
        ("top_k", decode.top_k >= 0, "must be 0 (off) or positive"),
        ("top_p", 0.0 < decode.top_p <= 1.0, "must be in (0, 1]"),
        ("repeat_penalty", MIN_REPEAT_PENALTY <= decode.repeat_penalty <= MAX_REPEAT_PENALTY,
         f"must be from {MIN_REPEAT_PENALTY} to {MAX_REPEAT_PENALTY:g} (1 is off)"),
        ("repeat_last_n", -1 <= decode.repeat_last_n <= MAX_REPEAT_WINDOW,
         f"must be -1 (the whole context), 0 (off) or up to {MAX_REPEAT_WINDOW}"),
        ("seed", decode.seed is None or 0 <= decode.seed <= 2**63 - 1, "must be between 0 and 2**63 - 1"),
    )
    for name, ok, message in checks:
        if not ok:
            where = f"{prefix}{name}" if prefix else f"--{name.replace('_', '-')}"
            raise ProfileError(str(file), where, f"{message} (got {getattr(decode, name)})")
