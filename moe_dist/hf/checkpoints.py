"""Our training checkpoints ↔ Hugging Face directories and models: a step-0 run directory from imported weights
(`import_hf_to_run`) or from an upcycled dense model (`upcycle_to_run`), an export of a checkpoint
(`export_run_to_hf`), and the loaders generate.py uses."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Optional, Sequence

import torch
from safetensors import safe_open

from moe_dist.config import JobConfig, config_from_dict, config_to_dict
from moe_dist.hf.common import HFConfigError
from moe_dist.hf.format import assign_tensors, is_experts, load_hf_model, save_hf_model
from moe_dist.hf.overrides import model_settings, rebuilt, with_settings
from moe_dist.models.decoder import Decoder, build_model
from moe_dist.models.upcycle import upcycle, upcycled_config
from moe_dist.train.checkpoint import latest_checkpoint, verify_checkpoint, write_whole_checkpoint
from moe_dist.train.checkpoint.plan import MOMENTS
from moe_dist.train.optim import lr_lambda

# Files of a Hugging Face directory that are not weights or config but travel with a converted model.
COMPANION_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from itself (RUN_DIR/checkpoints/step_N) or from a run directory (its newest)."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    found = latest_checkpoint(path / "checkpoints") if (path / "checkpoints").is_dir() else None
    if found is None:
        raise HFConfigError(f"{path}: neither a checkpoint (no meta.json) nor a run directory with a complete one")
    return found


def load_checkpoint_model(
    path: str | Path, dtype: Optional[torch.dtype] = None, dropless: bool = False
) -> tuple[Decoder, JobConfig]:
    """The model (parameters only, no optimizer state) and job config of one of our training checkpoints;
    `dropless` builds it with `moe.capacity_factor` null (inference). Files are checked against meta.json."""
    ckpt = resolve_checkpoint(path)
    _, index = verify_checkpoint(ckpt)  # sha256 of every file, safetensors headers only
    cfg = config_from_dict(json.loads((ckpt / "config.json").read_text()))
    model_cfg = cfg.model
    if dropless:
        model_cfg = dataclasses.replace(model_cfg, moe=dataclasses.replace(model_cfg.moe, capacity_factor=None))
    handles: dict[Path, object] = {}

    def get(name: str) -> torch.Tensor:
        if name not in index:
            raise HFConfigError(f"{ckpt}: no tensor named {name!r} (the checkpoint does not match its config.json)")
        f = index[name][0]
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt")
        return handles[f].get_tensor(name)

    def read(name: str) -> torch.Tensor:
        if is_experts(name):
            return torch.stack([get(f"{name}.{e}") for e in range(cfg.model.moe.num_experts)])
        return get(name)

    return assign_tensors(build_model(model_cfg), read, str(ckpt), dtype), cfg


def write_initial_checkpoint(model: Decoder, cfg: JobConfig, run_dir: str | Path) -> Path:
    """RUN_DIR/checkpoints/step_0 in the training-checkpoint format (zero Adam moments, adam_step 0) and
    RUN_DIR/config.json, so that `launch/train.py --config RUN_DIR/config.json --run-dir RUN_DIR --resume`
    starts training from `model`'s weights. `cfg.model` must describe `model`."""
    run_dir = Path(run_dir)
    root = run_dir / "checkpoints"
    if root.exists() and any(root.iterdir()):
        raise HFConfigError(f"{root}: already holds checkpoints; choose a new run directory")
    if (run_dir / "metrics.jsonl").exists():
        raise HFConfigError(f"{run_dir}: already holds a run (metrics.jsonl); choose a new run directory")
    tensors: dict[str, torch.Tensor] = {name: b.float().cpu() for name, b in model.named_buffers()}
    for name, p in model.named_parameters():
        t = p.detach().float().cpu()
        parts = {f"{name}.{e}": w for e, w in enumerate(t.unbind(0))} if is_experts(name) else {name: t}
        for n, w in parts.items():
            tensors[n] = w.contiguous()
            for moment in MOMENTS:
                tensors[f"{moment}.{n}"] = torch.zeros_like(w)
    meta = {"adam_step": 0, "lr": cfg.train.lr * lr_lambda(cfg)(0), "layout": {"dp": 1, "ep": 1, "tp": 1}}
    final = write_whole_checkpoint(root, 0, tensors, meta, cfg)
    (run_dir / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2) + "\n")
    return final


