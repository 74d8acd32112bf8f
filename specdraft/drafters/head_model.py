"""The draft head (EAGLE-style) as a module, and its files: what `specdraft train head`
writes and the `head` drafter kind loads.

The head reads the target's final feature f_t (the hidden state the target's own head
reads, after its final norm) and the embedding of the next token x_{t+1}, fuses them
(`fc`), runs one Llama decoder layer with its own small KV cache over the positions before,
and predicts f_{t+1}; the target's own head rows read the prediction out. A head may also
read lower layers of the target at t (EAGLE-3's fused features, `feature_layers`): their
hidden states are concatenated with f_t and projected to one feature (`fuse`, which starts
as "take f_t", so such a head starts where a final-feature head does). Drafting the
token after next feeds the prediction back in place of the feature the target would have
computed. The readout is the target's head restricted to a draft vocabulary (the most
frequent tokens of the training text, EAGLE-3's trick: SmolLM2's 49k-row head is ~20% of
its weights) and is never trained or saved: the head file holds the fusion, the layer, the
norm and the vocabulary ids, and names the target it was trained for by a signature of its
embedding, so it is refused on another model.

Files: `head.safetensors` (weights, float32) and `head.json` (shapes, vocabulary size,
the target layers it reads, target signature, how it was trained). Format 1 heads (before
`feature_layers`) read the final feature only and still load.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdraft.models.kv_cache import cache_keyword
from specdraft.storage.atomic_files import staged_file, write_text
from specdraft.storage.regular_files import read_regular_text
WEIGHTS, CONFIG = "head.safetensors", "head.json"
FORMAT = 2
READABLE_FORMATS = (1, 2)
SIGNATURE_SIZE = 4096  # embedding values whose signs identify the target
SIGNATURE_AGREEMENT = 0.98  # two loads of one model agree on every sign but ~0; another model on ~50%


@dataclass
class TargetSignature:
    """What identifies the target a head was trained for: its shapes, and the signs of a
    fixed sample of its embedding (the same in every dtype it may be loaded in)."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    embedding_signs: str  # hex of SIGNATURE_SIZE sign bits

    @classmethod
    def of(cls, target: nn.Module) -> "TargetSignature":
        config = target.config
        weight = target.get_input_embeddings().weight.detach()
        flat = weight.reshape(-1)
        index = torch.arange(SIGNATURE_SIZE, device=flat.device) * (flat.numel() - 1) // (SIGNATURE_SIZE - 1)
        bits = (flat[index] > 0).cpu().numpy()
        return cls(getattr(config, "model_type", "?"), int(config.hidden_size), int(config.num_hidden_layers),
                   int(weight.shape[0]), _pack_bits(bits))

    def mismatch(self, other: "TargetSignature") -> str | None:
        """Why a head trained for `self` cannot draft for `other`, or None."""
        for name in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"it was trained for a target with {name} = {mine}, this target has {theirs}"
        agree = _agreement(self.embedding_signs, other.embedding_signs)
        if agree < SIGNATURE_AGREEMENT:
            return (f"it was trained for another model of the same shape (embedding signature agrees on "
                    f"{agree:.0%} of its samples)")
        return None


