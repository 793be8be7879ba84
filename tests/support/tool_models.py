"""Tiny models whose tokenizers and chat templates fit parsers vLLM ships, written
locally with no download (vLLM serves them with dummy weights, as the tiny model).

- `thinking_model`: the tiny model (byte-level BPE) with `<think>` and
  `</think>` as tokens of their own, for the reasoning parsers (deepseek_r1,
  deepseek_v3) and the pythonic tool-call parser (which reads plain text).
- `hermes_model`: a SentencePiece-style tokenizer (Metaspace `▁` for spaces,
  byte fallback `<0xE2>` for characters it lacks, the first token's space
  stripped when decoded alone, as Llama 2's and Mistral's) with `<think>`,
  `</think>`, `<tool_call>` and `</tool_call>` as tokens of their own, and a chat
  template that lays out tools as Hermes and Qwen 2.5 models do: what vLLM's
  `hermes` tool-call parser reads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from vllm_servicer.testing import tiny_model
from vllm_servicer.testing.tiny_model import ensure_tiny_model

THINK = ["<think>", "</think>"]
HERMES_POSITIONS = 1024
"""The hermes model's context (the tiny model's is 512)."""
TOOL_CALL = ["<tool_call>", "</tool_call>"]

# Qwen 2.5's layout of tools and calls (its template, without what the tests
# do not send: tool messages and assistant calls), the one vLLM's hermes
# parser is written for.
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments \
within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}{% if message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if thinking is defined and thinking %}<think>
{% endif %}{% endif %}"""


def _grow_vocabulary(directory: Path, tokenizer: Any) -> None:
    """The model's config.json with `tokenizer`'s whole vocabulary."""
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["vocab_size"] = len(tokenizer)
    config_path.write_text(json.dumps(config, indent=2))


def _add_tokens(tokenizer: Any, tokens: list[str], special: bool) -> None:
    """`tokens` as tokens of their own: special ones, or added ones that are
    not special, as DeepSeek-R1's `<think>` and Qwen 2.5's `<tool_call>` (a
    grammar can then write them: xgrammar never allows a special token but
    the EOS)."""
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    else:
        tokenizer.add_tokens(tokens)


def thinking_model(directory: Path, *, special: bool = True) -> Path:
    """The tiny model with `<think>` and `</think>` as tokens of their own (what a
    reasoning parser looks for), special ones or not, its vocabulary grown to match."""
    from transformers import AutoTokenizer

    shutil.copytree(ensure_tiny_model(), directory, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    _add_tokens(tokenizer, THINK, special)
    tokenizer.save_pretrained(directory)
    _grow_vocabulary(directory, tokenizer)
    return directory


def _sentencepiece_tokenizer() -> Any:
    """A BPE tokenizer as SentencePiece's are converted (Llama 2's tokenizer.json):
    `▁` for a space, one before the first word, byte fallback for what the
    vocabulary lacks, and decoding that strips the first token's space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{value:02X}>" for value in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        min_frequency=2,
        special_tokens=specials,
        show_progress=False,
    )
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    corpus = [*tiny_model._CORPUS, "Paris is sunny."]
    trained.train_from_iterator(corpus * 4, trainer=trainer)
    learned = json.loads(trained.to_str())["model"]
    # The byte tokens right after the special ones, as SentencePiece lays them out.
    vocab = {token: index for index, token in enumerate(specials + byte_tokens)}
    for token, _ in sorted(learned["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(token, len(vocab))
    # tokenizers writes a merge as "a b" or, in newer releases, as ["a", "b"].
    pairs = [m.split(" ") if isinstance(m, str) else m for m in learned["merges"]]
    merges = [(str(left), str(right)) for left, right in pairs]
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True)
    )
    tokenizer.add_special_tokens(specials)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    return tokenizer


def hermes_model(directory: Path, *, special: bool = True) -> Path:
    """The tiny Llama with a SentencePiece-style tokenizer and a Hermes chat
    template (`HERMES_TEMPLATE`), `<think>`, `</think>`, `<tool_call>` and
    `</tool_call>` tokens of their own, special ones or not."""
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(ensure_tiny_model(), directory, dirs_exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (directory / name).unlink(missing_ok=True)
    tokenizer_cls: Any = PreTrainedTokenizerFast
    tokenizer = tokenizer_cls(
        tokenizer_object=_sentencepiece_tokenizer(),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<unk>",
        clean_up_tokenization_spaces=False,
        chat_template=HERMES_TEMPLATE,
        model_max_length=HERMES_POSITIONS,
    )
    _add_tokens(tokenizer, THINK + TOOL_CALL, special)
    tokenizer.save_pretrained(directory)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    ids = tokenizer.convert_tokens_to_ids(["<unk>", "<s>", "</s>"])
    config |= {"pad_token_id": ids[0], "bos_token_id": ids[1], "eos_token_id": ids[2]}
    # Byte fallback spells what the small vocabulary lacks a byte a token: the
    # Hermes tools prompt alone takes most of the tiny model's 512 positions.
    config["max_position_embeddings"] = HERMES_POSITIONS
    config_path.write_text(json.dumps(config, indent=2))
    generation_path = directory / "generation_config.json"
    generation = json.loads(generation_path.read_text())
    generation |= {"pad_token_id": ids[0], "bos_token_id": ids[1], "eos_token_id": ids[2]}
    generation_path.write_text(json.dumps(generation, indent=2))
    _grow_vocabulary(directory, tokenizer)
    return directory
