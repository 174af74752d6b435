"""An EAGLE-3 draft head written as vLLM and SGLang load it (`--speculative-config '{"method": "eagle3", "model":
DIR, "num_speculative_tokens": K}'`): config.json (a LlamaConfig with architectures [LlamaForCausalLMEagle3],
draft_vocab_size, target_hidden_size, eagle_aux_hidden_state_layer_ids) and model.safetensors with the checkpoint's
names (midlayer.*, fc, norm, lm_head, d2t, t2d; no embedding: the engine shares the target's; no d2t / t2d when the
draft vocabulary is the whole vocabulary). bfloat16 weights by
default, as the published heads; d2t int64, t2d bool."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..serving.eagle import EagleHead
from .staging import staged


def head_state(head: EagleHead, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The head's tensors under the checkpoint's names, float weights in `dtype`. A head over the whole vocabulary
    has no d2t / t2d: vLLM builds no vocabulary map then and refuses one in the checkpoint."""
    full = head.config.draft_vocab_size == head.config.vocab_size
    return {k: (v.to(dtype) if v.is_floating_point() else v).contiguous().clone()
            for k, v in head.state_dict().items() if not (full and k in ("d2t", "t2d"))}


def write_head(head: EagleHead, out: Path, dtype: torch.dtype = torch.bfloat16, notes: dict | None = None) -> Path:
    """Write `head` to the folder `out` atomically (staging.staged); `notes` (how it was trained) go to
    training.json beside it. Returns `out`."""
    from safetensors.torch import save_file

    out = Path(out)
    with staged(out) as tmp:
        cfg = head.config.to_dict()
        cfg["torch_dtype"] = cfg["dtype"] = str(dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        save_file(head_state(head, dtype), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if notes is not None:
            (tmp / "training.json").write_text(json.dumps(notes, indent=1, default=str))
    return out