@dataclass
class HeadConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: dict[str, Any]
    max_position_embeddings: int
    draft_vocab: int  # rows of the readout: target token ids in `vocab_ids`
    target: TargetSignature
    trained: dict[str, Any] = field(default_factory=dict)  # steps, data, loss: for people, not code
    # target layers whose hidden states at t the head reads, ascending; the last is always
    # the final feature (the target's layer count). Empty: the final feature only (format 1)
    feature_layers: list[int] = field(default_factory=list)

    @property
    def layers_read(self) -> list[int]:
        return self.feature_layers or [self.target.num_hidden_layers]

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "HeadConfig":
        """The config a head's file holds, its sizes checked before anything is built to
        them (TypeError or ValueError naming the field)."""
        values = {k: v for k, v in data.items() if k != "format"}
        values["target"] = TargetSignature(**values["target"])
        config = cls(**values)
        config.check_sizes()
        return config

    def check_sizes(self) -> None:
        """A head is one decoder layer of its target's width: sizes beyond that are damage
        (or a file built to exhaust memory), refused before any tensor is allocated."""
        width = self.target.hidden_size
        bounds = {"hidden_size": (width, width), "intermediate_size": (1, 16 * width),
                  "num_attention_heads": (1, width), "num_key_value_heads": (1, self.num_attention_heads),
                  "head_dim": (1, width), "max_position_embeddings": (1, 1 << 24),
                  "draft_vocab": (1, self.target.vocab_size)}
        for name, (low, high) in bounds.items():
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and low <= value <= high):
                raise ValueError(f"{name} {value!r} is not from {low} to {high}")
        if not all(isinstance(v, int) and 1 <= v <= self.target.num_hidden_layers for v in self.feature_layers):
            raise ValueError(f"feature_layers {self.feature_layers!r} are not target layers")

    @classmethod
    def for_target(cls, target: nn.Module, draft_vocab: int, lower_layers: tuple[int, ...] = ()) -> "HeadConfig":
        """A head shaped like one of the target's decoder layers (a Llama layer whatever the
        target's family: attention with rotary positions, a gated MLP, RMS norms), reading
        the target's final feature and the hidden states after `lower_layers`."""
        c = target.config
        final = int(c.num_hidden_layers)
        if any(not 1 <= layer < final for layer in lower_layers):
            raise ValueError(f"lower feature layers must lie in 1..{final - 1} (got {list(lower_layers)})")
        layers = sorted(set(lower_layers)) + [final] if lower_layers else []
        hidden = int(c.hidden_size)
        heads = int(getattr(c, "num_attention_heads", max(1, hidden // 64)))
        head_dim = int(getattr(c, "head_dim", None) or hidden // heads)
        rope = getattr(c, "rope_parameters", None) or {"rope_type": "default",
                                                       "rope_theta": float(getattr(c, "rope_theta", 10000.0))}
        if rope.get("rope_type", "default") != "default":  # scaled variants need keys a head never uses
            rope = {"rope_type": "default", "rope_theta": float(rope.get("rope_theta", 10000.0))}
        return cls(hidden_size=hidden, intermediate_size=int(getattr(c, "intermediate_size", 4 * hidden)),
                   num_attention_heads=heads,
                   num_key_value_heads=int(getattr(c, "num_key_value_heads", None) or heads), head_dim=head_dim,
                   rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)), rope_parameters=dict(rope),
                   max_position_embeddings=int(getattr(c, "max_position_embeddings", 8192)),
                   draft_vocab=draft_vocab, target=TargetSignature.of(target), feature_layers=layers)


class DraftHead(nn.Module):
    """fc([embedding of x_{t+1}; g_t]) -> one decoder layer -> norm = predicted f_{t+1}, where
    g_t = fuse([target layers at t]) for a committed position (f_t itself for a head that
    reads the final feature only) and the head's own prediction for a drafted one."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        from transformers import LlamaConfig, LlamaModel

        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        layer_config = LlamaConfig(vocab_size=1, hidden_size=h, intermediate_size=config.intermediate_size,
                                   num_hidden_layers=1, num_attention_heads=config.num_attention_heads,
                                   num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
                                   rms_norm_eps=config.rms_norm_eps, rope_parameters=dict(config.rope_parameters),
                                   max_position_embeddings=config.max_position_embeddings, bos_token_id=None,
                                   eos_token_id=None, pad_token_id=None)
        # A one-layer LlamaModel fed embeddings directly: its rotary embedding, masks and
        # cache handling are transformers' own. Its 1-row token table is never used.
        self.body = LlamaModel(layer_config)
        read = len(config.layers_read)
        self.fuse = nn.Linear(read * h, h, bias=False) if read > 1 else None
        self.register_buffer("vocab_ids", torch.arange(config.draft_vocab), persistent=True)

    @property
    def layer_config(self):
        return self.body.config

    def fused(self, features: torch.Tensor) -> torch.Tensor:
        """The target's hidden states at t, [..., layers * H] (layers_read, in order) -> g_t [..., H].
        Lower layers' states are RMS-normalised first: unlike the final feature, they are the
        raw residual stream, whose scale grows with depth and varies between models."""
        if self.fuse is None:
            return features
        h = self.config.hidden_size
        # the norm's dtype, not the fusion's: a packed layer's `.weight` is a fresh dense copy
        features = features.to(self.body.norm.weight.dtype)
        lower = features[..., :-h].unflatten(-1, (-1, h))  # [..., layers - 1, H]
        lower = lower * torch.rsqrt(lower.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return self.fuse(torch.cat([lower.flatten(-2), features[..., -h:]], dim=-1))

    def forward(self, embeddings: torch.Tensor, features: torch.Tensor, position_ids: torch.Tensor,
                cache: Any = None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """embeddings, features: [B, T, H] (token x_{t+1}, g_t: `fused` target features or
        the head's own prediction); returns the predicted f_{t+1} [B, T, H]. Causal over the
        cached and the T new positions unless `attention_mask` ([1, 1, T, cached + T] bool,
        True: attend) says otherwise."""
        out = self.body(inputs_embeds=self.inputs(embeddings, features), position_ids=position_ids,
                        attention_mask=attention_mask, use_cache=cache is not None,
                        **{cache_keyword(self.body): cache})
        return out.last_hidden_state

    def inputs(self, embeddings: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """What the decoder layer reads: fc([embedding of x_{t+1}; g_t]) [B, T, H]."""
        return self.fc(torch.cat([embeddings, features.to(embeddings.dtype)], dim=-1))

    def init_from_target(self, target: nn.Module) -> None:
        """Start the norm where the target's final norm is (the prediction lives in the space
        the target's head reads), and the fusions as 'keep the feature' (the identity on f_t,
        nothing from lower layers)."""
        with torch.no_grad():
            self.fc.weight.zero_()
            h = self.config.hidden_size
            self.fc.weight[:, h:].copy_(torch.eye(h))
            if self.fuse is not None:
                self.fuse.weight.zero_()
                self.fuse.weight[:, -h:].copy_(torch.eye(h))
            norm = getattr(getattr(target, "model", None), "norm", None)
            weight = getattr(norm, "weight", None)
            if weight is not None and weight.shape == self.body.norm.weight.shape:
                self.body.norm.weight.copy_(weight.detach().float())


def save_head(folder: Path, head: DraftHead, trained: dict[str, Any] | None = None) -> None:
    """Write the head's two files (each replaced atomically) into `folder`."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    if trained is not None:
        head.config.trained = trained
    state = {name: tensor.detach().float().contiguous().cpu() if tensor.is_floating_point()
             else tensor.detach().contiguous().cpu() for name, tensor in head.state_dict().items()
             if not name.startswith("body.embed_tokens")}
    with staged_file(folder / WEIGHTS) as partial:
        save_file(state, str(partial))
    write_text(folder / CONFIG, json.dumps(head.config.to_json(), indent=2) + "\n")


class HeadFileError(ValueError):
    """A head folder that is missing, unreadable or for another target (one line)."""


def load_head(folder: Path, target: nn.Module | None = None) -> DraftHead:
    """The head in `folder`, refused (HeadFileError) when it was trained for another target."""
    from safetensors.torch import load_file

    config_path, weights_path = folder / CONFIG, folder / WEIGHTS
    if not folder.is_dir():
        raise HeadFileError(f"{folder}: no such folder (train one with `specdraft train head`)")
    if not config_path.is_file() or not weights_path.is_file():
        raise HeadFileError(f"{folder}: not a draft head ({CONFIG} and {WEIGHTS} expected)")
    try:
        data = json.loads(read_regular_text(config_path, limit=1 << 20))
        if not isinstance(data, dict) or data.get("format") not in READABLE_FORMATS:
            found = data.get("format") if isinstance(data, dict) else None
            raise HeadFileError(f"{config_path}: format {found!r}, this specdraft reads "
                                f"{' and '.join(map(str, READABLE_FORMATS))}")
        config = HeadConfig.from_json(data)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        raise HeadFileError(f"{config_path}: unreadable head config ({exc})") from None
    if target is not None:
        why = config.target.mismatch(TargetSignature.of(target))
        if why:
            raise HeadFileError(f"{folder}: this head does not fit the target: {why}")
    head = DraftHead(config)
    try:
        state = load_file(str(weights_path))
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        raise HeadFileError(f"{weights_path}: unreadable ({exc})") from None
    broken = next((name for name, tensor in state.items()
                   if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())), None)
    if broken is not None:  # it would draft from nan probabilities; a diverged training wrote it
        raise HeadFileError(f"{weights_path}: weight {broken} holds nan or infinite values; train the head again "
                            "(a lower --lr)")
    head.vocab_ids = torch.zeros(state["vocab_ids"].shape, dtype=torch.long)
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("body.embed_tokens")]
    if missing or unexpected:
        raise HeadFileError(f"{weights_path}: weights do not match {CONFIG} (missing {missing[:3]}, "
                            f"unexpected {unexpected[:3]})")
    return head.eval()


