"""Sharded safetensors checkpoints, in the Hugging Face convention every loader reads.

Up to `max_shard_bytes` of tensors: one `model.safetensors`. Beyond: `model-00001-of-0000N.safetensors` ... and
`model.safetensors.index.json` (`{"metadata": {"total_size": bytes}, "weight_map": {tensor: file}}`), each shard
with the same `metadata` (`{"format": "pt", ...}`). Tensors are packed in the order given (a decoder block's
tensors stay together); one tensor larger than a shard gets a shard of its own.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from ..core.profile import phase_of

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 10 ** 9  # transformers' default max_shard_size, "5GB"
# ShardWriter keeps this much room in front of a shard's data for its header (safetensors allows the header to be
# padded with spaces), so a large shard is closed in place; copying a 5 GB shard behind its header cost minutes when
# the page cache was full of the model being read. A shard of less data than IN_PLACE_MIN, or whose header outgrows
# the room (tens of thousands of tensors), is rewritten with an exact header, as before.
HEADER_ROOM = 1 << 20
IN_PLACE_MIN = 256 << 20


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


DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
          "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64}
CODES = {v: k for k, v in DTYPES.items()}


def read_header(path: str | Path) -> tuple[dict, int]:
    """(header without __metadata__, byte offset where the data starts) of one safetensors file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


class ShardReader:
    """Tensors of a checkpoint folder read one at a time with plain file reads (no memory map), so a tensor costs
    memory only while the caller holds it and the file's pages never count in this process's resident set. The
    weight streaming of a model larger than memory reads through this."""

    def __init__(self, folder: str | Path):
        self.where: dict[str, tuple[Path, dict, int]] = {}
        for path in shard_files(folder):
            header, start = read_header(path)
            for name, entry in header.items():
                self.where[name] = (path, entry, start)

    def names(self) -> set[str]:
        return set(self.where)

    def shape(self, name: str) -> tuple[list[int], torch.dtype]:
        _, entry, _ = self.where[name]
        return entry["shape"], DTYPES[entry["dtype"]]

    def get(self, name: str) -> Tensor:
        path, entry, start = self.where[name]
        begin, end = entry["data_offsets"]
        out = torch.empty(end - begin, dtype=torch.uint8)
        with open(path, "rb") as f:
            f.seek(start + begin)
            if f.readinto(out.numpy()) != end - begin:
                raise ValueError(f"{path}: tensor {name!r} is truncated")
        return out.view(DTYPES[entry["dtype"]]).reshape(entry["shape"])


