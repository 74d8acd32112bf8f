"""transformers' own generation modes as bench configurations: greedy `generate`,
prompt-lookup generation, and assisted generation with every drafter that drafts with a
causal LM, on the same prompts in the same run as specdraft.

`--baseline transformers` runs them on the target's stock linear kernels, as transformers
runs for its users, even where specdraft packs them. `--baseline transformers-packed` runs
the same generation over specdraft's packed target: what is left of specdraft's lead there
is the speculation's, not the kernel's. A GGUF target that specdraft runs on the file's own
quantization is, for transformers, the file dequantized into float32 (what its users get):
that model is loaded beside it for these baselines."""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch

from specdraft.profile import Profile
from specdraft.core.stopwatch import device_clock
from specdraft.measurement.benchmark import Config, Sample, same_text_as
from specdraft.measurement.datasets import Example
from specdraft.models.kernels.block_linear import runs_on_file_quantization
from specdraft.models.loading import load_model
from specdraft.models.kernels.packed_linear import is_packed, pack_linears, packing_problem, stock_kernels
from specdraft.runtime import Runtime
from specdraft.session.prompt_ids import prompt_token_ids


log = logging.getLogger("specdraft")


def transformers_configs(profile: Profile, runtime: Runtime, chat: bool | None, packed: bool = False) -> list[Config]:
    """transformers' greedy `generate`, assisted generation with each model drafter, and
    prompt lookup, on the same prompts in the same run; `packed`: over the packed target
    (labels end in " [packed]"), else on the stock kernels."""
    model = _transformers_model(profile, runtime, packed)
    if packed and not is_packed(model):
        log.warning("--baseline transformers-packed: this target is not packed (see [decode] linear_kernel), "
                    "so it runs the same kernels as --baseline transformers")
    k = profile.decode.draft_tokens
    suffix = " [packed]" if packed else ""
    configs = [_hf_config("transformers greedy" + suffix, runtime, model, {}, chat, packed),
               _hf_config("transformers prompt-lookup" + suffix, runtime, model, {"prompt_lookup_num_tokens": k}, chat,
                          packed)]
    for drafter in runtime.drafters:
        if drafter.causal_lm is not None:  # any drafter that drafts with a causal LM can assist generate()
            configs.append(_hf_config(f"transformers assisted:{drafter.name}{suffix}", runtime, model,
                                      {"assistant_model": drafter.causal_lm, "num_assistant_tokens": k,
                                       "num_assistant_tokens_schedule": "constant"}, chat, packed))
    return configs


def _transformers_model(profile: Profile, runtime: Runtime, packed: bool) -> torch.nn.Module:
    """The target as transformers runs it: specdraft's own, or for a target on its file's
    quantization the float32 dequantization transformers makes of the file (loaded once)."""
    model = runtime.target.model
    if not runs_on_file_quantization(model):
        return model
    floats = runtime.models.get("transformers-float")
    if floats is None:
        spec = dataclasses.replace(profile.target, quantization="none", dtype="float32")
        floats = runtime.models["transformers-float"] = load_model(spec, str(profile.file), "target").model
    if packed and not is_packed(floats) and packing_problem(floats) is None:
        pack_linears(floats, keep_dense=True)
    return floats


def _hf_config(label: str, runtime: Runtime, model: torch.nn.Module, kwargs: dict, chat: bool | None,
               packed: bool) -> Config:
    tokenizer = runtime.tokenizer
    max_new = runtime.profile.decode.max_new_tokens
    # the file dequantized is another model than the target as run: compared as text, like a peer
    peer = model is not runtime.target.model

    @torch.inference_mode()
    def run(example: Example) -> Sample:
        ids = prompt_token_ids(tokenizer, example.prompt, chat)
        inputs = torch.tensor([ids], device=runtime.engine.target.device)
        clock = device_clock(inputs.device)
        with contextlib.nullcontext() if packed else stock_kernels(model):
            start = clock()
            out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_new,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                                 **kwargs)
            elapsed = clock() - start
        new = out[0, len(ids):].tolist()
        return Sample(example.id, example.task, label, 0, len(new), 0, elapsed, ids=new, peer=peer)

    return Config(label, run, same_text=same_text_as(tokenizer) if peer else None)
