"""Tiny random models and a byte-level tokenizer, built in memory for the tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB = 64


def tiny_llama(seed: int = 0, vocab: int = VOCAB, layers: int = 3, hidden: int = 32, scale: float = 1.0) -> LlamaForCausalLM:
    """A float64 llama; float64 so a 1-token and a K-token forward agree on every argmax."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.float64)
    if scale != 1.0:  # sharper logits: sampled text becomes more predictable
        with torch.no_grad():
            model.lm_head.weight.mul_(scale)
    return model.eval()


def plain_greedy(model: torch.nn.Module, prompt: list[int], max_new: int, eos: int | None = None) -> list[int]:
    """Reference decoding with no cache at all: a full forward per token, on the model's device."""
    ids = list(prompt)
    out: list[int] = []
    device = next(model.parameters()).device
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(torch.tensor([ids], device=device)).logits[0, -1]
            token = int(logits.argmax())
            out.append(token)
            ids.append(token)
            if token == eos:
                break
    return out


def byte_tokenizer(chat: bool = True) -> PreTrainedTokenizerFast:
    """A real fast tokenizer over 256 byte tokens plus specials (ids 256..258)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    byte_vocab = {ch: i for i, ch in enumerate(sorted(byte_vocab))}
    tok = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    if chat:
        fast.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    return fast


def save_tiny_pair(folder: Path, seed: int = 0, layers: int = 3) -> Path:
    """A tiny model that speaks the byte tokenizer, saved like a real checkpoint."""
    tok = byte_tokenizer()
    model = tiny_llama(seed=seed, vocab=len(tok), layers=layers)
    model.config.eos_token_id = tok.eos_token_id
    model.config.bos_token_id = tok.bos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def random_head(target: torch.nn.Module, vocab_ids: list[int] | None = None, seed: int = 3,
                lower_layers: tuple[int, ...] = ()):
    """A draft head for `target` with random weights large enough that its drafts vary
    with the context; over `vocab_ids` (default: the whole vocabulary), reading the target's
    hidden states after `lower_layers` besides the final feature."""
    from specdraft.drafters.head_model import DraftHead, HeadConfig

    torch.manual_seed(seed)
    ids = torch.arange(target.config.vocab_size) if vocab_ids is None else torch.tensor(vocab_ids)
    head = DraftHead(HeadConfig.for_target(target, len(ids), lower_layers))
    head.vocab_ids = ids.clone()
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return head
