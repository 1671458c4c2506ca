"""Offline tokenizing (`launch/prepare_data.py`): inputs → documents → token ids + EOS → a shard set.

Inputs: text files or globs (a file is one document), JSONL (`.jsonl`/`.json`, one document per line, text in
`field`) and Parquet (`.parquet`, text in `column`, read with pyarrow). Fine-tuning inputs (`sft=True`) are JSONL
records with `prompt`/`completion` strings or a chat `messages` list; the loss mask marks the completion (and
its EOS) as targets, the prompt not.

Determinism: documents are read in input order and cut into fixed chunks; workers tokenize chunks and results
are consumed in chunk order (`imap`), so the bytes written do not depend on the number of workers.
Nothing final is touched until the whole input has been tokenized: shards are written into a staging directory
next to the output and renamed into place at the end, sidecar last (see `moe_dist.data.shards`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import multiprocessing
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
from tqdm import tqdm

from moe_dist.data.shards import ShardWriter, atomic_write, existing_outputs, shard_files, sidecar_of
from moe_dist.data.tokenizer import BYTES, Tokenizer, encode, load_tokenizer, train_bpe

CHUNK_DOCS = 64  # documents per worker task: large enough to amortize IPC, small enough to balance
# Chat rendering without a template of the tokenizer's own: one "role: content" line per message.
PLAIN_CHAT = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
PLAIN_CHAT += "{% if add_generation_prompt %}assistant: {% endif %}"


def resolve_paths(patterns: list[str], key: str = "data.paths", expected: Optional[str] = None) -> list[Path]:
    """Files and globs → existing files: globs sorted, entries kept in the given order, duplicates dropped.

    `key` names the setting in errors (the config key, or a CLI flag for scripts), `expected` what the files
    should be (said in the error)."""
    hint = f" (expected {expected})" if expected else ""
    files: list[Path] = []
    for pattern in patterns:
        if any(c in pattern for c in "*?["):
            matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
            if not matches:
                raise ValueError(f"{key}: {pattern!r} matches no files{hint}")
            files.extend(Path(p) for p in matches)
        elif not os.path.isfile(pattern):
            raise ValueError(f"{key}: {pattern!r} is not an existing file{hint}")
        else:
            files.append(Path(pattern))
    return list(dict.fromkeys(files))


# ----------------------------------------------------------------------------------------------- inputs


def _utf8(data: bytes, path: Path, offset: int = 0) -> str:
    """Text for a tokenizer that reads text (not bytes). Bytes that are not UTF-8 are refused with the file and
    the byte offset rather than replaced: a replacement character the user never sees would be trained on."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"--input: {path}: not UTF-8 at byte {offset + e.start} ({e.reason}); fix or drop the file (only plain "
            "text files under --tokenizer bytes are read as raw bytes)"
        ) from None


def _jsonl_records(path: Path) -> Iterator[tuple[int, dict]]:
    offset = 0
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            line, offset = _utf8(raw, path, offset), offset + len(raw)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"--input: {path}:{lineno}: invalid JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"--input: {path}:{lineno}: expected a JSON object per line")
            yield lineno, record


def _sft_record(path: Path, lineno: int, record: dict):
    """A fine-tuning record → ("pc", prompt, completion) or ("chat", messages)."""
    where = f"--input: {path}:{lineno}"
    if "messages" in record:
        msgs = record["messages"]
        ok = (
            isinstance(msgs, list)
            and msgs
            and all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in msgs)
        )
        if not ok:
            raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
        if msgs[-1]["role"] != "assistant":
            raise ValueError(f"{where}: the last message must be the assistant's (the completion the loss is on)")
        return ("chat", msgs)
    if not isinstance(record.get("prompt"), str) or not isinstance(record.get("completion"), str):
        raise ValueError(f"{where}: needs string fields 'prompt' and 'completion', or 'messages'")
    return ("pc", record["prompt"], record["completion"])


