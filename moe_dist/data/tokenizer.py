"""Tokenizers: raw bytes, or any Hugging Face fast tokenizer read from local files; and the run's copy of them.

A tokenizer is named by `spec`: "bytes" (vocabulary 256, EOS = NUL, nothing to version), a `tokenizer.json`
file, or a directory holding one (a Hugging Face model or tokenizer directory, e.g. one `convert.py import`
read). Its identity is the sha256 of that `tokenizer.json`: shard sidecars record it, training compares it
with the run's `data.tokenizer`, so tokens are never read with another vocabulary than the one that wrote them.

The byte tokenizer is `encode`/`decode` below (the token of a byte is its value); a `Tokenizer` loaded as "bytes"
uses them too. This module imports neither torch nor transformers (tokenizing workers start fast); `tokenizers`
is imported only when a non-byte tokenizer is used.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

from moe_dist.data.shards import atomic_write

BYTES = "bytes"
BYTES_VOCAB = 256
BYTES_EOS = 0  # NUL never occurs in text, so it ends a document unambiguously
# Special tokens taken as EOS when tokenizer_config.json does not name one (GPT-2/Llama 3, Llama 2/Mistral, Gemma).
_EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
TRAINED_EOS = "<|endoftext|>"  # the EOS of tokenizers trained by `train_bpe`
TOKENIZER_DIR = "tokenizer"  # RUN_DIR/tokenizer/: the run's tokenizer files, which generate.py and export use


# ----------------------------------------------------------------------------------------------- bytes


def encode(data: bytes | str) -> np.ndarray:
    """Bytes (or UTF-8 text) → token ids, shape (N,) uint8: the token of a byte is its value."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    return np.frombuffer(raw, dtype=np.uint8)


def decode(ids) -> str:
    """Token ids (tensor, array or list, any shape) → text; invalid UTF-8 is replaced, not raised,
    because model samples routinely cut multi-byte characters."""
    if hasattr(ids, "detach"):  # a torch tensor (torch is not imported here, see the module docstring)
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= BYTES_VOCAB):
        raise ValueError(f"decode: token ids must lie in [0, {BYTES_VOCAB}), got range [{arr.min()}, {arr.max()}]")
    return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------------------------- any tokenizer


class TokenizerError(ValueError):
    """A tokenizer cannot be loaded or used as asked; the message is one line naming the file."""


@dataclass
class Tokenizer:
    """What the data path needs of a tokenizer. `json` is the tokenizer.json text (None for bytes), from which a
    worker process rebuilds it; `chat_template` is tokenizer_config.json's Jinja template, if any."""

    name: str  # the spec it was loaded from, as given
    sha256: str  # identity: "bytes" or the hex sha256 of tokenizer.json
    vocab_size: int
    eos_id: int
    json: Optional[str] = None
    chat_template: Optional[str] = None
    source_dir: Optional[Path] = None  # directory of tokenizer.json (its companion files travel with a run)
    _backend: object = None

    @property
    def backend(self):
        if self._backend is None and self.json is not None:
            from tokenizers import Tokenizer as HFTokenizer

            self._backend = HFTokenizer.from_str(self.json)
        return self._backend

    def encode_batch(self, texts: list[str], special: bool = False) -> list[np.ndarray]:
        """Texts → token ids; with `special`, the tokenizer's post-processor adds what it adds to a sequence
        (e.g. Llama/Mixtral's BOS; nothing for GPT-2-style byte-level BPE). The caller appends EOS."""
        if self.json is None:
            return [encode(t).astype(np.int64) for t in texts]
        encodings = self.backend.encode_batch(texts, add_special_tokens=special)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0].tolist()

    def decode(self, ids: list[int]) -> str:
        if self.json is None:
            return decode(ids)
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def identity(self) -> dict:
        """What a sidecar records: {"name", "sha256", "vocab_size", "eos_id"}."""
        return {"name": self.name, "sha256": self.sha256, "vocab_size": self.vocab_size, "eos_id": self.eos_id}


