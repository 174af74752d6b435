"""Sharded safetensors checkpoints, in the Hugging Face convention every loader reads.

Up to `max_shard_bytes` of tensors: one `model.safetensors`. Beyond: `model-00001-of-0000N.safetensors` ... and
`model.safetensors.index.json` (`{"metadata": {"total_size": bytes}, "weight_map": {tensor: file}}`), each shard
with the same `metadata` (`{"format": "pt", ...}`). Tensors are packed in the order given (a decoder block's
tensors stay together); one tensor larger than a shard gets a shard of its own.
"""
from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 10 ** 9  # transformers' default max_shard_size, "5GB"


def plan_shards(tensors: dict[str, Tensor], max_shard_bytes: int = MAX_SHARD_BYTES) -> list[list[str]]:
    """Tensor names per shard, in order, each shard at most `max_shard_bytes` (unless one tensor alone is larger)."""
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_safetensors(folder: str | Path, tensors: dict[str, Tensor], metadata: dict[str, str] | None = None,
                      max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """Write `tensors` into `folder` as one file or shards plus the index. Returns the file names written."""
    folder = Path(folder)
    metadata = {"format": "pt", **(metadata or {})}
    shards = plan_shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / SINGLE), metadata=metadata)
        return [SINGLE]
    names, weight_map = [], {}
    for i, keys in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in keys}, str(folder / name), metadata=metadata)
        names.append(name)
        weight_map.update({k: name for k in keys})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return names + [INDEX]


def shard_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (one file, or the shards its index names)."""
    folder = Path(folder)
    if (folder / INDEX).is_file():
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        return [folder / name for name in dict.fromkeys(weight_map.values())]
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    raise FileNotFoundError(f"{folder} has neither {SINGLE} nor {INDEX}")


def read_safetensors(folder: str | Path) -> dict[str, Tensor]:
    """Every tensor of a checkpoint folder, sharded or not (safetensors only: nothing is unpickled)."""
    out: dict[str, Tensor] = {}
    for path in shard_files(folder):
        out.update(load_file(str(path)))
    return out


def tensor_names(folder: str | Path) -> set[str]:
    names: set[str] = set()
    for path in shard_files(folder):
        with safe_open(str(path), "pt") as f:
            names |= set(f.keys())
    return names


def read_tensor(folder: str | Path, name: str) -> Tensor:
    for path in shard_files(folder):
        with safe_open(str(path), "pt") as f:
            if name in f.keys():
                return f.get_tensor(name)
    raise KeyError(f"{folder}: no tensor {name!r}")