def import_hf_to_run(
    hf_dir: str | Path, run_dir: str | Path, base: Optional[JobConfig] = None, model_overrides: Sequence[str] = ()
) -> Path:
    """Hugging Face directory → a run directory ready for `--resume`: step-0 checkpoint, config.json (the
    model section from Hugging Face with `model_overrides` applied, everything else from `base` or the defaults;
    `base.model` is not used), and RUN_DIR/hf/ holding the source config.json and tokenizer files, which
    `export_run_to_hf` carries back. `model_overrides` are `model.KEY=VALUE` texts: a key that would change the
    imported architecture is refused before anything is read or written (hf/overrides.py). A memmap-data run
    without a `data.tokenizer` of its own trains with the model's tokenizer.json (RUN_DIR/hf)."""
    settings = model_settings(model_overrides, "import")
    hf_dir, run_dir = Path(hf_dir), Path(run_dir)
    model = load_hf_model(hf_dir)
    target = with_settings(dataclasses.asdict(model.cfg), settings)
    cfg = config_from_dict({**config_to_dict(base or JobConfig()), "model": target})
    model = rebuilt(model, cfg.model)  # the settings' buffers (e.g. a balancing bias) added
    if cfg.data.source == "memmap" and cfg.data.tokenizer == "bytes" and (hf_dir / "tokenizer.json").is_file():
        cfg.data.tokenizer = str(run_dir.resolve() / "hf")  # train with the model's own tokenizer, kept in RUN_DIR/hf/
    final = write_initial_checkpoint(model, cfg, run_dir)
    companion = run_dir / "hf"
    companion.mkdir(exist_ok=True)
    for name in ("config.json", *COMPANION_FILES):
        if (hf_dir / name).is_file():
            shutil.copyfile(hf_dir / name, companion / name)
    return final


def companion_dir(path: str | Path) -> Optional[Path]:
    """RUN_DIR/hf of a run directory or of one of its checkpoints, if the run was imported from Hugging Face."""
    path = Path(path)
    for d in (path, path.parent.parent):
        if (d / "hf" / "config.json").is_file():
            return d / "hf"
    return None


def export_run_to_hf(checkpoint: str | Path, out_dir: str | Path, dtype: Optional[torch.dtype] = None) -> Path:
    """One of our checkpoints (or a run directory's newest) → a Hugging Face directory; a run imported from
    Hugging Face gets its original config.json keys and tokenizer files back."""
    ckpt = resolve_checkpoint(checkpoint)
    model, _ = load_checkpoint_model(ckpt)
    extra = companion_dir(ckpt)
    template = json.loads((extra / "config.json").read_text()) if extra else None
    out = save_hf_model(model, out_dir, dtype=dtype, template=template)
    for name in COMPANION_FILES if extra else ():
        if (extra / name).is_file():
            shutil.copyfile(extra / name, out / name)
    trained_with = ckpt.parent.parent / "tokenizer"  # RUN_DIR/tokenizer/: the run's data.tokenizer (data/tokenizer.py)
    for name in COMPANION_FILES if trained_with.is_dir() else ():
        if (trained_with / name).is_file():
            shutil.copyfile(trained_with / name, out / name)
    return out


def load_model(path: str | Path, dtype: Optional[torch.dtype] = torch.float32) -> Decoder:
    """A Hugging Face directory, one of our checkpoints or a run directory → our Decoder, dropless for inference."""
    path = Path(path)
    hf_config = path / "config.json"
    if hf_config.is_file() and "model_type" in json.loads(hf_config.read_text()):
        return load_hf_model(path, dtype)
    return load_checkpoint_model(path, dtype, dropless=True)[0]


def upcycle_to_run(
    src: str | Path,
    run_dir: str | Path,
    base: JobConfig,
    experts: int,
    top_k: int,
    noise: float = 0.0,
    model_overrides: Sequence[str] = (),
) -> Path:
    """A dense model (Hugging Face Llama/Qwen3 directory, or one of our checkpoints / run directories) → a run
    directory whose MoE layers start as `experts` copies of each dense FFN (models/upcycle.py), routing `top_k`;
    the other model.moe settings and everything outside the model come from `base`, then `model_overrides`
    (`model.KEY=VALUE` texts: what keeps the architecture is applied, the rest refused, hf/overrides.py). Ready
    for `--resume`."""
    settings = model_settings(model_overrides, "upcycle")  # refused before anything is read or written
    if experts < 1:
        raise HFConfigError(f"--experts: must be positive, got {experts}")
    if not 1 <= top_k <= experts:
        raise HFConfigError(f"--top-k: must be in [1, --experts={experts}], got {top_k}")
    dense = load_model(src)
    moe = dataclasses.replace(base.model.moe, num_experts=experts, top_k=top_k)
    target = with_settings(dataclasses.asdict(upcycled_config(dense.cfg, moe)), settings)
    cfg = config_from_dict({**config_to_dict(base), "model": target})
    model = upcycle(dense, cfg.model, noise, seed=base.train.seed)
    return write_initial_checkpoint(model, cfg, run_dir)
