"""How the kernels round the activations a quantized weight meets (BlockLinear.activations,
cpu_common.c), against numpy versions of llama.cpp's x86 quantizers: Q8_0 (codes x 127 / amax
rounded to nearest even, the scale amax / 127 stored in float16), Q8_K (one scale per 256
values: iscale = -127 / the value of largest magnitude, d = 1 / iscale) and the kernels' own
groups (a float32 scale). A weight of ones on a group reads back that group's d x sum of codes,
so each rule's codes and scales are seen exactly; and a GGUF file's matrices carry the rule
llama.cpp uses for their format."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdraft.models.kernels.block_linear import BlockLinear
from specdraft.models.kernels.native import kernel_problem
from specdraft.models.kernels.structs import ACTIVATIONS_OWN, ACTIVATIONS_Q8_0, ACTIVATIONS_Q8_K

pytestmark = pytest.mark.skipif(kernel_problem() is not None, reason=f"no CPU kernels here: {kernel_problem()}")


def group_reader(K: int, rule: int) -> BlockLinear:
    """K / 32 output columns; column g sums group g's activations (8-bit codes 1, scale 1)."""
    groups = K // 32
    codes = torch.zeros(groups, K, dtype=torch.int8)
    for g in range(groups):
        codes[g, 32 * g:32 * g + 32] = 1
    layer = BlockLinear.from_rows(codes, torch.ones(groups, groups), None)
    layer.activations = rule
    return layer


def q8_0(x: np.ndarray) -> np.ndarray:
    """Per group of 32: float16(amax / 127) x sum(rint(x x 127 / amax)), as llama.cpp's."""
    out = []
    for group in x.reshape(-1, 32).astype(np.float32):
        amax = np.float32(np.abs(group).max())
        inverse = np.float32(127) / amax if amax else np.float32(0)
        codes = np.rint(group * inverse)
        out.append(np.float32(np.float16(amax / np.float32(127))) * np.float32(codes.sum()))
    return np.array(out, dtype=np.float32)


def q8_k(x: np.ndarray) -> np.ndarray:
    """Per 256: iscale = -127 / max (max the first value of largest magnitude), each group of
    32's sum of rint(iscale x) times 1 / iscale."""
    out = []
    for block in x.reshape(-1, 256).astype(np.float32):
        largest = block[np.argmax(np.abs(block))]
        iscale = np.float32(-127) / largest
        codes = np.minimum(np.rint(block * iscale), 127)
        out += [np.float32(1) / iscale * np.float32(codes[32 * g:32 * g + 32].sum()) for g in range(8)]
    return np.array(out, dtype=np.float32)


def own(x: np.ndarray) -> np.ndarray:
    """The kernels' own groups: the scale amax / 127 in float32, codes rint(x / scale)."""
    out = []
    for group in x.reshape(-1, 32).astype(np.float32):
        scale = np.float32(np.abs(group).max()) / np.float32(127)
        out.append(scale * np.float32(np.rint(group * (np.float32(1) / scale)).sum()))
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize("rule, reference", [(ACTIVATIONS_Q8_0, q8_0), (ACTIVATIONS_Q8_K, q8_k),
                                             (ACTIVATIONS_OWN, own)])
def test_each_rule_gives_llama_cpp_s_codes_and_scales(rule, reference):
    rng = np.random.default_rng(rule)
    x = (rng.standard_normal((3, 512)) * np.exp(rng.uniform(-8, 4, (3, 1)))).astype(np.float32)
    x[1, 300] = -40.0  # a super-block whose largest value is negative
    got = group_reader(512, rule)(torch.from_numpy(x)).numpy()
    want = np.stack([reference(row) for row in x])
    np.testing.assert_array_equal(got, want)


def test_the_float16_scale_rounds_to_nearest_even_and_keeps_subnormals():
    # amax / 127 lands on float16's subnormals (below 2^-14) and between two float16 values
    x = np.zeros((2, 32), dtype=np.float32)
    x[0, :] = 127 * 3e-6
    x[1, :] = np.float32(127) * np.float32(1 + 2 ** -11)  # half-way between 1 and 1 + 2^-10: to 1
    got = group_reader(32, ACTIVATIONS_Q8_0)(torch.from_numpy(x)).numpy()[:, 0]
    np.testing.assert_array_equal(got, [np.float32(np.float16(3e-6)) * 127 * 32, np.float32(1.0) * 127 * 32])


def test_a_super_block_rule_needs_whole_super_blocks():
    layer = group_reader(96, ACTIVATIONS_Q8_K)
    with pytest.raises(ValueError, match="activation"):
        layer(torch.randn(1, 96))


def test_a_gguf_matrix_rounds_activations_as_llama_cpp_does_for_its_format():
    from test_repack import info, random_tensor

    from specdraft.models.gguf.repack import repacked
    from specdraft.models.kernels.structs import ACTIVATIONS_Q8_1

    expected = {"Q4_0": ACTIVATIONS_Q8_0, "Q5_0": ACTIVATIONS_Q8_0, "Q8_0": ACTIVATIONS_Q8_0,
                "Q4_1": ACTIVATIONS_Q8_1, "Q5_1": ACTIVATIONS_Q8_1, "Q4_K": ACTIVATIONS_Q8_K,
                "Q5_K": ACTIVATIONS_Q8_K, "Q6_K": ACTIVATIONS_Q8_K, "Q3_K": ACTIVATIONS_Q8_K}
    for type_name, rule in expected.items():
        data = random_tensor(type_name, 16, 256, seed=1)
        layer = repacked(info(type_name, 16, 256, data), data.reshape(-1))
        assert layer.activations == rule, type_name
        assert layer.subset(torch.tensor([0, 3])).activations == rule, type_name  # a head's readout keeps it