def iter_input_documents(
    files: list[Path], field: str = "text", column: str = "text", sft: bool = False, text: bool = False
) -> Iterator:
    """Documents of `files` in order: bytes (a text file; str decoded from UTF-8 with `text`, for a tokenizer that
    reads text), str (a JSONL field or Parquet cell), or a fine-tuning record (`sft`). Raises ValueError naming
    the file (and line, or byte offset) of the first bad record."""
    for path in files:
        suffix = path.suffix.lower()
        if sft:
            if suffix not in (".jsonl", ".json"):
                raise ValueError(f"--input: {path}: fine-tuning data must be JSONL (.jsonl)")
            for lineno, record in _jsonl_records(path):
                yield _sft_record(path, lineno, record)
        elif suffix in (".jsonl", ".json"):
            for lineno, record in _jsonl_records(path):
                if not isinstance(record.get(field), str):
                    raise ValueError(f"--field: {path}:{lineno} has no string field {field!r}")
                yield record[field]
        elif suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise ValueError(
                    "--input: reading Parquet needs the [data] extra (module 'pyarrow' is missing): "
                    "pip install -e '.[data]'"
                ) from None
            try:
                pf = pq.ParquetFile(path)
            except Exception as e:  # pyarrow's errors are of several types; one line names the file
                raise ValueError(f"--input: {path}: not a readable Parquet file ({type(e).__name__})") from None
            if column not in pf.schema_arrow.names:
                raise ValueError(f"--column: {path} has no column {column!r} (columns: {pf.schema_arrow.names})")
            for batch in pf.iter_batches(columns=[column], batch_size=1024):
                for value in batch.column(0).to_pylist():
                    if not isinstance(value, str):
                        raise ValueError(f"--column: {path}: column {column!r} holds {type(value).__name__}, not text")
                    yield value
        elif text:
            yield _utf8(path.read_bytes(), path)
        else:
            yield path.read_bytes()


def _chunks(docs: Iterator, size: int) -> Iterator[list]:
    chunk = []
    for doc in docs:
        chunk.append(doc)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


# ----------------------------------------------------------------------------------------------- workers

_WORKER: dict = {}  # per worker process: the tokenizer rebuilt once by _init_worker (a process-local cache)


def _init_worker(tok: Tokenizer) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: --workers sets the parallelism
    _WORKER["tok"] = tok


def _render_chat(tok: Tokenizer, messages: list[dict]) -> tuple[str, str]:
    """Chat messages → (prompt text, completion text): the prompt is the conversation up to the last assistant
    message with the generation prompt, the completion the rest of the rendered conversation."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(tok.chat_template or PLAIN_CHAT)
    names = {"bos_token": "", "eos_token": "", "raise_exception": raise_exception}
    prompt = template.render(messages=messages[:-1], add_generation_prompt=True, **names)
    full = template.render(messages=messages, add_generation_prompt=False, **names)
    if not full.startswith(prompt):
        raise ValueError("chat template: the rendered conversation does not start with its rendered prompt")
    return prompt, full[len(prompt) :]


def encode_chunk(chunk: list, tok: Optional[Tokenizer] = None) -> list[tuple[np.ndarray, Optional[np.ndarray]]]:
    """Documents → [(ids + EOS, loss mask or None)], one per document, in order. A document is encoded with the
    tokenizer's special tokens (BOS where it adds one) and ends with exactly one EOS."""
    tok = tok or _WORKER["tok"]
    out = []
    plain = [d for d in chunk if not isinstance(d, tuple)]
    if tok.json is None:  # bytes: a text file's bytes are its tokens exactly (no UTF-8 round trip)
        ids_list = [encode(d).astype(np.int64) for d in plain]
    else:
        texts = [d if isinstance(d, str) else d.decode("utf-8") for d in plain]  # read as text: already UTF-8
        ids_list = tok.encode_batch(texts, special=True)  # a document starts as the model expects (BOS)
    encoded = iter(ids_list)
    eos = np.array([tok.eos_id], dtype=np.int64)
    for doc in chunk:
        if not isinstance(doc, tuple):
            ids = next(encoded)
            out.append((ids if len(ids) and ids[-1] == tok.eos_id else np.concatenate([ids, eos]), None))
            continue
        prompt, completion = doc[1:] if doc[0] == "pc" else _render_chat(tok, doc[1])
        (p,) = tok.encode_batch([prompt], special=True)  # BOS (where the tokenizer adds one) starts the prompt
        p = p[:-1] if len(p) and p[-1] == tok.eos_id else p  # a post-processor's EOS belongs after the completion
        (c,) = tok.encode_batch([completion])
        mask = np.concatenate([np.zeros(len(p), np.uint8), np.ones(len(c) + 1, np.uint8)])
        out.append((np.concatenate([p, c, eos]), mask))
    return out


