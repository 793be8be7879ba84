"""A tiny Llama model directory that a real vLLM engine can run with no download.

The directory holds only ``config.json``, ``generation_config.json`` and tokenizer
files; vLLM runs it with ``load_format="dummy"`` (seeded random weights), so the same
prompt at temperature 0 gives the same tokens in every run and every process. The
text is gibberish, but token ids, finish reasons, logprobs, stop handling, seeds,
structured output and pooling are all the real engine's.

Typical use in a test suite::

    from vllm_servicer.testing.tiny_model import build_tiny_engine

    engine = build_tiny_engine()  # AsyncLLM with TINY_ENGINE_KWARGS and the CPU env

``AsyncLLM`` starts its engine processes with the spawn method, so a script that
builds one needs an ``if __name__ == "__main__":`` guard, and must call
``engine.shutdown()`` when done.

Only the standard library is imported at module load; ``tokenizers`` and
``transformers`` (both vLLM dependencies) are imported when a model is written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final, Literal

__all__ = [
    "TINY_CLASSIFY_ENGINE_KWARGS",
    "TINY_EMBED_ENGINE_KWARGS",
    "TINY_ENGINE_KWARGS",
    "tiny_engine_flags",
    "TINY_MODEL_VERSION",
    "apply_cpu_env_defaults",
    "default_classifier_model_dir",
    "default_embedding_model_dir",
    "default_model_dir",
    "ensure_tiny_classifier_model",
    "ensure_tiny_embedding_model",
    "ensure_tiny_model",
    "write_tiny_classifier_model",
    "write_tiny_embedding_model",
    "write_tiny_model",
]

TINY_MODEL_VERSION: Final = "3"
"""Bumped whenever the written files change; older directories are rewritten."""

TINY_ENGINE_KWARGS: Final[dict[str, Any]] = {
    # No weights on disk: vLLM fills the parameters from a seeded generator.
    "load_format": "dummy",
    "dtype": "float32",
    # CUDA graphs / torch.compile buy nothing on CPU and slow start-up.
    "enforce_eager": True,
    # On the CPU backend this is the share of host RAM reserved; the default
    # 0.92 fails at start-up on a shared machine.
    "gpu_memory_utilization": 0.2,
    "max_model_len": 512,
    "seed": 0,
    # Keeps batch shapes, and so start-up and memory, small.
    "max_num_seqs": 64,
    # 256 MiB of host RAM for the KV cache: about 262,000 tokens of this model,
    # eight times what 64 sequences of 512 tokens can hold. vLLM's CPU default
    # (4 GiB) is more than a shared machine should give a toy model, and an
    # explicit size also skips the start-up warm-up that sizes the cache.
    "kv_cache_memory_bytes": 256 * 2**20,
    # Whole prompts only: on vLLM 0.31 to 0.33 a split prompt's seeded draw kills
    # a CPU engine (vllm_releases.seeded_sampling_hazard); measured at no
    # throughput cost here, and one setting for every release keeps runs alike.
    "enable_chunked_prefill": False,
}
"""``AsyncEngineArgs`` keyword arguments that start the tiny model on a CPU machine.

