"""The TOML drafter-pool profile: parsing, validation and the frozen dataclasses it becomes.

A profile has four sections, each mapped onto one dataclass: `[target]` (ModelSpec),
`[decode]` (DecodeConfig), `[policy]` (PolicyConfig) and `[[drafters]]` (DrafterConfig).
Everything is checked once, here, so the rest of the code can trust its inputs; every
error names the file and the key path (`drafters[2].kind: ...`) and becomes exit code 2.
Checks that need a loaded model (a drafter's tokenizer, a layer count against the target's
depth) happen at load time and raise the same ProfileError.
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

from specdraft.errors import ProfileError

DRAFTER_KINDS = ("model", "ngram", "layers")
DTYPES = ("auto", "float32", "float16", "bfloat16", "float64")
QUANTIZATIONS = ("4bit", "8bit")


@dataclass(frozen=True)
class ModelSpec:
    """Where a model comes from and how it is placed; shared by `[target]` and model drafters."""

    hub: str | None = None  # a hub id, resolved from the local Hugging Face cache only
    path: Path | None = None  # a local folder or a .gguf file
    package: str | None = None  # an installed Python package that ships the file ...
    file: str | None = None  # ... at this path inside it
    dtype: str = "auto"
    device: str = "auto"
    quantization: str | None = None
    trust_remote_code: bool = False

    def describe(self) -> str:
        if self.hub:
            return self.hub
        if self.package:
            return f"{self.package}/{self.file}"
        return str(self.path)


@dataclass(frozen=True)
class DecodeConfig:
    draft_tokens: int = 5
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0  # 0 disables top-k filtering
    top_p: float = 1.0  # 1.0 disables nucleus filtering
    seed: int | None = None
    stop: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class PolicyConfig:
    name: str = "random"
    options: Mapping[str, Any] = field(default_factory=dict)  # validated by the policy itself


@dataclass(frozen=True)
class DrafterConfig:
    name: str
    kind: str
    model: ModelSpec | None = None  # kind = "model"
    min_ngram: int = 1  # kind = "ngram"
    max_ngram: int = 3
    layers: int = 0  # kind = "layers": how many of the target's first decoder layers


@dataclass(frozen=True)
class Profile:
    file: Path
    target: ModelSpec
    decode: DecodeConfig
    policy: PolicyConfig
    drafters: tuple[DrafterConfig, ...]

    def drafter_index(self, name: str) -> int | None:
        return next((i for i, d in enumerate(self.drafters) if d.name == name), None)

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


class _Table:
    """One TOML table being read: typed getters that know their key path, then a leftover check."""

    def __init__(self, data: Any, file: str, path: str):
        if not isinstance(data, dict):
            raise ProfileError(file, path, f"expected a table, got {_type_name(data)}")
        self.data, self.file, self.path, self.used = data, file, path, set()

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def error(self, name: str | None, message: str) -> ProfileError:
        return ProfileError(self.file, self.key(name) if name else self.path, message)

    def get(self, name: str, types: type | tuple[type, ...], default: Any = None) -> Any:
        self.used.add(name)
        if name not in self.data:
            return default
        value = self.data[name]
        # TOML booleans are ints in Python; never let `true` pass as a number.
        if isinstance(value, bool) and bool not in _as_tuple(types):
            raise self.error(name, f"expected {_names(types)}, got a boolean")
        if not isinstance(value, types):
            raise self.error(name, f"expected {_names(types)}, got {_type_name(value)}")
        if float in _as_tuple(types) and isinstance(value, int):
            value = float(value)
        return value

    def choice(self, name: str, choices: tuple[str, ...], default: str | None) -> str | None:
        value = self.get(name, str, default)
        if value is not None and value not in choices:
            raise self.error(name, f'unknown value "{value}"; expected one of {", ".join(choices)}')
        return value

    def finish(self, allowed_extra: tuple[str, ...] = ()) -> None:
        unknown = [k for k in self.data if k not in self.used and k not in allowed_extra]
        if unknown:
            raise self.error(unknown[0], "unknown key" + _suggest(unknown[0], self.used))


def load_profile(file: str | Path) -> Profile:
    """Read and validate a profile file; raises ProfileError with file and key path."""
    path = Path(file)
    shown = str(file)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProfileError(shown, None, "profile file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(shown, None, f"cannot read profile: {exc}") from None
    return parse_profile(text, path)


def parse_profile(text: str, path: Path) -> Profile:
    shown = str(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(shown, None, f"TOML syntax error: {exc}") from None
    root = _Table(data, shown, "")
    base = path.resolve().parent

    target_data = root.get("target", dict)
    if target_data is None:
        raise ProfileError(shown, "target", "missing section [target]")
    target = _parse_model(_Table(target_data, shown, "target"), base)

    decode_table = _Table(root.get("decode", dict, {}), shown, "decode")
    decode = _parse_decode(decode_table)

    drafters_data = root.get("drafters", list, [])
    drafters = tuple(
        _parse_drafter(_Table(d, shown, f"drafters[{i}]"), base) for i, d in enumerate(drafters_data)
    )
    seen: dict[str, int] = {}
    for i, d in enumerate(drafters):
        if d.name in seen:
            raise ProfileError(
                shown, f"drafters[{i}].name", f'duplicate drafter name "{d.name}" (also drafters[{seen[d.name]}])'
            )
        seen[d.name] = i

    policy_table = _Table(root.get("policy", dict, {}), shown, "policy")
    name = policy_table.get("name", str, "random" if drafters else "fixed")
    options = {k: v for k, v in policy_table.data.items() if k != "name"}
    root.finish()
    profile = Profile(path, target, decode, PolicyConfig(name, options), drafters)
    # Imported here: policies know their own parameters, the profile only routes them.
    from specdraft.policies import validate_policy

    validate_policy(profile.policy, profile, key="policy")
    return profile


def parse_policy_flag(flag: str, profile: Profile) -> PolicyConfig:
    """`--policy ucb` or `--policy fixed:ngram` over the profile's policy, validated."""
    from specdraft.policies import validate_policy

    config = policy_from_flag(flag, profile.policy)
    validate_policy(config, profile, key="--policy")
    return config