# ----------------------------------------------------------------------------------------------- the job


def _publish(staging: Path, prefix: Path, shards: int) -> None:
    """Move a finished shard set from `staging` into place: the old sidecar goes first (so no mix of old and new
    files is ever read as complete), then the shards, stale higher-numbered old shards, and the sidecar last."""
    old = existing_outputs(prefix)
    if sidecar_of(prefix).exists():
        sidecar_of(prefix).unlink()
    fresh = set()
    for i in range(shards):
        for f in shard_files(staging / prefix.name, i):
            if f.exists():
                os.replace(f, prefix.parent / f.name)
                fresh.add(f.name)
    for f in old:
        if f.name not in fresh and f.exists() and f != sidecar_of(prefix):
            f.unlink()
    os.replace(sidecar_of(staging / prefix.name), sidecar_of(prefix))


@contextlib.contextmanager
def _created_parents(directory: Path) -> Iterator[None]:
    """Create `directory`'s missing ancestors (and itself) for the job in the block, and remove the ones it created
    again (those still empty) when the job fails: a fresh clone's `--output data/train` works, and a failed job
    leaves the disk as it was."""
    created = [d for d in (directory, *directory.parents) if not d.exists()]
    directory.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        for d in created:  # deepest first
            with contextlib.suppress(OSError):
                d.rmdir()
        raise