Use with :func:`apply_cpu_env_defaults` (``TOKENIZERS_PARALLELISM=false``) set before the
engine is built: ``AsyncEngineArgs(model=str(ensure_tiny_model()), **TINY_ENGINE_KWARGS)``.
"""


def tiny_engine_flags(settings: Mapping[str, Any] = TINY_ENGINE_KWARGS) -> list[str]:
    """Engine keyword arguments (TINY_ENGINE_KWARGS unless given) as the launcher's
    (vLLM's) command-line flags."""
    flags = []
    for key, value in settings.items():
        flag = key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            flags.append(f"--{flag}={value}")
    return flags


TINY_EMBED_ENGINE_KWARGS: Final[dict[str, Any]] = {
    **TINY_ENGINE_KWARGS,
    # Serve the causal LM as a pooling model: AsyncLLM.encode(..., PoolingParams(task="embed")).
    "runner": "pooling",
    "convert": "embed",
}
"""``AsyncEngineArgs`` keyword arguments that serve the tiny model as an embedding model."""

TINY_CLASSIFY_ENGINE_KWARGS: Final[dict[str, Any]] = {
    **TINY_ENGINE_KWARGS,
    # LlamaForSequenceClassification is vLLM's causal LM with a score head
    # (pooling the last token); one label makes it a cross-encoder too.
    "runner": "pooling",
}
"""``AsyncEngineArgs`` keyword arguments that serve :func:`write_tiny_classifier_model`'s
directory: classification, scoring and reranking."""

_CPU_ENV_DEFAULTS: Final[dict[str, str]] = {
    # The tokenizer is used both before and after vLLM forks/spawns workers.
    "TOKENIZERS_PARALLELISM": "false",
}

_MARKER_NAME: Final = ".vllm_servicer_tiny_model.json"
_CACHE_ENV: Final = "VLLM_SERVICER_CACHE"

_Kind = Literal["generate", "embed", "classify", "vision", "weighted", "weighted-classify"]

_PAD, _BOS, _EOS = "<pad>", "<s>", "</s>"
_VOCAB_TARGET: Final = 320
_MAX_LEN: Final = 512

# Built-in training text: plain English, digits, JSON and code-ish punctuation, so
# common strings (including "yes"/"no" and JSON syntax) get a few merged tokens.
_CORPUS: Final[tuple[str, ...]] = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I am fine, thank you.",
    "yes no yes no maybe yes no true false null",
    "Answer yes or no. The answer is yes. The answer is no.",
    '{"name": "tiny", "value": 42, "ok": true, "items": [1, 2, 3]}',
    '{"answer": "yes", "score": 0.5, "tags": ["a", "b"], "next": null}',
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 32 64 128 256 512 1024",
    "def main():\n    print('hello')\n    return 0\n",
    "A server streams tokens to a client over a channel, one message at a time.",
    "The engine generates text from a prompt and stops at the end of sequence.",
    "Once upon a time there was a small model that could only say a few words.",
    "Requests, responses, errors and metadata travel between the two sides.",
    "The cat sat on the mat. The dog sat on the log. The bird sang in the tree.",
    "Monday Tuesday Wednesday Thursday Friday Saturday Sunday",
    "red green blue yellow black white orange purple",
    "What is the capital of France? Paris is the capital of France.",
    "Please summarize the following text in one sentence.",
    "This is a test. This is only a test. Testing, testing, one two three.",
)


CHAT_TEMPLATE: Final = (
    "{{- bos_token }}"
    "{%- if tools %}{{ '<|tools|>' + (tools | tojson) + '\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|' + message['role'] + '|>' }}"
    "{%- if message['content'] is string %}{{ message['content'] }}"
    "{%- elif message['content'] %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{ part['text'] }}{%- else %}<image>{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{{- '<|call|>' + call['function']['name'] + ' ' }}"
    "{%- if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{%- else %}{{ call['function']['arguments'] | tojson }}{%- endif %}"
    "{%- endfor %}"
    "{{- eos_token + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>' }}{%- endif %}"
)
"""The tiny models' chat template: roles, text, tool definitions and calls, a
generation prompt, an image as `<image>` (the tiny LLaVA's placeholder); what a real
model's template does, in a few lines."""


def apply_cpu_env_defaults() -> dict[str, str]:
    """Sets the environment variables vLLM's CPU backend needs, unless already set.

    Must run before the engine is built (its child processes inherit the
    environment). Values the caller already set are left alone.

    Returns:
        The variables this function covers, with the values now in effect.
    """
    return {name: os.environ.setdefault(name, value) for name, value in _CPU_ENV_DEFAULTS.items()}


def default_model_dir() -> Path:
    """Returns where :func:`ensure_tiny_model` keeps the tiny generation model.

    ``$VLLM_SERVICER_CACHE/tiny-llama`` if that variable is set, else
    ``$XDG_CACHE_HOME/vllm_servicer/tiny-llama`` (``~/.cache`` by default).
    """
    return _cache_root() / "tiny-llama"


def default_embedding_model_dir() -> Path:
    """Returns where :func:`ensure_tiny_embedding_model` keeps the tiny embedding model."""
    return _cache_root() / "tiny-llama-embed"


def default_classifier_model_dir() -> Path:
    """Returns where :func:`ensure_tiny_classifier_model` keeps the tiny cross-encoder."""
    return _cache_root() / "tiny-llama-classify"


