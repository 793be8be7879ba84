"""Render's budgets on vLLM's `/tokenize` and `/detokenize`, checked on the
parsed body before vLLM's handler runs.

vLLM's handlers take any body the size limit lets through (32 MiB by default)
and tokenize or decode it whole on the one tokenizer thread every caller
shares: a 24 MB `/tokenize` held it for 38 s. gRPC's Render bounds the same
work (`RequestBudgets`): `/tokenize`'s prompt or chat by `--max-render-chars`
and `--max-render-items` as RenderCompletion's and RenderChat's,
`/detokenize`'s token ids by `--max-derender-tokens` as DerenderCompletion's.
The scale-out routes' abort (`/inference/v1/abort_requests`, `/abort_requests`)
takes at most `--max-abort-ids` ids, as gRPC's Abort does.
A body past one is refused 400 in vLLM's error shape, naming the field and
the flag, as gRPC's INVALID_ARGUMENT names them.

How they are counted, as Render counts:

- a prompt: its characters; several prompts (a list) each an item;
- a chat: its messages, each message's content parts and tool calls, and the
  tools, as items; as characters, every string of the messages, the tools and
  the template with its arguments, but media (`image_url`, `input_audio`,
  ...), which vLLM's own media limits bound as they bound a chat's;
- `/detokenize`: its token ids.

Each of these is at most the body's size in bytes (a character takes a byte
at least, an item or a token id two), so a body no larger than the smallest
budget that applies is not parsed for them at all.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..budgets import RequestBudgets

__all__ = ["check", "may_pass"]

_TOKENIZE = "/tokenize"
_DETOKENIZE = "/detokenize"
_ABORTS = ("/inference/v1/abort_requests", "/abort_requests")

# A chat's fields the template lays out besides its messages (the tools are
# counted as items too).
_CHAT_TEXT_FIELDS = ("tools", "chat_template", "chat_template_kwargs")


def may_pass(path: str, size: int, budgets: RequestBudgets) -> bool:
    """Whether a body of `size` bytes to `path` could pass a budget here (else
    it need not be parsed for them)."""
    if path == _TOKENIZE:
        return size > min(budgets.max_render_chars, budgets.max_render_items)
    if path == _DETOKENIZE:
        return size > budgets.max_derender_tokens
    if path in _ABORTS:
        return size > budgets.max_abort_ids  # an id takes three bytes at least
    return False


def check(path: str, data: object, budgets: RequestBudgets) -> None:
    """Refuse the parsed body `data` to `path` when it passes a budget (a
    malformed body is vLLM's to answer).

    Raises:
        InvalidRequestError: naming the field and the flag.
    """
    if not isinstance(data, dict):
        return
    if path == _TOKENIZE:
        _check_tokenize(data, budgets)
    elif path == _DETOKENIZE:
        tokens = data.get("tokens")
        if isinstance(tokens, list):
            budgets.check_derender_tokens("tokens", len(tokens))
    elif path in _ABORTS:
        ids = data.get("request_ids")
        if isinstance(ids, list):
            budgets.check_abort_ids("request_ids", [str(i) for i in ids])


def _check_tokenize(data: Mapping[str, object], budgets: RequestBudgets) -> None:
    messages = data.get("messages")
    if isinstance(messages, list):
        budgets.check_render_items("messages", _chat_items(messages, data.get("tools")))
        texts = [messages, *(data.get(name) for name in _CHAT_TEXT_FIELDS)]
        budgets.check_render_chars("messages", _characters(texts))
        return
    prompt = data.get("prompt")
    if isinstance(prompt, list):
        budgets.check_render_items("prompt", len(prompt))
    if prompt is not None:
        budgets.check_render_chars("prompt", _characters(prompt))


def _chat_items(messages: list[object], tools: object) -> int:
    """What a chat asks the template to lay out: messages, parts, tool calls, tools."""
    items = len(messages) + (len(tools) if isinstance(tools, list) else 0)
    for message in messages:
        if not isinstance(message, dict):
            continue
        for field in ("content", "tool_calls"):
            value = message.get(field)
            if isinstance(value, list):
                items += len(value)
    return items


def _media(key: str) -> bool:
    """A content part's media payload (`image_url`, `audio_url`, `input_audio`, ...)."""
    return key.endswith("_url") or key.startswith("input_") or key.endswith("_embeds")


def _characters(value: object) -> int:
    """The characters of every string in `value` (keys included), media payloads
    left out; iterative, so a deeply nested body costs no recursion."""
    count = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            count += len(item)
        elif isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str):
                    if _media(key):
                        continue
                    count += len(key)
                stack.append(child)
        elif isinstance(item, list):
            stack.extend(item)
    return count
