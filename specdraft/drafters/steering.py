"""SD2 steering (Berdoz et al.) as a module, the hooks that inject it into a pretrained
drafter, and its files: what `specdraft train steer` writes and the `steered` kind loads.

The steering vector g = W_hml [h_low; h_mid; h_high] is computed from the target's hidden
states at three depths at one position; per-layer biases b_l = W_s g are added to every
MLP pre-activation of the drafter (the gate projection's output, just before the
activation of a gated MLP: Llama, Qwen2, Mistral, Gemma). W_s starts at zero, so an
untrained steering leaves the drafter exactly as it was. Each of the three states is
RMS-normalized (no parameters) before the projection: their scales differ by orders of
magnitude across depths, and the projection should not have to learn that first.

A folder holds `steer.json` (shapes, the three layers, signatures of the target and of
the pretrained drafter it was trained for, how it was trained), `steer.safetensors`
(W_hml, W_s; absent for a distilled-only drafter) and, when the drafter itself was trained
too, `drafter.safetensors` (its weights, which replace the pretrained ones).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from specdraft.storage.atomic_files import staged_file, write_text
from specdraft.drafters.head_model import TargetSignature
from specdraft.errors import UsageError
from specdraft.storage.regular_files import read_regular_text

CONFIG, STEERING_WEIGHTS, DRAFTER_WEIGHTS = "steer.json", "steer.safetensors", "drafter.safetensors"
FORMAT = 1
# Decoding and training must agree on it: the first drafted token of a block is two positions
# after the latest verified state (the verify has not seen the token it produced itself).
FIRST_OFFSET = 2
# Width of g. W_s maps it to a bias for every MLP unit of every layer (24 x 4864 on
# Qwen2.5-0.5B), so its size is this times ~117k: 256 keeps it at 30M, computed once a block.
DEFAULT_STEER_SIZE = 256


def max_steer_size(target_hidden: int, drafter_hidden: int) -> int:
    """The widest steering vector trained or loaded: wider than its inputs it learns nothing
    more, and a file claiming more is damaged."""
    return 4 * max(target_hidden, drafter_hidden)


class SteeringFileError(Exception):
    """A steering folder that cannot be used (missing, damaged, or for another pair)."""


@dataclass
class SteeringConfig:
    layers: tuple[int, int, int]  # the target's low, middle and high hidden-state indices
    target_hidden: int
    steer_size: int
    drafter_layers: int
    intermediate: int
    target: TargetSignature
    drafter: TargetSignature  # the pretrained drafter the steering was trained on
    steering: bool = True  # False: a distilled drafter, no steering (the paper's baseline)
    drafter_trained: bool = True  # drafter.safetensors holds its trained weights
    trained: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict:
        data = asdict(self)
        data["layers"] = list(self.layers)
        return {"format": FORMAT, **data}

    @classmethod
    def from_json(cls, data: dict) -> "SteeringConfig":
        data = {k: v for k, v in data.items() if k != "format"}
        data["layers"] = tuple(data["layers"])
        data["target"] = TargetSignature(**data["target"])
        data["drafter"] = TargetSignature(**data["drafter"])
        config = cls(**data)
        config.check_sizes()
        return config

    def check_sizes(self) -> None:
        """Sizes checked against the models it claims before any tensor is allocated to them
        (a damaged file, or one built to exhaust memory): ValueError naming the field."""
        width, drafter_width = self.target.hidden_size, self.drafter.hidden_size
        bounds = {"target_hidden": (width, width), "steer_size": (1, max_steer_size(width, drafter_width)),
                  "drafter_layers": (1, self.drafter.num_hidden_layers), "intermediate": (1, 16 * drafter_width)}
        for name, (low, high) in bounds.items():
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and low <= value <= high):
                raise ValueError(f"{name} {value!r} is not from {low} to {high}")


def default_layers(target_layers: int) -> tuple[int, int, int]:
    """Low, middle and high hidden states (as EAGLE-3 reads them): after layer 2, after the
    middle layer, and two before the last (indices into transformers' hidden_states)."""
    return (min(2, target_layers), max(1, target_layers // 2), max(1, target_layers - 2))


class Steering(nn.Module):
    def __init__(self, config: SteeringConfig):
        super().__init__()
        self.config = config
        self.w_hml = nn.Linear(3 * config.target_hidden, config.steer_size, bias=False)
        self.w_s = nn.Linear(config.steer_size, config.drafter_layers * config.intermediate)
        nn.init.zeros_(self.w_s.weight)  # no steering until trained: the drafter is unchanged
        nn.init.zeros_(self.w_s.bias)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        """states [..., 3, H] (low, mid, high) -> per-layer MLP biases [..., layers, intermediate]."""
        states = states.to(torch.promote_types(states.dtype, torch.float32))  # normalized in >= float32
        normed = states * torch.rsqrt(states.pow(2).mean(-1, keepdim=True) + 1e-6)
        g = self.w_hml(normed.flatten(-2).to(self.w_hml.weight.dtype))
        return self.w_s(g).unflatten(-1, (self.config.drafter_layers, self.config.intermediate))


class SteeringHooks:
    """Adds `bias[..., l, :]` to the gate projection's output of every MLP of `model`
    (layer l) while a bias is set; nothing while it is None. The bias is [layers, I] for a
    whole forward (decoding: one steering vector per block) or [B, T, layers, I] per
    position (training: each position steered from its own offset)."""

    def __init__(self, model: nn.Module):
        self.bias: torch.Tensor | None = None
        # Computes the bias on the first forward that needs it, unless someone sets `bias`
        # first (decoding: the block's bias often comes free with the catch-up's biases).
        self.pending: Callable[[], torch.Tensor] | None = None
        self.handles = []
        for index, mlp in enumerate(gated_mlps(model)):
            self.handles.append(mlp.gate_proj.register_forward_hook(self.hook(index)))

    def hook(self, index: int):
        """The forward hook of gate projection `index`: adds that layer's steering bias."""
        def add_bias(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
            if self.bias is None:
                if self.pending is None:
                    return output
                self.bias, self.pending = self.pending(), None
            return output + self.bias[..., index, :].to(output.dtype)
        return add_bias

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def gated_mlps(model: nn.Module) -> list[nn.Module]:
    """Every decoder layer's MLP, each with a `gate_proj`; ValueError naming what is missing."""
    body = getattr(model, "model", model)
    layers = getattr(body, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder layers where specdraft looks (model.layers)")
    mlps = [getattr(layer, "mlp", None) for layer in layers]
    if not mlps or any(m is None or not isinstance(getattr(m, "gate_proj", None), nn.Module) for m in mlps):
        raise ValueError(f"{type(model).__name__} has no gated MLP (mlp.gate_proj) in every layer: steering "
                         "adds its biases before that activation (Llama, Qwen2, Mistral and Gemma have one)")
    return mlps


def new_steering(target: nn.Module, drafter: nn.Module, layers: tuple[int, int, int] | None = None,
                 steer_size: int | None = None, steering: bool = True) -> Steering:
    mlps = gated_mlps(drafter)
    n = int(target.config.num_hidden_layers)
    layers = layers or default_layers(n)
    if any(not 0 <= layer <= n for layer in layers):
        raise ValueError(f"steering layers {list(layers)} must be hidden-state indices 0..{n}")
    config = SteeringConfig(
        layers=tuple(int(x) for x in layers), target_hidden=int(target.config.hidden_size),
        steer_size=_steer_size(steer_size, target, drafter), drafter_layers=len(mlps),
        intermediate=int(mlps[0].gate_proj.out_features), target=TargetSignature.of(target),
        drafter=TargetSignature.of(drafter), steering=steering)
    return Steering(config)


def save_steering(folder: Path, steering: Steering, drafter: nn.Module | None, trained: dict) -> None:
    """Write the folder: the config, the steering weights (when steering) and the drafter's
    weights (when it was trained). Each file is written whole and then renamed."""
    from safetensors.torch import save_file, save_model

    folder.mkdir(parents=True, exist_ok=True)
    steering.config.trained = trained
    steering.config.drafter_trained = drafter is not None
    if steering.config.steering:
        with staged_file(folder / STEERING_WEIGHTS) as partial:
            save_file({k: v.detach().float().contiguous() for k, v in steering.state_dict().items()}, str(partial))
    if drafter is not None:
        with staged_file(folder / DRAFTER_WEIGHTS) as partial:
            save_model(drafter, str(partial))  # dedups tied embeddings
    write_text(folder / CONFIG, json.dumps(steering.config.to_json(), indent=1))


def read_steering_config(folder: Path) -> SteeringConfig:
    """The folder's config (what was trained, for which pair), without any weights."""
    config_path = folder / CONFIG
    if not folder.is_dir():
        raise SteeringFileError(f"{folder}: no such folder (train one with `specdraft train steer`)")
    if not config_path.is_file():
        raise SteeringFileError(f"{folder}: not a steering folder ({CONFIG} expected)")
    try:
        data = json.loads(read_regular_text(config_path, limit=1 << 20))
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else None
            raise SteeringFileError(f"{config_path}: format {found!r}, this specdraft reads {FORMAT}")
        return SteeringConfig.from_json(data)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        raise SteeringFileError(f"{config_path}: unreadable steering config ({exc})") from None


def load_steering(folder: Path, target: nn.Module, drafter: nn.Module) -> Steering:
    """The steering in `folder`, with the drafter's trained weights loaded into `drafter`;
    refused (SteeringFileError) for another target or another pretrained drafter."""
    from safetensors.torch import load_file, load_model

    config = read_steering_config(folder)
    for role, expected, model in (("target", config.target, target), ("drafter", config.drafter, drafter)):
        why = expected.mismatch(TargetSignature.of(model))
        if why:
            raise SteeringFileError(f"{folder}: trained for another {role}: {why}")
    steering = Steering(config)
    try:
        if config.steering:
            steering.load_state_dict(load_file(str(folder / STEERING_WEIGHTS)))
        if config.drafter_trained:
            missing, unexpected = load_model(drafter, str(folder / DRAFTER_WEIGHTS), strict=False)
            if unexpected or [m for m in missing if "lm_head" not in m]:
                raise SteeringFileError(f"{folder / DRAFTER_WEIGHTS}: does not match the drafter "
                                        f"(missing {list(missing)[:3]}, unexpected {list(unexpected)[:3]})")
    except (OSError, RuntimeError, ValueError) as exc:
        raise SteeringFileError(f"{folder}: unreadable weights ({str(exc).splitlines()[0]})") from None
    loaded = [("steering", steering)] + ([("drafter", drafter)] if config.drafter_trained else [])
    for role, module in loaded:  # nan weights would draft from nan probabilities: a diverged training wrote them
        broken = next((name for name, p in module.named_parameters()
                       if p.is_floating_point() and not bool(torch.isfinite(p.detach()).all())), None)
        if broken is not None:
            raise SteeringFileError(f"{folder}: the {role}'s weight {broken} holds nan or infinite values; "
                                    "train it again (a lower --lr)")
    return steering.eval()


def _steer_size(given: int | None, target: nn.Module, drafter: nn.Module) -> int:
    widest = max_steer_size(int(target.config.hidden_size), int(drafter.config.hidden_size))
    if given is not None and given > widest:
        raise UsageError(f"--steer-size {given}: at most {widest} for these models (4x the wider hidden size)")
    return int(given or min(DEFAULT_STEER_SIZE, drafter.config.hidden_size))
