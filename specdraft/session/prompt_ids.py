"""A prompt as the token ids the models read: the chat template, and the models' context.

A prompt that cannot fit the smallest context of the target and the model drafters with
its generation budget is refused (UsageError, exit 2) before any decoding, or cut to its
end with `truncate=True`; a dataset's prompts are all checked before the first is decoded.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Iterable

from specdraft.errors import UsageError
from specdraft.runtime import Runtime


@dataclass(frozen=True)
class ChatFrame:
    """What comes before the prompt in a chat: a system message (None: the template's own
    default, if it has one) and the earlier turns as (role, text) pairs."""

    system: str | None = None
    turns: tuple[tuple[str, str], ...] = ()

    def messages(self, prompt: str) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        return [*system, *({"role": r, "content": t} for r, t in self.turns), {"role": "user", "content": prompt}]


NO_FRAME = ChatFrame()


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


@dataclass(frozen=True)
class ContextLimit:
    """The positions a prompt and its generation may use: the smallest context of the
    target and every drafter that runs a model of its own (`model` = which one)."""

    positions: int
    model: str
    max_new_tokens: int

    @property
    def prompt_budget(self) -> int:
        return self.positions - self.max_new_tokens


def context_limit(runtime: Runtime) -> ContextLimit | None:
    """None when no model states its context length (config.max_position_embeddings)."""
    models = [("the target", runtime.target.model)]
    models += [(f'drafter "{d.name}"', d.causal_lm) for d in runtime.drafters if d.causal_lm is not None]
    limits = [(n, who) for who, model in models if (n := _max_positions(model)) is not None]
    if not limits:
        return None
    positions, who = min(limits, key=lambda item: item[0])
    return ContextLimit(positions, who, runtime.profile.decode.max_new_tokens)


def check_budget(limit: ContextLimit | None) -> None:
    """max_new_tokens alone must leave room for a prompt: checked once, before any prompt."""
    if limit is not None and limit.prompt_budget < 1:
        raise UsageError(f"max_new_tokens {limit.max_new_tokens} leaves no room for a prompt in {limit.model}'s "
                         f"context of {limit.positions} tokens (config.max_position_embeddings); lower --max-new-tokens")


def fitted_prompt_ids(tokenizer: Any, prompt: str, chat: bool | None, limit: ContextLimit | None,
                      truncate: bool = False, frame: ChatFrame = NO_FRAME) -> tuple[list[int], int]:
    """(token ids, characters dropped from the front); refuses a prompt that does not fit
    unless `truncate`. A prompt far longer in characters than the context could hold in
    tokens is refused before tokenizing (a 10 MB line would otherwise take seconds and
    gigabytes)."""
    if limit is None:
        return prompt_token_ids(tokenizer, prompt, chat, frame), 0
    check_budget(limit)
    budget = limit.prompt_budget
    # No token covers more characters than the longest vocabulary entry; twice that bounds
    # what normalization can merge, so beyond this many characters the prompt cannot fit.
    max_chars = budget * 2 * _max_token_chars(tokenizer)
    if len(prompt) > max_chars and not truncate:
        raise UsageError(_too_long(f"{len(prompt)} characters", limit))
    text = prompt[-max_chars:]
    ids = prompt_token_ids(tokenizer, text, chat, frame)
    if len(ids) > budget:
        if not truncate:
            raise UsageError(_too_long(f"{len(ids)} tokens", limit, len(ids)))
        ids, text = _truncated(tokenizer, text, chat, budget, limit, frame)
    return ids, len(prompt) - len(text)


def _truncated(tokenizer: Any, prompt: str, chat: bool | None, budget: int,
               limit: ContextLimit, frame: ChatFrame = NO_FRAME) -> tuple[list[int], str]:
    """Keep the end of the prompt: cut its content tokens from the front (the chat template
    and special tokens stay), re-encode, and tighten until it fits."""
    full = prompt_token_ids(tokenizer, prompt, chat, frame)
    content = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    overhead = max(0, len(full) - len(content))
    for _ in range(8):
        keep = budget - overhead
        if keep < 1:
            break
        text = tokenizer.decode(content[-keep:], skip_special_tokens=False).lstrip("\ufffd")
        if text.strip():
            ids = prompt_token_ids(tokenizer, text, chat, frame)
            if len(ids) <= budget:
                return ids, text
            overhead += len(ids) - budget
        else:
            overhead += 1
    raise UsageError(f"the prompt is {len(full)} tokens and cannot be truncated to fit {limit.model}'s context of "
                     f"{limit.positions} tokens with max_new_tokens {limit.max_new_tokens}")


def _too_long(size: str, limit: ContextLimit, tokens: int | None = None) -> str:
    need = f"{tokens} + max_new_tokens {limit.max_new_tokens} = {tokens + limit.max_new_tokens} positions" \
        if tokens is not None else f"with max_new_tokens {limit.max_new_tokens} it cannot fit"
    return (f"the prompt is {size} ({need}), more than {limit.model}'s context of {limit.positions} tokens "
            f"(config.max_position_embeddings); shorten it, lower --max-new-tokens or pass --truncate")


def _max_positions(model: Any) -> int | None:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    value = getattr(config, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


_TOKEN_CHARS: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def _max_token_chars(tokenizer: Any) -> int:
    try:
        return _TOKEN_CHARS[tokenizer]
    except (KeyError, TypeError):
        pass
    try:
        longest = max((len(t) for t in tokenizer.get_vocab()), default=16)
    except Exception:  # a tokenizer without a readable vocabulary: a generous guess
        longest = 64
    try:
        _TOKEN_CHARS[tokenizer] = longest
    except TypeError:
        pass
    return longest


def prompt_token_ids(tokenizer: Any, prompt: str, chat: bool | None, frame: ChatFrame = NO_FRAME) -> list[int]:
    """Token ids for `prompt` after `frame`; chat=None uses the chat template when the
    tokenizer has one."""
    if not prompt.strip():
        raise UsageError("the prompt is empty")
    if chat is None:
        chat = has_chat_template(tokenizer)
    if not chat and frame != NO_FRAME:
        raise UsageError("a system message and earlier turns need the chat template (--chat), not --raw")
    if chat:
        if not has_chat_template(tokenizer):
            raise UsageError("--chat: this tokenizer has no chat template; use --raw")
        ids = tokenizer.apply_chat_template(
            frame.messages(prompt), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        ids = ids["input_ids"] if isinstance(ids, dict) else ids
    else:
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if not ids:
        raise UsageError("the prompt tokenizes to nothing")
    return list(ids)


def check_prompts(runtime: Runtime, prompts: Iterable[tuple[str, str]], chat: bool | None, source: str) -> None:
    """Every (id, prompt) of a dataset fits the context, checked before the first is decoded:
    a batch run must not stop halfway on its one overlong prompt."""
    limit = context_limit(runtime)
    check_budget(limit)
    for ident, prompt in prompts:
        try:
            fitted_prompt_ids(runtime.tokenizer, prompt, chat, limit)
        except UsageError as exc:
            raise UsageError(f"{source}: prompt {ident}: {exc}") from None
