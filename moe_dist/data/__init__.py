"""Everything about tokens, one module per concept (import from the module; this package imports nothing):

- `tokenizer`: the byte tokenizer (`encode`/`decode`), Hugging Face tokenizers from local files, a run's copy.
- `prepare`: offline tokenizing of text/JSONL/Parquet inputs into shard sets (`launch/prepare_data.py`).
- `shards`: shard sets on disk (sidecar, atomic writes) and reading them memory-mapped as one `Stream`.
- `sources`: a run's token stream from `data.source` (stdlib bytes, text files, shard sets), split train/val.
- `batches`: `Batch`, `TokenDataset`, the micro-batch rule and `IGNORE`, the loss's ignore index.
"""
