"""Float linear layers over oneDNN's packed weight layout, for the target on a CPU.

A decode step multiplies a handful of rows (1 in plain decoding, K + 1 in a verify) by every
weight matrix of the model, so its cost is streaming the weights from memory. torch's
nn.Linear hands a float32 product to a BLAS call that, at these row counts, stays far below
the machine's memory bandwidth and runs 2 or 3 rows as separate passes over the weights.
oneDNN's inner-product primitive over a weight reordered once into its blocked layout
streams it at close to bandwidth whatever the row count. `benchmarks/linear_kernel.py`
times both on a model's own layers, and a target's forward at each width.

Same products, another summation order: outputs differ from nn.Linear's by float rounding
(about 1e-6 relative), as a verify over K + 1 tokens already differs from one-token forwards.
The weights are reordered in place of the dense ones (no second copy) unless a caller asks
to keep them: the bench does, to run transformers' own generation on the stock kernels,
which is what a user of transformers gets.

float32 everywhere oneDNN runs; bfloat16 where the CPU has the instructions for it. The
target is packed, and what drafts from it follows it: a `layers` self-drafter runs the
target's own (packed) layers, and a `head` drafter packs its layer and its readout when its
target is packed (`is_packed`). Quantized drafters keep torch's int4/int8 kernels.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("specdraft")

CHOICES = ("auto", "onednn", "torch")


class PackedLinear(nn.Module):
    """y = x W^T + b with W in oneDNN's blocked layout (an opaque tensor)."""

    def __init__(self, linear: nn.Linear, keep_dense: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = linear.bias
        # The dense weight (the same parameter), when kept: what `.weight` returns and what
        # the stock kernel reads.
        self.dense = linear.weight if keep_dense else None
        self.stock = False  # run nn.Linear's kernel on the dense weight (see stock_kernels)

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "PackedLinear":
        """A packed product by `weight` [out, in] (and `bias`) that no nn.Linear holds yet."""
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
        linear.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        return cls(linear)

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight (a fresh copy when it was not kept: read it once, not per step)."""
        return self.dense if self.dense is not None else self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stock:
            return F.linear(x, self.dense, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def packing_problem(model: nn.Module) -> str | None:
    """Why this model's linear layers cannot be packed, or None when they can."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    parameter = next(model.parameters())
    if parameter.device.type != "cpu":
        return f"it runs on {parameter.device.type}, and packing is for CPUs"
    dtypes = {child.weight.dtype for child in model.modules() if type(child) is nn.Linear}
    if not dtypes:
        return "it has no float linear layers"
    if torch.float16 in dtypes:
        return "its weights are float16, which oneDNN packs only on CPUs with float16 instructions"
    if torch.bfloat16 in dtypes and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "its weights are bfloat16 and this CPU has no bfloat16 instructions for oneDNN"
    if dtypes - {torch.float32, torch.bfloat16}:
        return f"its linear weights are {', '.join(sorted(str(d) for d in dtypes))}"
    return None


def packing_choice(setting: str, model: nn.Module) -> bool:
    """Whether `[decode] linear_kernel` packs this model: "auto" where it can, "onednn" too
    (saying in the log why it cannot when it cannot), "torch" never."""
    if setting not in CHOICES:
        raise ValueError(f"linear_kernel must be one of {', '.join(CHOICES)}, not {setting!r}")
    if setting == "torch" or is_packed(model):
        return False
    problem = packing_problem(model)
    if problem is not None:
        (log.warning if setting == "onednn" else log.debug)(
            "%s keeps torch's linear kernels: %s", type(model).__name__, problem)
    return problem is None


def is_packed(model: nn.Module) -> bool:
    """Whether `pack_linears` packed this model (so the runtime chose oneDNN for it)."""
    return any(isinstance(m, PackedLinear) for m in model.modules())


def pack_linears(model: nn.Module, keep_dense: bool = False) -> int:
    """Replace every float nn.Linear of `model` (exactly that class: quantized subclasses keep
    their own kernels) by a PackedLinear, in place; returns how many were replaced. A head
    tied to the input embedding keeps the embedding's dense weight by reference (the lookup
    needs it anyway), so `.weight` on it costs nothing."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = getattr(embedding, "weight", None)
    linears = _float_linears(model)
    for parent, name, child in linears:
        setattr(parent, name, PackedLinear(child, keep_dense or child.weight is tied))
    return len(linears)


def _float_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, layer) for every float nn.Linear of `model` (exactly that class:
    quantized subclasses keep their own kernels): what packing replaces."""
    return [(parent, name, child) for parent in list(model.modules()) for name, child in list(parent.named_children())
            if type(child) is nn.Linear and child.weight.dtype in (torch.float32, torch.bfloat16)]


@contextlib.contextmanager
def packed_while(model: nn.Module) -> Iterator[bool]:
    """Within this block the model's float linear layers run packed, when they can (yields
    whether they do); afterwards the very same nn.Linear modules are back. For a pass over
    many batches of a model that is otherwise trained from or read densely (the feature pass
    of `train`): packed products are faster at these widths too, at the cost of a packed
    copy of the weights while it runs."""
    if is_packed(model) or packing_problem(model) is not None:
        yield False
        return
    originals = _float_linears(model)
    for parent, name, child in originals:
        setattr(parent, name, PackedLinear(child, keep_dense=True))
    try:
        yield True
    finally:
        for parent, name, child in originals:
            setattr(parent, name, child)


@contextlib.contextmanager
def stock_kernels(model: nn.Module) -> Iterator[None]:
    """Within this block the model's packed layers run nn.Linear's own kernel (they must
    have kept their dense weights): transformers' generation as a user of it would run."""
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if any(m.dense is None for m in packed):
        raise ValueError("packed without keep_dense: the stock kernels have no dense weights to read")
    for module in packed:
        module.stock = True
    try:
        yield
    finally:
        for module in packed:
            module.stock = False