def build_tiny_engine(model_dir: str | os.PathLike[str] | None = None, **overrides: Any) -> Any:
    """A real vLLM ``AsyncLLM`` on the tiny model, with the CPU settings applied.

    Args:
        model_dir: a directory from :func:`write_tiny_model` (or the embedding
            variant); default :func:`ensure_tiny_model`.
        overrides: ``AsyncEngineArgs`` fields that replace :data:`TINY_ENGINE_KWARGS`.

    Call ``engine.shutdown()`` when done; the caller needs a ``__main__`` guard
    (vLLM spawns its engine processes).
    """
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    apply_cpu_env_defaults()
    model = str(model_dir if model_dir is not None else ensure_tiny_model())
    return AsyncLLM.from_engine_args(
        AsyncEngineArgs(model=model, **{**TINY_ENGINE_KWARGS, **overrides})
    )


def ensure_tiny_model() -> Path:
    """Writes the tiny generation model to :func:`default_model_dir` if missing.

    Returns:
        The model directory, ready to pass as ``AsyncEngineArgs(model=...)``.
    """
    return write_tiny_model(default_model_dir())


def ensure_tiny_embedding_model() -> Path:
    """Writes the tiny embedding model to :func:`default_embedding_model_dir` if missing.

    Returns:
        The model directory, to serve with :data:`TINY_EMBED_ENGINE_KWARGS`.
    """
    return write_tiny_embedding_model(default_embedding_model_dir())


def ensure_tiny_classifier_model() -> Path:
    """Writes the tiny cross-encoder to :func:`default_classifier_model_dir` if missing.

    Returns:
        The model directory, to serve with :data:`TINY_CLASSIFY_ENGINE_KWARGS`.
    """
    return write_tiny_classifier_model(default_classifier_model_dir())


def write_tiny_model(path: str | os.PathLike[str]) -> Path:
    """Writes a tiny Llama causal-LM model directory, without any network access.

    The directory holds ``config.json`` (``LlamaForCausalLM``: hidden size 128,
    2 layers, 2 heads of dim 64, 1 KV head, 512 positions, float32),
    ``generation_config.json`` (temperature 0.7, top_p 0.9, top_k 20) and a
    byte-level BPE tokenizer of about 320 tokens trained on a built-in corpus
    (``<pad>`` = 0, ``<s>`` = 1, ``</s>`` = 2; encoding adds ``<s>``). There are
    no weights: serve it with ``load_format="dummy"`` (see
    :data:`TINY_ENGINE_KWARGS`).

    The output is deterministic. If ``path`` already holds a model written by
    this version of the function it is returned untouched; an older version's
    directory is replaced. The files are written to a temporary sibling
    directory and renamed into place, so concurrent callers never see a
    partial model.

    Args:
        path: The model directory to create. Its parent is created if needed.

    Returns:
        ``path`` as an absolute :class:`~pathlib.Path`.

    Raises:
        FileExistsError: ``path`` exists, is not empty and was not written by
            this module.
    """
    return _write(Path(path), "generate")


def write_tiny_embedding_model(path: str | os.PathLike[str]) -> Path:
    """Writes the tiny model directory for use as an embedding (pooling) model.

    The files are those of :func:`write_tiny_model` (vLLM turns the causal LM
    into an embedding model with ``runner="pooling", convert="embed"``; see
    :data:`TINY_EMBED_ENGINE_KWARGS`); embeddings have 128 dimensions. The
    directory is marked as an embedding model, so keep it apart from the
    generation model's.

    Args:
        path: The model directory to create. Its parent is created if needed.

    Returns:
        ``path`` as an absolute :class:`~pathlib.Path`.

    Raises:
        FileExistsError: ``path`` exists, is not empty and was not written by
            this module.
    """
    return _write(Path(path), "embed")


def write_tiny_classifier_model(path: str | os.PathLike[str]) -> Path:
    """Writes a tiny sequence classifier with one label: a cross-encoder.

    The tokenizer and body are :func:`write_tiny_model`'s; ``config.json``
    names ``LlamaForSequenceClassification`` with one label, ``relevant``.
    vLLM serves it (:data:`TINY_CLASSIFY_ENGINE_KWARGS`) for classification
    (one probability per text) and, having one label, for scoring and
    reranking text pairs (the tokenizer joins a pair as ``<s> A <s> B``).
    Its weights are seeded random numbers, as the other tiny models'.

    Args:
        path: The model directory to create. Its parent is created if needed.

    Returns:
        ``path`` as an absolute :class:`~pathlib.Path`.

    Raises:
        FileExistsError: ``path`` exists, is not empty and was not written by
            this module.
    """
    return _write(Path(path), "classify")


