"""Sample text from a model: one of our checkpoints, a run directory (its newest checkpoint) or a Hugging
Face Mixtral/Jamba directory.

    python launch/generate.py --checkpoint runs/mixtral_small --prompt "def main(" --max-new-tokens 200
    python launch/generate.py --checkpoint HF_DIR --prompt-ids 1,415,2936 --temperature 0   # greedy

Decoding keeps a KV cache per attention layer and the conv/SSM state per Mamba layer (--no-cache recomputes
the whole sequence each step, for comparison). Tokens: the tokenizer the run was trained with (RUN_DIR/tokenizer/,
copied there from data.tokenizer), the tokenizer files of a Hugging Face directory (or of RUN_DIR/hf/ for an
imported run), or bytes for a byte-level model (vocab 256); otherwise pass --prompt-ids and read ids back.
Speed goes to stderr.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

from moe_dist.data.tokenizer import BYTES_VOCAB, TOKENIZER_DIR, decode, encode, load_tokenizer
from moe_dist.hf import HFConfigError, companion_dir, load_model
from moe_dist.models.decoder import generate
from moe_dist.train.checkpoint import CheckpointError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True, help="checkpoint, run directory or Hugging Face directory")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-ids", help="prompt as comma-separated token ids (any vocabulary)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: smallest set with this probability")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-samples", type=int, default=1, help="sequences sampled in one batch")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence every step")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: one-token steps are too small to split; 0 = torch's default)",
    )
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> str | None:
    """The first sampling setting that makes no sense, as one line naming the flag (None when all are fine): checked
    before the model is loaded. A negative temperature would sample the least likely tokens."""
    rules = [
        (args.max_new_tokens >= 1, "--max-new-tokens", "must be at least 1", args.max_new_tokens),
        (args.temperature >= 0, "--temperature", "must be >= 0 (0 = greedy)", args.temperature),
        (args.top_k is None or args.top_k >= 1, "--top-k", "must be at least 1", args.top_k),
        (args.top_p is None or 0 < args.top_p <= 1, "--top-p", "must be in (0, 1]", args.top_p),
        (args.num_samples >= 1, "--num-samples", "must be at least 1", args.num_samples),
        (args.threads >= 0, "--threads", "must be >= 0 (0 = torch's default)", args.threads),
    ]
    for ok, flag, rule, value in rules:
        if not ok:
            return f"{flag}: {rule}, got {value}"
    return None


def tokenizer_dir(checkpoint: Path) -> Path | None:
    """Where the model's tokenizer files are: a Hugging Face directory itself, the run's RUN_DIR/tokenizer/
    (a run trained with data.tokenizer, given as the run directory or one of its checkpoints), or RUN_DIR/hf/
    (a run imported from Hugging Face)."""
    for d in (
        checkpoint,
        checkpoint / TOKENIZER_DIR,
        checkpoint.parent.parent / TOKENIZER_DIR,
        companion_dir(checkpoint),
    ):
        if d is not None and any((d / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            return d
    return None


class Tokens:
    """Text ↔ ids: the model's own tokenizer files if it has them (transformers' AutoTokenizer where there is a
    tokenizer_config.json, which adds the model's BOS; else the tokenizer.json alone), bytes for vocab 256; `text`
    is False when neither applies (ids only)."""

    def __init__(self, vocab_size: int, checkpoint: Path):
        self.hf = self.tok = None
        source = tokenizer_dir(checkpoint)
        self.text = vocab_size == BYTES_VOCAB and source is None
        if source is None:
            return
        if (source / "tokenizer_config.json").is_file():
            try:
                from transformers import AutoTokenizer

                self.hf = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
                self.text = True
                return
            except ImportError:
                pass
        if (source / "tokenizer.json").is_file():
            self.tok = load_tokenizer(str(source))
            self.text = True

    def encode(self, text: str) -> list[int]:
        if self.hf is not None:
            return self.hf.encode(text)
        return self.tok.encode(text) if self.tok is not None else encode(text).tolist()

    def decode(self, ids: list[int]) -> str:
        if self.hf is not None:
            return self.hf.decode(ids)
        return self.tok.decode(ids) if self.tok is not None else decode(ids)


def main(argv=None) -> int:
    args = parse_args(argv)
    bad = check_args(args)
    if bad is not None:
        print(f"error: {bad}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model = load_model(args.checkpoint, DTYPES[args.dtype])
    except (CheckpointError, HFConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tokens = Tokens(model.cfg.vocab_size, args.checkpoint)
    if args.prompt is not None:
        if not tokens.text:
            print(
                f"error: --prompt: no tokenizer for vocabulary {model.cfg.vocab_size} (no tokenizer files next to "
                "the checkpoint, or transformers missing); pass --prompt-ids",
                file=sys.stderr,
            )
            return 2
        ids = tokens.encode(args.prompt)
    else:
        ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    if not ids or max(ids) >= model.cfg.vocab_size or min(ids) < 0:
        print(f"error: the prompt must be non-empty token ids in [0, {model.cfg.vocab_size})", file=sys.stderr)
        return 2
    prompt = torch.tensor([ids] * args.num_samples, dtype=torch.long)
    gen = torch.Generator().manual_seed(args.seed)
    tic = time.perf_counter()
    out = generate(
        model, prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p, gen, use_cache=not args.no_cache
    )
    elapsed = time.perf_counter() - tic
    for row in out.tolist():
        print(tokens.decode(row) if tokens.text and args.prompt is not None else ",".join(map(str, row)))
    new = args.max_new_tokens * args.num_samples
    print(
        f"{new} tokens in {elapsed:.2f} s: {new / elapsed:.1f} tokens/s "
        f"({'no cache' if args.no_cache else 'KV/SSM cache'}, prompt {len(ids)} tokens)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