def _pack_bits(bits) -> str:
    import numpy as np

    return np.packbits(np.asarray(bits, dtype=bool)).tobytes().hex()


def _agreement(a: str, b: str) -> float:
    import numpy as np

    x = np.unpackbits(np.frombuffer(bytes.fromhex(a), dtype=np.uint8))
    y = np.unpackbits(np.frombuffer(bytes.fromhex(b), dtype=np.uint8))
    if x.shape != y.shape:
        return 0.0
    return float((x == y).mean())


class Readout:
    """The target's own head restricted to the draft vocabulary: logits over those rows
    (what training matches and drafting reads), and the same logits widened to the target's
    vocabulary with -inf elsewhere (q = 0 outside the draft vocabulary)."""

    def __init__(self, target: nn.Module, vocab_ids: torch.Tensor):
        head = target.get_output_embeddings()
        weight = head.weight.detach()
        self.vocab_ids = vocab_ids.to(weight.device)
        whole = self.vocab_ids.numel() == weight.shape[0] and bool(
            (self.vocab_ids == torch.arange(weight.shape[0], device=weight.device)).all())
        self.weight = weight if whole else weight.index_select(0, self.vocab_ids).clone()
        bias = getattr(head, "bias", None)
        self.bias = None if bias is None else (bias.detach() if whole else bias.detach()[self.vocab_ids].clone())
        self.whole = whole
        self.softcap = getattr(target.config, "final_logit_softcapping", None)
        self.kernel: nn.Module | None = None  # see pack(), on_blocks()

    def pack(self) -> None:
        """Read out through oneDNN's packed layout from now on (drafting only: training
        needs gradients through the dense product)."""
        from specdraft.models.kernels.packed_linear import PackedLinear

        self.kernel = PackedLinear.of(self.weight, self.bias)

    def on_blocks(self, head: nn.Module) -> None:
        """Read out through the rows of the target's head `head` (a BlockLinear) from now on,
        in its own codes: the same weights as `weight`, at the file's bytes per weight rather
        than float32's (drafting only)."""
        self.kernel = head.subset(self.vocab_ids)

    def small(self, features: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., draft vocab] logits."""
        features = features.to(self.weight.dtype)
        logits = (self.kernel(features) if self.kernel is not None
                  else nn.functional.linear(features, self.weight, self.bias))
        if self.softcap:  # models that cap their logits (Gemma) do it after the head
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def widen(self, small: torch.Tensor, width: int) -> torch.Tensor:
        """[..., draft vocab] -> [..., width], -inf outside the draft vocabulary."""
        if self.whole and small.shape[-1] == width:
            return small
        out = small.new_full((*small.shape[:-1], width), float("-inf"))
        return out.index_copy_(-1, self.vocab_ids, small)  # ids are rows of the target's head: all < width