def _cache_root() -> Path:
    explicit = os.environ.get(_CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "vllm_servicer"


def _marker(kind: _Kind) -> dict[str, str]:
    return {
        # The writer's name as directories already written carry it.
        "writer": "vllm_servicer.tiny_model",
        "version": TINY_MODEL_VERSION,
        "kind": kind,
    }


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((path / _MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write(path: Path, kind: _Kind, populate: Callable[[Path, _Kind], None] | None = None) -> Path:
    path = path.expanduser().absolute()
    if _read_marker(path) == _marker(kind):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        (populate or _populate)(tmp, kind)
        # A few rounds: another process may be swapping the directory at the same time.
        for _ in range(5):
            try:
                # Atomic; succeeds when path is missing or an empty directory.
                os.rename(tmp, path)
                return path
            except OSError:
                if not path.exists():
                    continue
            found = _read_marker(path)
            if found == _marker(kind):
                return path  # Another process won the race.
            if found is None or found.get("writer") != _marker(kind)["writer"]:
                raise FileExistsError(
                    f"{path} exists and was not written by vllm_servicer's tiny model writer; "
                    "refusing to replace it"
                )
            # Ours, but another version or kind: move it aside, then retry.
            stale = path.with_name(f".{path.name}.stale-{uuid.uuid4().hex}")
            try:
                os.rename(path, stale)
            except FileNotFoundError:
                continue
            shutil.rmtree(stale, ignore_errors=True)
        raise OSError(f"could not move the tiny model into place at {path}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# The config's changes for the tiny cross-encoder: vLLM's causal LM with a
# one-label score head.
_CLASSIFIER_CONFIG: Final[dict[str, Any]] = {
    "architectures": ["LlamaForSequenceClassification"],
    "num_labels": 1,
    "id2label": {"0": "relevant"},
    "label2id": {"relevant": 0},
}


def _populate(directory: Path, kind: _Kind) -> None:
    hf_tokenizer = _hf_tokenizer()
    hf_tokenizer.save_pretrained(str(directory))
    config = _text_config(hf_tokenizer)
    if kind == "classify":
        config.update(_CLASSIFIER_CONFIG)
    _write_json(directory / "config.json", config)
    _write_json(directory / "generation_config.json", _generation_config(config))
    _finish(directory, kind)


def _hf_tokenizer() -> Any:
    """The tiny byte-level BPE tokenizer as a transformers fast tokenizer."""
    from transformers import PreTrainedTokenizerFast

    # Typed as Any: transformers' constructor is untyped in some versions.
    tokenizer_cls: Any = PreTrainedTokenizerFast
    return tokenizer_cls(
        tokenizer_object=_train_tokenizer(),
        bos_token=_BOS,
        eos_token=_EOS,
        pad_token=_PAD,
        model_max_length=_MAX_LEN,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )


def _text_config(hf_tokenizer: Any) -> dict[str, Any]:
    """The tiny Llama's config.json for `hf_tokenizer`'s vocabulary (added tokens included)."""
    pad_id, bos_id, eos_id = hf_tokenizer.convert_tokens_to_ids([_PAD, _BOS, _EOS])
    return {
        # Without "architectures" vLLM resolves a bare LlamaModel with no LM head.
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(hf_tokenizer),
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        # The CPU attention backend rejects small head sizes (16 fails; 64 works).
        "head_dim": 64,
        "num_key_value_heads": 1,
        "hidden_act": "silu",
        "max_position_embeddings": _MAX_LEN,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": "float32",
    }


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    return {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
    }


def _finish(directory: Path, kind: _Kind) -> None:
    # Written last: its presence means the directory is complete.
    _write_json(directory / _MARKER_NAME, _marker(kind))
    directory.chmod(0o755)  # mkdtemp makes it 0o700.


def _train_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_TARGET,
        min_frequency=2,
        special_tokens=[_PAD, _BOS, _EOS],
        # Every byte is a token, so any text encodes (no unknown token needed).
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repetition makes pair counts, and so the merges, well separated.
    tokenizer.train_from_iterator(list(_CORPUS) * 4, trainer=trainer)
    bos_id = tokenizer.token_to_id(_BOS)
    # Like Llama's tokenizer: encoding a text prepends <s>.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{_BOS} $A",
        pair=f"{_BOS} $A {_BOS} $B",
        special_tokens=[(_BOS, bos_id)],
    )
    return tokenizer


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