def _token_text(value) -> Optional[str]:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...} objects."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_tokenizer(spec: str, eos_token: Optional[str] = None) -> Tokenizer:
    """`spec` ("bytes", a tokenizer.json, or a directory holding one) → Tokenizer, from local files only.

    EOS: `eos_token` if given, else tokenizer_config.json's "eos_token", else the first of the usual EOS tokens
    the vocabulary has. Raises TokenizerError (one line) when the files do not load or no EOS is found."""
    if spec == BYTES:
        if eos_token is not None:
            raise TokenizerError("--eos-token: the bytes tokenizer's EOS is NUL (id 0) and cannot be changed")
        return Tokenizer(BYTES, BYTES, BYTES_VOCAB, BYTES_EOS)
    path = Path(spec)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        where = f"{path} has no tokenizer.json (only fast tokenizers are supported)" if path.is_dir() else path
        raise TokenizerError(f"tokenizer: {where} not found" if not path.is_dir() else f"tokenizer: {where}")
    raw = file.read_bytes()
    try:
        from tokenizers import Tokenizer as HFTokenizer

        backend = HFTokenizer.from_str(raw.decode("utf-8"))
    except ImportError:
        raise TokenizerError(
            "tokenizer: needs the [data] extra (module 'tokenizers' is missing): pip install -e '.[data]'"
        ) from None
    except Exception as e:  # the Rust library raises its own exception type with a multi-line message
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TokenizerError(f"tokenizer: {file} does not load ({first})") from None
    config_file = file.parent / "tokenizer_config.json"
    config = {}
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise TokenizerError(f"tokenizer: {config_file}: invalid JSON ({e.msg} at line {e.lineno})") from None
    names = [eos_token] if eos_token is not None else [_token_text(config.get("eos_token")), *_EOS_CANDIDATES]
    eos_id = next((backend.token_to_id(n) for n in names if n and backend.token_to_id(n) is not None), None)
    if eos_id is None:
        what = f"--eos-token {eos_token!r} is not in its vocabulary" if eos_token else "it names no EOS token"
        raise TokenizerError(f"tokenizer: {file}: {what} (pass --eos-token TOKEN)")
    template = config.get("chat_template")
    return Tokenizer(
        name=str(spec),
        sha256=hashlib.sha256(raw).hexdigest(),
        vocab_size=backend.get_vocab_size(with_added_tokens=True),
        eos_id=int(eos_id),
        json=raw.decode("utf-8"),
        chat_template=template if isinstance(template, str) else None,
        source_dir=file.parent,
        _backend=backend,
    )


def train_bpe(texts: Iterable[str], vocab_size: int) -> tuple[str, dict]:
    """Train a byte-level BPE (GPT-2 style: every byte is in the base alphabet, so no text is out of vocabulary)
    with `tokenizers` on `texts`. Returns (tokenizer.json text, tokenizer_config.json dict that transformers'
    AutoTokenizer reads); the caller writes them. The trainer is deterministic for the same texts."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < BYTES_VOCAB + 1:
        raise TokenizerError(f"--vocab-size: must be at least {BYTES_VOCAB + 1} (bytes + EOS), got {vocab_size}")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[TRAINED_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": TRAINED_EOS, "bos_token": TRAINED_EOS}
    return tok.to_str(pretty=True), config


# ----------------------------------------------------------------------------------------------- a run's tokenizer


def tokenizer_identity(spec: str) -> str:
    """The sha256 of the run's tokenizer ("bytes" for bytes): recorded with the data order in checkpoints."""
    return load_tokenizer(spec).sha256


def copy_tokenizer(spec: str, run_dir: Path) -> Optional[Path]:
    """Copy the run's tokenizer.json (and its tokenizer_config.json, special_tokens_map.json) into
    RUN_DIR/tokenizer/, so the run stays usable when the original files move; None for bytes."""
    tok = load_tokenizer(spec)
    if tok.source_dir is None:
        return None
    out = run_dir / TOKENIZER_DIR
    out.mkdir(exist_ok=True)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (tok.source_dir / name).is_file():
            atomic_write(out / name, (tok.source_dir / name).read_bytes())
    atomic_write(out / "tokenizer.json", tok.json.encode())
    return out
