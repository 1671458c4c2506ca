"""Tokenize text, JSONL or Parquet files into a shard set that `data.source = "memmap"` memory-maps.

    python launch/prepare_data.py --input 'corpus/**/*.txt' --output data/train                 # bytes
    python launch/prepare_data.py --input docs.jsonl --field text --tokenizer HF_DIR --output data/train
    python launch/prepare_data.py --input 'c/*.parquet' --column text --train-tokenizer --vocab-size 8000 \\
        --output data/train                                     # trains a byte-level BPE → data/tokenizer.json
    python launch/prepare_data.py --input chat.jsonl --sft --tokenizer data/tokenizer.json --output data/ft

Writes PREFIX.NNNNN.bin (token ids), PREFIX.NNNNN.idx (document ends), PREFIX.NNNNN.mask (--sft: loss mask)
and PREFIX.json (tokenizer identity, vocab size, EOS id, dtype, shards), sidecar last. Each document ends with
EOS. The output's missing directories are created; an existing set is replaced only with --force. Errors are one
line on stderr with exit code 2, and leave every existing file as it was.
"""

import argparse
import sys

from moe_dist.data.prepare import prepare
from moe_dist.data.shards import DTYPES

DATA_EXTRA = ("tokenizers", "pyarrow", "jinja2")  # pyproject.toml's [data] extra


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, metavar="GLOB", help="text/JSONL/Parquet files or globs")
    p.add_argument("--output", required=True, metavar="PREFIX", help="shard-set prefix (PREFIX.json, PREFIX.N.bin)")
    p.add_argument("--tokenizer", default="bytes", help="'bytes' (default), a tokenizer.json or a directory with one")
    p.add_argument("--train-tokenizer", action="store_true", help="train a byte-level BPE on the input first")
    p.add_argument("--vocab-size", type=int, default=None, help="vocabulary of --train-tokenizer")
    p.add_argument("--eos-token", default=None, help="EOS token text, when the tokenizer's config names none")
    p.add_argument("--field", default="text", help="JSONL field holding the text")
    p.add_argument("--column", default="text", help="Parquet column holding the text")
    p.add_argument("--sft", action="store_true", help="fine-tuning JSONL: prompt/completion or chat messages")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="token id type (default: uint16 if it fits)")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    p.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard (cut at document ends)")
    p.add_argument("--force", action="store_true", help="replace an existing shard set")
    args = p.parse_args(argv)
    if args.train_tokenizer != (args.vocab_size is not None):
        print("prepare_data.py: error: --train-tokenizer and --vocab-size go together", file=sys.stderr)
        return 2
    try:
        meta = prepare(
            args.input, args.output, args.tokenizer, args.vocab_size, args.eos_token, args.field, args.column,
            args.sft, args.dtype, args.workers, args.shard_tokens, args.force,
        )  # fmt: skip
    except FileExistsError as e:
        print(f"prepare_data.py: error: {e} (pass --force to replace it)", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # the optional [data] extra (pyproject.toml) is not installed
        missing = (e.name or "").split(".")[0]
        if missing not in DATA_EXTRA:
            raise
        print(
            f"prepare_data.py: error: these options need the [data] extra (module {missing!r} is missing): "
            "pip install -e '.[data]'",
            file=sys.stderr,
        )
        return 2
    except (ValueError, OSError) as e:
        print(f"prepare_data.py: error: {e}", file=sys.stderr)
        return 2
    rate = meta["num_tokens"] / max(meta["tokenize_seconds"], 1e-9)
    print(
        f"wrote {meta['num_tokens']} tokens, {meta['num_documents']} documents, {len(meta['shards'])} shard(s) "
        f"({meta['dtype']}) to {args.output}.json in {meta['seconds']:.2f} s; tokenizing: {rate:.0f} tokens/s "
        f"on {meta['workers']} worker(s), {rate / meta['workers']:.0f} per worker"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
