"""Hugging Face interop: Mixtral, Jamba, Qwen2-MoE, Qwen3-MoE, OLMoE, Nemotron-H, Granite 4.0-H, Qwen3-Next,
Qwen3.5-MoE (its text model; the vision-language checkpoints are read, their vision tower dropped) and dense Llama,
Qwen3 checkpoint directories ↔ our Decoder, and ↔ our training checkpoints. One module per family (its config
mapping and tensor names), format.py for the directories, checkpoints.py for run directories (import, export,
upcycling).

What our config cannot express is refused with a one-line error naming the field (RoPE scaling, activations
other than SiLU or Nemotron-H's squared ReLU, sliding-window layer mixes, OLMoE's clip_qkv, Jamba layouts that are
not one period/offset, Nemotron's latent MoE), and so is a model a format cannot hold (sigmoid scores, expert
groups, a loss-free balancing bias outside Nemotron-H; squared-ReLU FFNs and Granite's multipliers outside their
family). Training hyper-parameters of the Hugging Face config (router_aux_loss_coef, jitter noise) are not mapped:
ours take their defaults or `--set` (overrides.py: the model keys a conversion applies, and the architecture keys
it refuses).
"""

from moe_dist.hf.checkpoints import (
    COMPANION_FILES,
    companion_dir,
    export_run_to_hf,
    import_hf_to_run,
    load_checkpoint_model,
    load_model,
    resolve_checkpoint,
    upcycle_to_run,
    write_initial_checkpoint,
)
from moe_dist.hf.common import HFConfigError
from moe_dist.hf.format import FAMILIES, config_from_hf, config_to_hf, family_of, load_hf_model, save_hf_model

__all__ = [
    "COMPANION_FILES",
    "FAMILIES",
    "HFConfigError",
    "companion_dir",
    "config_from_hf",
    "config_to_hf",
    "export_run_to_hf",
    "family_of",
    "import_hf_to_run",
    "load_checkpoint_model",
    "load_hf_model",
    "load_model",
    "resolve_checkpoint",
    "save_hf_model",
    "upcycle_to_run",
    "write_initial_checkpoint",
]