def policy_from_flag(flag: str, base: PolicyConfig) -> PolicyConfig:
    """`NAME` or `NAME:DRAFTER` applied over `base` (not validated): options keep their base
    values only when the name is unchanged, since another policy's own parameters would not
    fit; the options every policy shares carry over, except `evaluate`, whose default differs."""
    from specdraft.policies.base import COMMON_OPTIONS

    name, _, arg = flag.partition(":")
    options = dict(base.options)
    if name != base.name:
        options = {k: v for k, v in options.items() if k in COMMON_OPTIONS and k != "evaluate"}
    if arg:
        options["drafter"] = arg
    return PolicyConfig(name, options)


def _parse_model(table: _Table, base: Path) -> ModelSpec:
    hub = table.get("hub", str)
    raw_path = table.get("path", str)
    package = table.get("package", str)
    file = table.get("file", str)
    sources = [k for k, v in (("hub", hub), ("path", raw_path), ("package", package)) if v is not None]
    if len(sources) != 1:
        given = ", ".join(sources) if sources else "none"
        raise table.error(None, f"give exactly one model source of hub, path, package (given: {given})")
    if package is not None and file is None:
        raise table.error("file", "package needs file = the model file's path inside the package")
    if file is not None and package is None:
        raise table.error("file", "file is only used together with package")
    path = None
    if raw_path is not None:
        path = Path(raw_path).expanduser()
        if not path.is_absolute():
            path = base / path
        if not path.exists():
            raise table.error("path", f"model path not found: {path}")
    spec = ModelSpec(
        hub=hub,
        path=path,
        package=package,
        file=file,
        dtype=table.choice("dtype", DTYPES, "auto"),
        device=table.get("device", str, "auto"),
        quantization=table.choice("quantization", QUANTIZATIONS, None),
        trust_remote_code=table.get("trust_remote_code", bool, False),
    )
    if spec.device != "auto" and spec.device.split(":")[0] not in ("cpu", "cuda", "mps"):
        raise table.error("device", f'unknown device "{spec.device}"; expected auto, cpu, cuda, cuda:N or mps')
    table.finish()
    return spec


def _parse_decode(table: _Table) -> DecodeConfig:
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
        seed=table.get("seed", int, None),
        stop=tuple(stop),
    )
    table.finish()
    _check_decode(decode, table.file, prefix="decode.")
    return decode


def _check_decode(decode: DecodeConfig, file: Path | str, prefix: str) -> None:
    checks = (
        ("draft_tokens", 1 <= decode.draft_tokens <= 64, "must be between 1 and 64"),
        ("max_new_tokens", decode.max_new_tokens >= 1, "must be at least 1"),
        ("temperature", 0.0 <= decode.temperature <= 100.0, "must be between 0 and 100"),
        ("top_k", decode.top_k >= 0, "must be 0 (off) or positive"),
        ("top_p", 0.0 < decode.top_p <= 1.0, "must be in (0, 1]"),
    )
    for name, ok, message in checks:
        if not ok:
            where = f"{prefix}{name}" if prefix else f"--{name.replace('_', '-')}"
            raise ProfileError(str(file), where, f"{message} (got {getattr(decode, name)})")


def _parse_drafter(table: _Table, base: Path) -> DrafterConfig:
    name = table.get("name", str)
    if not name:
        raise table.error("name", "every drafter needs a non-empty name")
    if name == "none":
        raise table.error("name", '"none" is reserved for plain decoding')
    kind = table.get("kind", str)
    if kind is None:
        raise table.error("kind", f"missing; expected one of {', '.join(DRAFTER_KINDS)}")
    if kind not in DRAFTER_KINDS:
        raise table.error("kind", f'unknown kind "{kind}"; expected one of {", ".join(DRAFTER_KINDS)}')
    if kind == "model":
        model_keys = ("hub", "path", "package", "file", "dtype", "device", "quantization", "trust_remote_code")
        sub = _Table({k: v for k, v in table.data.items() if k in model_keys}, table.file, table.path)
        table.finish(allowed_extra=model_keys)
        return DrafterConfig(name, kind, model=_parse_model(sub, base))
    if kind == "ngram":
        min_n, max_n = table.get("min_ngram", int, 1), table.get("max_ngram", int, 3)
        if min_n < 1:
            raise table.error("min_ngram", f"must be at least 1 (got {min_n})")
        if max_n < min_n:
            raise table.error("max_ngram", f"must be at least min_ngram = {min_n} (got {max_n})")
        table.finish()
        return DrafterConfig(name, kind, min_ngram=min_n, max_ngram=max_n)
    layers = table.get("layers", int)
    if layers is None:
        raise table.error("layers", "missing; how many of the target's first decoder layers to use")
    if layers < 1:
        raise table.error("layers", f"must be at least 1 (got {layers})")
    table.finish()
    return DrafterConfig(name, kind, layers=layers)


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "a list", dict: "a table"}


def _names(types: type | tuple[type, ...]) -> str:
    return " or ".join(dict.fromkeys(_TYPE_NAMES.get(t, t.__name__) for t in _as_tuple(types)))


def _type_name(value: Any) -> str:
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def _suggest(name: str, known: set[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, sorted(known), n=1)
    return f'; did you mean "{close[0]}"?' if close else f"; known keys: {', '.join(sorted(known))}"
