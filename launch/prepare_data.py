"""Byte-tokenize text files into a token file that `data.source = "memmap"` opens without loading.

    python launch/prepare_data.py --input 'corpus/**/*.txt' --output data/corpus.bin [--dtype uint32] [--force]

Writes PATH.bin (raw token ids) and PATH.bin.json ({"dtype", "num_tokens", "vocab_size", "tokenizer"}).
Files are read in the order given, each glob's matches sorted, joined by the same document separator as the
"text" source, so training on the output sees exactly the tokens that source would produce.
Errors are one line on stderr with exit code 2.
"""

import argparse
import sys

from moe_dist.train.data import MEMMAP_DTYPES, read_documents, resolve_paths, write_memmap


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True, metavar="GLOB", help="text files or globs")
    parser.add_argument("--output", required=True, metavar="PATH.bin", help="token file to write")
    parser.add_argument("--dtype", choices=MEMMAP_DTYPES, default="uint16", help="token id type on disk")
    parser.add_argument("--force", action="store_true", help="overwrite an existing output")
    args = parser.parse_args(argv)
    try:
        tokens = read_documents(resolve_paths(args.input, key="--input"), max_bytes=None)
        write_memmap(tokens, args.output, args.dtype, overwrite=args.force)
    except FileExistsError as e:
        print(f"prepare_data.py: error: {e} (pass --force to replace it)", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"prepare_data.py: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {tokens.size} tokens ({args.dtype}) to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