def prepare(
    inputs: list[str],
    output: str,
    tokenizer: str = BYTES,
    train_vocab: Optional[int] = None,
    eos_token: Optional[str] = None,
    field: str = "text",
    column: str = "text",
    sft: bool = False,
    dtype: Optional[str] = None,
    workers: int = 1,
    shard_tokens: int = 1 << 28,
    force: bool = False,
) -> dict:
    """Tokenize `inputs` into the shard set `output` (a prefix); returns the sidecar plus timing figures.
    Raises ValueError/TokenizerError (one line) on bad input, FileExistsError when `output` exists and not `force`;
    in every such case nothing on disk has changed."""
    prefix = Path(output)
    nearest = next(d for d in (prefix.parent, *prefix.parent.parents) if d.exists())
    if not nearest.is_dir():
        raise ValueError(f"--output: {nearest} is not a directory")
    if prefix.name.endswith((".json", ".bin")):
        raise ValueError(
            f"--output: give a prefix without extension (PREFIX.json and PREFIX.NNNNN.bin are written), got {output!r}"
        )
    tok_dir = prefix.parent
    taken = existing_outputs(prefix) + (
        [tok_dir / "tokenizer.json"] if train_vocab and (tok_dir / "tokenizer.json").exists() else []
    )
    if taken and not force:
        raise FileExistsError(f"--output: {taken[0]} already exists, refusing to overwrite")
    if workers < 1:
        raise ValueError(f"--workers: must be at least 1, got {workers}")
    files = resolve_paths(inputs, key="--input")
    with _created_parents(prefix.parent):
        tic = time.perf_counter()
        trained = None
        if train_vocab is not None:
            if tokenizer != BYTES:
                raise ValueError("--train-tokenizer: trains a new tokenizer; do not also pass --tokenizer")
            trained = train_bpe(_training_texts(files, field, column, sft), train_vocab)
            tok_file = Path(tempfile.mkdtemp(dir=tok_dir, prefix=f".{prefix.name}.tokenizer."))
            (tok_file / "tokenizer.json").write_text(trained[0])
            (tok_file / "tokenizer_config.json").write_text(json.dumps(trained[1], indent=2) + "\n")
            try:
                tok = load_tokenizer(str(tok_file / "tokenizer.json"))
            finally:
                shutil.rmtree(tok_file)
            tok.name = str(tok_dir / "tokenizer.json")
        else:
            tok = load_tokenizer(tokenizer, eos_token)
        dtype = dtype or ("uint16" if tok.vocab_size <= 1 << 16 else "uint32")
        seen = {"documents": 0, "text": 0}
        staging = Path(tempfile.mkdtemp(dir=prefix.parent, prefix=f".{prefix.name}.staging."))
        try:
            writer = ShardWriter(staging / prefix.name, dtype, tok.vocab_size, sft, shard_tokens)
            tokenize_tic = time.perf_counter()
            docs = _counted(iter_input_documents(files, field, column, sft, text=tok.json is not None), seen)
            n_tokens = _tokenize(docs, tok, writer, workers)
            tokenize_s = time.perf_counter() - tokenize_tic
            if n_tokens == 0 or not seen["text"]:  # an EOS alone is not data: refused, not a 1-token set
                empty = f"no text: {seen['documents']} empty document(s)" if seen["documents"] else "no documents"
                raise ValueError(f"--input: {len(files)} file(s) hold {empty}")
            meta = writer.finish(tok.identity())
            if trained is not None:  # the tokenizer goes into place with the data it wrote
                atomic_write(tok_dir / "tokenizer.json", trained[0].encode())
                atomic_write(tok_dir / "tokenizer_config.json", (json.dumps(trained[1], indent=2) + "\n").encode())
            _publish(staging, prefix, len(writer.shards))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return {**meta, "seconds": time.perf_counter() - tic, "tokenize_seconds": tokenize_s, "workers": workers}


def _counted(docs: Iterator, seen: dict) -> Iterator:
    """`docs` unchanged, counting into `seen` the documents and those with any text (fine-tuning records count as
    text: their prompt and completion were checked when read)."""
    for doc in docs:
        seen["documents"] += 1
        seen["text"] += isinstance(doc, tuple) or len(doc) > 0
        yield doc


def _training_texts(files, field, column, sft) -> Iterator:
    for doc in iter_input_documents(files, field, column, sft, text=True):
        if isinstance(doc, tuple):
            yield from (doc[1:] if doc[0] == "pc" else (m["content"] for m in doc[1]))
        else:
            yield doc


def _tokenize(docs: Iterator, tok: Tokenizer, writer: ShardWriter, workers: int) -> int:
    """Tokenize in chunk order on `workers` processes (1 = in this process) into `writer`; returns tokens."""
    total = 0
    bar = tqdm(desc="tokenize", unit=" doc", disable=None, dynamic_ncols=True)
    pool = None
    try:
        if workers == 1:
            results = (encode_chunk(c, tok) for c in _chunks(docs, CHUNK_DOCS))
        else:
            # spawn: the parent may have used the tokenizer's own thread pool, which does not survive a fork
            pool = multiprocessing.get_context("spawn").Pool(
                workers, initializer=_init_worker, initargs=(dataclasses.replace(tok, _backend=None),)
            )
            results = pool.imap(encode_chunk, _chunks(docs, CHUNK_DOCS), chunksize=1)
        for encoded in results:
            for ids, mask in encoded:
                writer.add(ids, mask)
                total += len(ids)
            bar.update(len(encoded))
            bar.set_postfix(tokens=total)
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
    return total