class ShardWriter:
    """A sharded checkpoint written one tensor at a time: each tensor's bytes go to the current shard's data file
    at once, and only names, shapes and offsets stay in memory (a shard is closed, its header written in front of
    its data, when the next tensor would take it past `max_shard_bytes`). `finish()` names the shards as
    `write_safetensors` does (one `model.safetensors`, or `model-0000i-of-0000N.safetensors` and the index)."""

    def __init__(self, folder: str | Path, metadata: dict[str, str] | None = None,
                 max_shard_bytes: int = MAX_SHARD_BYTES, keep_closed: bool = False):
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
        self.folder, self.max = Path(folder), max_shard_bytes
        self.offset = 8 + HEADER_ROOM  # where the data starts in the open shard's file (HEADER_ROOM)
        self.metadata = {"format": "pt", **(metadata or {})}
        self.parts: list[tuple[Path, list[str]]] = []  # closed shards: file, tensor names
        self.header: dict[str, dict] = {}
        self.size = self.total = 0
        self.data = None
        # keep_closed: a closed shard's data file stays until `drop_stale` (a checkpoint that records the shard
        # as closed no longer needs it); else it is deleted at once
        self.keep_closed = keep_closed
        self.stale: list[Path] = []
        self._pool: ThreadPoolExecutor | None = None  # add_behind's one helper thread
        self._behind: Future | None = None

    def add_behind(self, items: list[tuple[str, Tensor]], profile=None) -> None:
        """Write `items` (name, tensor) on a helper thread while the caller goes on, after waiting for the batch
        before (one batch in flight: the tensors it holds are the memory plan's "previous block (being written)").
        Every other call waits for it first; an error in it is raised by the next call. `profile`: the helper's
        time is recorded as overlapped `writing`, the caller's waits as `writing`."""
        self.wait(profile)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="shard-writer")
        self._behind = self._pool.submit(self._add_all, items, profile)

    def _add_all(self, items: list[tuple[str, Tensor]], profile) -> None:
        with phase_of(profile, "writing"):
            for name, t in items:
                self._add(name, t)

    def wait(self, profile=None) -> None:
        """Until the batch add_behind is writing has been written (its error, if any, raised here)."""
        if self._behind is not None:
            behind, self._behind = self._behind, None
            with phase_of(profile, "writing"):
                behind.result()

    def add(self, name: str, tensor: Tensor) -> None:
        self.wait()
        self._add(name, tensor)

    def _add(self, name: str, tensor: Tensor) -> None:
        if name in self.header or any(name in names for _, names in self.parts):
            raise ValueError(f"tensor {name!r} written twice")
        t = tensor.detach().to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        if self.header and self.size + nbytes > self.max:
            self._close()
        if self.data is None:
            self.data = open(self.folder / f".part-{len(self.parts) + 1:05d}.data", "wb")
            self.data.seek(self.offset)
        self.header[name] = {"dtype": CODES[t.dtype], "shape": list(t.shape),
                             "data_offsets": [self.size, self.size + nbytes]}
        if nbytes:
            self.data.write(t.reshape(-1).view(torch.uint8).numpy().data)
        self.size += nbytes
        self.total += nbytes

    def _close(self) -> None:
        data_path = Path(self.data.name)
        path = self.folder / f".part-{len(self.parts) + 1:05d}.safetensors"
        header = json.dumps({"__metadata__": self.metadata, **self.header}, separators=(",", ":")).encode()
        room = self.offset - 8
        if self.size >= IN_PLACE_MIN and 0 < len(header) <= room:  # the header into the room left for it
            self.data.seek(0)
            self.data.write(struct.pack("<Q", room) + header + b" " * (room - len(header)))
            self.data.close()
            os.replace(data_path, path)
        else:
            self.data.close()
            header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned, as safetensors writes it
            with open(path, "wb") as out, open(data_path, "rb") as data:
                out.write(struct.pack("<Q", len(header)) + header)
                data.seek(self.offset)
                shutil.copyfileobj(data, out, 16 << 20)
            if self.keep_closed:
                self.stale.append(data_path)
            else:
                data_path.unlink()
        self.parts.append((path, list(self.header)))
        self.header, self.size, self.data = {}, 0, None

    def state(self) -> dict:
        """Where the writer stands, for a checkpoint (resume with `restore`): the closed shards, and the open one's
        tensors and size. The open data file is flushed first (and a batch being written behind finished)."""
        self.wait()
        if self.data is not None:
            self.data.flush()
        return {"parts": [[p.name, names] for p, names in self.parts], "header": self.header, "size": self.size,
                "total": self.total, "data": Path(self.data.name).name if self.data is not None else None,
                "offset": self.offset}

    def drop_stale(self) -> None:
        """Delete the data files of closed shards (once a checkpoint records them as closed)."""
        for path in self.stale:
            path.unlink(missing_ok=True)
        self.stale = []

    @classmethod
    def restore(cls, folder: str | Path, state: dict, metadata: dict[str, str] | None = None,
                max_shard_bytes: int = MAX_SHARD_BYTES, keep_closed: bool = True) -> "ShardWriter":
        """The writer as `state()` recorded it: tensors added after that are cut from the open shard's data file
        (it is reopened from the closed shard's data if the shard was closed after the checkpoint: the kept data
        file, or the shard itself when it was closed in place, its header room written again at the next close)."""
        writer = cls(folder, metadata, max_shard_bytes, keep_closed)
        writer.parts = [(writer.folder / name, names) for name, names in state["parts"]]
        writer.header, writer.size, writer.total = state["header"], state["size"], state["total"]
        writer.offset = state.get("offset", 0)  # 0: a checkpoint of a writer that kept no header room
        if state["data"] is not None:
            data = writer.folder / state["data"]
            closed_in_place = data.with_suffix(".safetensors")
            if not data.exists() and closed_in_place.exists():
                os.replace(closed_in_place, data)
            writer.data = open(data, "r+b")
            writer.data.truncate(writer.offset + writer.size)
            writer.data.seek(writer.offset + writer.size)
        closed = {p.name for p, _ in writer.parts}
        for path in writer.folder.glob(".part-*"):  # what was written after the checkpoint is written again
            if path.name not in closed and (writer.data is None or path.name != state["data"]):
                path.unlink()
        return writer

    def finish(self) -> list[str]:
        """Close the last shard and give the shards their final names. Returns the file names written."""
        self.wait()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self.data is not None or not self.parts:
            if self.data is None:
                self.data = open(self.folder / f".part-{len(self.parts) + 1:05d}.data", "wb")
                self.data.seek(self.offset)
            self._close()
        self.drop_stale()
        if len(self.parts) == 1:
            os.replace(self.parts[0][0], self.folder / SINGLE)
            return [SINGLE]
        names, weight_map = [], {}
        for i, (path, keys) in enumerate(self.parts, 1):
            name = f"model-{i:05d}-of-{len(self.parts):05d}.safetensors"
            os.replace(path, self.folder / name)
            names.append(name)
            weight_map.update({k: name for k in keys})
        (self.folder / INDEX).write_text(json.dumps({"metadata": {"total_size": self.total},
                                                     "weight_map": weight_map}, indent=2))
        return names + [INDEX]
