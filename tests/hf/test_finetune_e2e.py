"""End to end, nothing downloaded: a tiny Mixtral built with transformers, a BPE tokenizer trained here and saved
into its directory, `convert.py import`, fine-tuning data prepared with that tokenizer, 20 training steps with
packed documents, `convert.py export`, and transformers loading the export and generating text with the tokenizer.
"""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import transformers

REPO = Path(__file__).resolve().parents[2]
WORDS = "red green blue cyan magenta yellow black white".split()


def _script(forks, name: str, *args, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python launch/NAME ARGS`, forked from the session's server (tests/forklaunch.py); it must succeed."""
    proc = forks.script(REPO / "launch" / name, args, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fine_tune_an_imported_mixtral_with_its_own_tokenizer(tmp_path, forks):
    # 1. A tokenizer trained on local text, saved into a Mixtral directory built with transformers.
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(WORDS[i % 8] + " " + WORDS[(i * 3) % 8] for i in range(400)))
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    _script(forks, "prepare_data.py", "--input", corpus, "--output", tok_dir / "pretrain", "--train-tokenizer",
            "--vocab-size", 300)  # fmt: skip
    hf_dir = tmp_path / "mixtral"
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tok_dir / "tokenizer.json"), eos_token="<|endoftext|>"
    )
    eos = tok.eos_token_id
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
        eos_token_id=eos, bos_token_id=eos, pad_token_id=eos,
    )  # fmt: skip
    transformers.MixtralForCausalLM(config).save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)

    # 2. Fine-tuning data with that tokenizer: the completion names the colour after the prompt's colour.
    records = [{"prompt": f"after {WORDS[i % 8]} comes", "completion": f" {WORDS[(i + 1) % 8]}"} for i in range(64)]
    (tmp_path / "ft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    _script(forks, "prepare_data.py", "--input", tmp_path / "ft.jsonl", "--sft", "--tokenizer", hf_dir, "--output",
            tmp_path / "ft")  # fmt: skip
    sidecar = json.loads((tmp_path / "ft.json").read_text())
    assert sidecar["eos_id"] == eos and sidecar["loss_mask"]

    # 3. Import, then 20 steps on the packed fine-tuning documents (loss on completions only).
    run = tmp_path / "run"
    overrides = [
        "train.steps=20", "train.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=4",
        "train.lr=0.01", "train.warmup_steps=2", "train.eval_every=0", "train.threads=1",
        "data.source=memmap", f'data.paths=["{tmp_path / "ft.json"}"]',
        "data.document_masking=true", "data.align_to_documents=true", "data.val_fraction=0.2",
    ]  # fmt: skip
    _script(
        forks, "convert.py", "import", hf_dir, run, "--config", REPO / "configs" / "debug.json", "--set", *overrides
    )
    _script(forks, "train.py", "--config", run / "config.json", "--run-dir", run, "--resume")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["lm_loss"] for r in records if "lm_loss" in r]
    print("fine-tuning lm_loss by step:", " ".join(f"{x:.3f}" for x in losses))
    assert len(losses) == 20 and sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses
    # The run carries its tokenizer: in the run directory and, by hash, in every checkpoint.
    assert (run / "tokenizer" / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
    meta = json.loads((run / "checkpoints" / "step_20" / "meta.json").read_text())
    assert meta["data"]["tokenizer"] == sidecar["tokenizer"]["sha256"]
    # The import made the model's own tokenizer (kept in RUN_DIR/hf/) the run's data.tokenizer.
    assert json.loads((run / "config.json").read_text())["data"]["tokenizer"] == str(run / "hf")

    # 4. Export; transformers loads it and generates with the tokenizer; our generate.py agrees.
    out = tmp_path / "export"
    _script(forks, "convert.py", "export", run, out)
    shutil.rmtree(hf_dir)  # nothing of the source directory is needed any more
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    prompt = "after red comes"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=3, do_sample=False)
    text = tokenizer.decode(gen[0, ids.shape[1] :])
    # Learned in 20 steps from completions only: answer with one colour, then end the document (EOS).
    assert text.strip() in {f"{w}<|endoftext|>" for w in WORDS}, text
    ours = _script(
        forks, "generate.py", "--checkpoint", run, "--prompt", prompt, "--max-new-tokens", "3", "--temperature", "0"
    )
    # transformers stops at EOS; ours decodes the --max-new-tokens it was asked for.
    assert ours.stdout.strip().startswith(tokenizer.decode(gen[0]).strip()), (ours.stdout, tokenizer.decode(gen[0]))
