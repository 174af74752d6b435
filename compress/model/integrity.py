"""Damaged inputs refused before any work: safetensors checkpoints, GGUF files and resume folders checked when they are
opened, from their headers alone (no tensor data is read: a 70B checkpoint's ~30 shards cost milliseconds).

A file cut short (an interrupted download or copy, a full disk) or with a corrupt header otherwise fails deep inside
a loader: safetensors' "incomplete metadata, file not fully covered", numpy's "cannot reshape array of size ...",
a JSON or struct error. Here it fails with `DamagedFileError` (a ValueError, which `compress` prints as one line)
naming the file, the tensor, the bytes expected and found, and what to do.

- `check_safetensors(path)`: the 8-byte header length against the file size, the JSON header, each tensor's dtype x
  shape against its data_offsets, the offsets tiling the data section, and the file size = 8 + header + last end.
- `check_safetensors_folder(folder)`: every shard `model.safetensors.index.json` names is there and holds the
  tensors the index places in it (or, without an index, every *.safetensors file, and no numbered shard missing).
- `check_gguf(path)`: magic, version, the metadata and tensor-info sections parsed within the file, each tensor's
  ggml type and shape, and each tensor's bytes (offset + size from its type's block) inside the file.
- `gguf_reader(path)`: gguf's GGUFReader after `check_gguf`, its own errors re-raised as `DamagedFileError`.
- `check_resume_dir(path)`: a streamed run's checkpoint (OUTPUT.work/stream: progress.json, the carried inputs,
  the output shards written so far) or a distillation checkpoint (checkpoints/step-N), or a run's OUTPUT.work
  holding either.
- `check_source(kind, where)`: the check for a model source as `models._classify` resolves it.

What a header check cannot see: a flipped byte inside tensor data, or inside a tensor's name (a valid header that
names another tensor; the loaders then report the tensor missing).
"""
from __future__ import annotations

import json
import mmap
import re
import struct
import zipfile
from pathlib import Path

INDEX = "model.safetensors.index.json"
MAX_HEADER = 100_000_000  # the safetensors library's limit on the JSON header
REFETCH = ("Download or copy it again; a download or copy that was interrupted, or a full disk (check `df -h`), "
           "leaves a file cut short.")
CORRUPT = ("Download or copy it again, and check the disk and memory it was stored through (a corrupt header on "
           "a complete file means bytes were changed).")
RESTART = "Run without --resume to start over."

# bits per element of every dtype the safetensors format defines (sub-byte types are packed)
SAFETENSORS_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
                    "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
                    "I32": 32, "U32": 32, "F32": 32, "C64": 64, "I64": 64, "U64": 64, "F64": 64}


class DamagedFileError(ValueError):
    """A checkpoint, GGUF or resume file that is cut short or corrupt. `path`: the file; `tensor`: the tensor
    concerned, when one is; `expected` / `found`: byte counts, when the damage is a size."""

    def __init__(self, message: str, path, tensor: str | None = None, expected: int | None = None,
                 found: int | None = None):
        super().__init__(message)
        self.path, self.tensor, self.expected, self.found = Path(path), tensor, expected, found


# files found sound, by (path, inode, size, mtime): a source is resolved several times per run
_checked: set[tuple] = set()  # GGUF files
_names_cache: dict[tuple, set[str]] = {}  # safetensors files -> their tensor names


def _stat_key(path: Path) -> tuple:
    st = path.stat()
    return str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ----------------------------------------------------------------------------------------------- safetensors


def check_safetensors(path) -> None:
    """Raise DamagedFileError unless `path` is a complete safetensors file with a sound header."""
    _safetensors_names(Path(path))


def _safetensors_names(path: Path, fix: str | None = None) -> set[str]:
    """The tensor names of a sound safetensors file (see check_safetensors); `fix` replaces the advice."""
    refetch, corrupt = (fix, fix) if fix else (REFETCH, CORRUPT)
    if not path.is_file():
        raise DamagedFileError(f"{path} is missing. {refetch}", path)
    size = path.stat().st_size
    if size < 8:
        raise DamagedFileError(f"{path} is {size} bytes: a safetensors file starts with an 8-byte header length, so "
                               f"it is empty or truncated (expected at least 8 bytes, found {size}). {refetch}",
                               path, expected=8, found=size)
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        if n > size - 8:
            if n > MAX_HEADER:
                raise DamagedFileError(
                    f"{path}: its header length field (the first 8 bytes) reads {n} bytes, more than any safetensors "
                    f"header and than the {size}-byte file: those bytes are corrupt. {corrupt}", path, found=n)
            raise DamagedFileError(
                f"{path} is truncated inside its header: the header length field says {n} bytes of JSON follow the "
                f"first 8, but only {size - 8} do (expected at least {8 + n} bytes, found {size}). {refetch}",
                path, expected=8 + n, found=size)
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DamagedFileError(f"{path}: its {n}-byte JSON header does not parse ({exc}): the header, or the length "
                               f"field in the first 8 bytes, is corrupt. {corrupt}", path) from None
    if not isinstance(header, dict):
        raise DamagedFileError(f"{path}: its header is JSON but not an object of tensors: it is corrupt. {corrupt}",
                               path)
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise DamagedFileError(f"{path}: its __metadata__ is not a map of strings: the header is corrupt. {corrupt}",
                               path)
    spans = []
    for name, entry in header.items():
        spans.append((*_tensor_span(path, name, entry, corrupt), name))
    data = size - 8 - n
    spans.sort()
    end = 0
    for begin, stop, name in spans:
        if begin != end:
            what = "overlaps the tensor before it" if begin < end else f"leaves a gap of {begin - end} bytes before it"
            raise DamagedFileError(f"{path}: tensor {name!r} starts at byte {begin} of the data section and {what} "
                                   f"(the previous one ends at {end}): the header is corrupt. {corrupt}", path, name)
        end = stop
    if end > data:
        cut = [name for _, stop, name in spans if stop > data]
        begin, stop, name = next(s for s in spans if s[1] > data)
        raise DamagedFileError(
            f"{path} is truncated: tensor {name!r} needs bytes {begin}..{stop} of the data section, which holds only "
            f"{data} (expected a file of {8 + n + end} bytes, found {size}; {len(cut)} of {len(spans)} tensors are "
            f"cut). {refetch}", path, name, expected=8 + n + end, found=size)
    if end < data:
        raise DamagedFileError(f"{path} has {data - end} bytes after its last tensor (expected a file of "
                               f"{8 + n + end} bytes, found {size}): the header or the file is corrupt. {corrupt}",
                               path, expected=8 + n + end, found=size)
    return set(header)


def _tensor_span(path: Path, name: str, entry, corrupt: str) -> tuple[int, int]:
    """(begin, end) of a header entry's bytes in the data section, checked against its dtype and shape."""
    def bad(why: str):
        return DamagedFileError(f"{path}: tensor {name!r} {why}: the header is corrupt. {corrupt}", path, name)

    if not isinstance(entry, dict):
        raise bad("has no dtype / shape / data_offsets entry")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in SAFETENSORS_BITS:
        raise bad(f"has dtype {dtype!r}, which safetensors does not define")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise bad(f"has shape {shape!r}, not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise bad(f"has data_offsets {offsets!r}, not [begin, end]")
    bits = _numel(shape) * SAFETENSORS_BITS[dtype]
    if bits % 8 or offsets[1] - offsets[0] != bits // 8:
        raise bad(f"is {dtype} {shape}, {bits / 8:g} bytes, but its data_offsets {offsets} span "
                  f"{offsets[1] - offsets[0]}")
    return offsets[0], offsets[1]


_NUMBERED = re.compile(r"(.+)-(\d+)-of-(\d+)\.safetensors$")


def check_safetensors_folder(folder, fix: str | None = None) -> None:
    """Raise DamagedFileError unless every safetensors file of a checkpoint folder is sound: with an index, each
    shard it names is there and holds the tensors it places there; without one, every *.safetensors file, and no
    file of a numbered set (model-00002-of-00004.safetensors) missing. `fix` replaces the advice."""
    folder = Path(folder)
    index = folder / INDEX
    if not index.is_file():
        files = sorted(folder.glob("*.safetensors"))
        numbered: dict[tuple[str, str], set[int]] = {}
        for f in files:
            if m := _NUMBERED.match(f.name):
                numbered.setdefault((m[1], m[3]), set()).add(int(m[2]))
        for (stem, total), have in numbered.items():
            width = len(total)
            if lost := [f"{stem}-{i:0{width}d}-of-{total}.safetensors" for i in range(1, int(total) + 1)
                        if i not in have]:
                raise DamagedFileError(f"{folder / lost[0]} is missing: {folder} has shards {stem}-*-of-{total}."
                                       f"safetensors without {lost[0]} ({len(lost)} of {total} missing: "
                                       f"{', '.join(lost[:3])}{', ...' if len(lost) > 3 else ''}) and no {INDEX}: the "
                                       f"download is incomplete. {fix or 'Download the missing files again.'}",
                                       folder / lost[0])
        for f in files:
            _checked_names(f, fix)
        return
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
            raise TypeError("weight_map is not a map of tensor -> file")
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise DamagedFileError(f"{index} is damaged ({type(exc).__name__}: {exc}). {fix or CORRUPT}", index) from None
    shards: dict[str, list[str]] = {}
    for tensor, shard in weight_map.items():
        shards.setdefault(shard, []).append(tensor)
    if lost := [s for s in shards if not (folder / s).is_file()]:
        raise DamagedFileError(
            f"{folder / lost[0]} is missing: {INDEX} places {len(shards[lost[0]])} tensors in it (e.g. "
            f"{shards[lost[0]][0]!r}); {len(lost)} of the {len(shards)} shards it names are not in {folder} "
            f"({', '.join(lost[:3])}{', ...' if len(lost) > 3 else ''}). The download is incomplete: "
            f"{fix or 'download the missing shards again.'}", folder / lost[0], shards[lost[0]][0])
    for shard, tensors in shards.items():
        names = _checked_names(folder / shard, fix)
        if absent := [t for t in tensors if t not in names]:
            raise DamagedFileError(
                f"{folder / shard} lacks tensor {absent[0]!r} that {INDEX} places in it ({len(absent)} of its "
                f"{len(tensors)} such): the shard is not the one the index was written with (a mixed or partial "
                f"download). {fix or 'Download it and the index again.'}", folder / shard, absent[0])


def _checked_names(path: Path, fix: str | None = None) -> set[str]:
    """_safetensors_names, remembered per (path, size, mtime) once the file is found sound."""
    if not path.is_file():
        return _safetensors_names(path, fix)  # raises
    key = _stat_key(path)
    if key not in _names_cache:
        _names_cache[key] = _safetensors_names(path, fix)
    return _names_cache[key]


# ----------------------------------------------------------------------------------------------- GGUF

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class _Cut(Exception):
    """The header parse ran past the end of the file."""


class _Cursor:
    def __init__(self, buf, order: str):
        self.buf, self.order, self.pos = buf, order, 0

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise _Cut(self.pos + size)
        value = struct.unpack_from(self.order + fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def skip(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise _Cut(self.pos + n)
        self.pos += n

    def skip_strings(self, count: int) -> None:
        """Past `count` strings (a tokenizer's vocabulary: the one long loop of a header, kept tight)."""
        pos, end, unpack = self.pos, len(self.buf), struct.Struct(self.order + "Q").unpack_from
        for _ in range(count):
            if pos + 8 > end:
                raise _Cut(pos + 8)
            pos += 8 + unpack(self.buf, pos)[0]
        if pos > end:
            raise _Cut(pos)
        self.pos = pos

    def string(self) -> bytes:
        n = self.take("Q")
        start = self.pos
        self.skip(n)
        return bytes(self.buf[start:self.pos])


def check_gguf(path) -> None:
    """Raise DamagedFileError unless `path` is a GGUF file whose header parses within the file and whose every
    tensor's bytes (offset + size from its ggml type and shape) lie inside it."""
    path = Path(path)
    if not path.is_file():
        raise DamagedFileError(f"{path} is missing. {REFETCH}", path)
    key = _stat_key(path)
    if key in _checked:
        return
    size = key[2]
    if size < 24:
        raise DamagedFileError(f"{path} is {size} bytes: a GGUF file starts with a 24-byte header, so it is empty or "
                               f"truncated (expected at least 24 bytes, found {size}). {REFETCH}",
                               path, expected=24, found=size)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        view = memoryview(buf)
        try:
            _check_gguf(path, view, size)
        finally:
            view.release()
    _checked.add(key)


def _check_gguf(path: Path, buf, size: int) -> None:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    def corrupt(why: str, tensor: str | None = None):
        return DamagedFileError(f"{path}: {why}: the header is corrupt. {CORRUPT}", path, tensor)

    magic = bytes(buf[:4])
    if magic != GGUF_MAGIC:
        raise DamagedFileError(f"{path} does not start with the GGUF magic bytes b'GGUF' (found {magic!r}): it is not "
                               f"a GGUF file, or its first bytes are corrupt. {CORRUPT}", path)
    order = "<"
    version = struct.unpack_from("<I", buf, 4)[0]
    if version not in GGUF_VERSIONS and struct.unpack_from(">I", buf, 4)[0] in GGUF_VERSIONS:
        order, version = ">", struct.unpack_from(">I", buf, 4)[0]  # a big-endian file
    if version not in GGUF_VERSIONS:
        raise corrupt(f"GGUF version {version} (bytes 4..8), not one of {GGUF_VERSIONS}")
    cur = _Cursor(buf, order)
    cur.pos = 8
    n_tensors, n_kv = cur.take("Q"), cur.take("Q")
    # every metadata entry takes at least 13 bytes (key length, type, a 1-byte value), every tensor info 24
    if n_tensors * 24 + n_kv * 13 > size:
        raise corrupt(f"it declares {n_tensors} tensors and {n_kv} metadata entries (bytes 8..24), more than a "
                      f"{size}-byte file holds")
    alignment, key = 32, "(the tensor count)"
    keys, infos = set(), {}

    def value(kind: int, depth: int = 0) -> None:  # past one metadata value (arrays may nest)
        if kind == _ARRAY and depth < 8:
            item, count = cur.take("I"), cur.take("Q")
            if item == _STRING:
                cur.skip_strings(count)
            elif item in _SCALARS:
                cur.skip(count * struct.calcsize(_SCALARS[item]))
            else:
                for _ in range(count):
                    value(item, depth + 1)
        elif kind == _STRING:
            cur.string()
        elif kind in _SCALARS:
            cur.take(_SCALARS[kind])
        else:
            raise corrupt(f"metadata entry {key!r} has value type {kind}, which GGUF does not define")

    def text(what: str) -> str:
        start = cur.pos
        try:
            return cur.string().decode("utf-8")
        except UnicodeDecodeError:
            raise corrupt(f"the {what} at byte {start} is not UTF-8") from None

    try:
        for _ in range(n_kv):
            start = cur.pos
            key = text("metadata key")
            if key in keys:
                raise corrupt(f"metadata key {key!r} appears twice (again at byte {start})")
            keys.add(key)
            kind = cur.take("I")
            if key == "general.alignment":
                if kind != 4:  # UINT32, as gguf's reader and llama.cpp require
                    raise corrupt(f"general.alignment has value type {kind}, not UINT32 (4)")
                alignment = cur.take("I")
            else:
                value(kind)
        if alignment <= 0 or alignment & (alignment - 1):
            raise corrupt(f"general.alignment is {alignment}, not a power of two")
        for _ in range(n_tensors):
            start = cur.pos
            name = text("tensor name")
            if name in infos:
                raise corrupt(f"tensor name {name!r} appears twice (again at byte {start})", name)
            key = name
            n_dims = cur.take("I")
            if n_dims > 4:
                raise corrupt(f"tensor {name!r} has {n_dims} dimensions (GGUF tensors have at most 4)", name)
            dims = [cur.take("Q") for _ in range(n_dims)]
            infos[name] = (dims, cur.take("I"), cur.take("Q"))  # shape (innermost first), ggml type, offset
    except _Cut as cut:
        raise DamagedFileError(
            f"{path}: its header runs past the end of the file (reading {key!r} needs byte {cut.args[0]}, the file "
            f"is {size} bytes): the file is truncated inside its header, or a length in the header is corrupt. "
            f"{REFETCH}", path, expected=cut.args[0], found=size) from None
    data_start = -(-cur.pos // alignment) * alignment
    spans = []
    for name, (dims, code, offset) in infos.items():
        try:
            ggml = GGMLQuantizationType(code)
            block, type_size = GGML_QUANT_SIZES[ggml]
        except (ValueError, KeyError):
            raise corrupt(f"tensor {name!r} has ggml type {code}, which gguf does not know "
                          "(or a newer GGUF type: upgrade the gguf package)", name) from None
        if dims and dims[0] % block:
            raise corrupt(f"tensor {name!r} is {ggml.name} with rows of {dims[0]}, not a multiple of its "
                          f"{block}-element block", name)
        if offset % alignment:
            raise corrupt(f"tensor {name!r} starts at data offset {offset}, not a multiple of the alignment "
                          f"{alignment}", name)
        nbytes = _numel(dims) // block * type_size
        spans.append((data_start + offset, data_start + offset + nbytes, name, ggml.name, dims))
    spans.sort()
    for (b0, e0, n0, *_), (b1, _, n1, *_) in zip(spans, spans[1:]):
        if b1 < e0:
            raise corrupt(f"tensors {n0!r} (bytes {b0}..{e0}) and {n1!r} (from byte {b1}) overlap", n1)
    if spans and spans[-1][1] > size:
        cut = [t for t in spans if t[1] > size]
        begin, end, name, ggml, dims = cut[0]
        need = spans[-1][1]
        raise DamagedFileError(
            f"{path} is truncated: tensor {name!r} ({ggml}, shape {list(reversed(dims))}) needs bytes {begin}..{end}, "
            f"and the file ends at byte {size} (expected at least {need} bytes, found {size}; {len(cut)} of "
            f"{len(spans)} tensors are cut). {REFETCH}", path, name, expected=need, found=size)


def gguf_reader(path):
    """gguf's GGUFReader of a file `check_gguf` passed; the reader's own errors (it memory-maps the file and parses
    what it finds) re-raised as DamagedFileError."""
    from gguf import GGUFReader

    check_gguf(path)
    try:
        return GGUFReader(path)
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, struct.error) as exc:
        raise DamagedFileError(f"{path} is damaged: gguf's reader cannot parse it ({type(exc).__name__}: {exc}). "
                               f"{REFETCH}", path) from None


# ----------------------------------------------------------------------------------------------- model sources


def check_source(kind: str, where: str) -> tuple[str, str]:
    """Check a model source as `models._classify` resolved it (a GGUF file, or a safetensors folder); hub ids are
    checked when downloaded into a folder. Returns (kind, where) unchanged."""
    if kind == "gguf":
        check_gguf(where)
    elif kind in ("folder", "compressed"):
        check_safetensors_folder(where)
    return kind, where


# ----------------------------------------------------------------------------------------------- resume folders

STREAM_PROGRESS = "progress.json"  # stream_run.StreamCheckpoint's commit point
DISTILL_STATE = "distill_state.json"  # distill.STATE_FILE: a distillation checkpoint's commit point


def check_resume_dir(path) -> None:
    """Raise DamagedFileError unless what a resume would read from `path` is sound: a streamed run's checkpoint
    folder (OUTPUT.work/stream), a distillation checkpoint (checkpoints/step-N), or a run's OUTPUT.work folder (its
    streamed checkpoint and each distillation's newest complete checkpoint). Nothing there: nothing to check."""
    path = Path(path)
    if (path / STREAM_PROGRESS).is_file():
        _check_stream_checkpoint(path)
    elif (path / DISTILL_STATE).is_file():
        _check_distill_checkpoint(path)
    elif path.is_dir():
        if (path / "stream" / STREAM_PROGRESS).is_file():
            _check_stream_checkpoint(path / "stream")
        for work in sorted(path.glob("distill-*")):
            if done := _complete_steps(work):
                _check_distill_checkpoint(done[-1])


def _read_json(path: Path, fix: str) -> dict:
    try:
        state = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DamagedFileError(f"{path} is damaged ({exc}); it was written atomically, so the disk changed it. {fix}",
                               path) from None
    if not isinstance(state, dict):
        raise DamagedFileError(f"{path} is damaged (not a JSON object). {fix}", path)
    return state


def _check_stream_checkpoint(folder: Path) -> None:
    """progress.json, the carried inputs it names (each process's), and the output shards its writer state names
    (in OUTPUT.work/output, where run_streamed stages them)."""
    fix = (f"The checkpoint in {folder} cannot be resumed (a full disk, `df -h`, or a failing one). {RESTART} "
           f"(That removes {folder.parent}.)")
    state = _read_json(folder / STREAM_PROGRESS, fix)
    try:
        if (carried := state.get("carried")) is not None:
            for rank in range(int(state.get("processes", 1))):
                where = folder / (carried if rank == 0 else f"{carried}.rank-{rank}")
                if not where.is_dir():
                    raise DamagedFileError(f"{where} is missing: {folder / STREAM_PROGRESS} names it as the inputs "
                                           f"of block {state.get('next')}. {fix}", where)
                check_safetensors_folder(where, fix)
        writer = state.get("writer")
        if writer:
            stage = folder.parent / "output"
            for name, names in writer["parts"]:
                if absent := [t for t in names if t not in _checked_names(stage / name, fix)]:
                    raise DamagedFileError(f"{stage / name} lacks tensor {absent[0]!r} that the checkpoint wrote to "
                                           f"it. {fix}", stage / name, absent[0])
            if writer.get("data") is not None:
                data = stage / writer["data"]
                found = data.stat().st_size if data.is_file() else 0
                if found < writer["size"]:
                    last = max(writer["header"].items(), key=lambda kv: kv[1]["data_offsets"][1], default=(None,))[0]
                    raise DamagedFileError(
                        f"{data} is truncated: the checkpoint recorded {writer['size']} bytes of output tensors in "
                        f"it (the last {last!r}), found {found}. {fix}", data, last, writer["size"], found)
    except DamagedFileError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise DamagedFileError(f"{folder / STREAM_PROGRESS} is damaged (an entry is missing or of the wrong kind: "
                               f"{type(exc).__name__}: {exc}). {fix}", folder / STREAM_PROGRESS) from None


def _complete_steps(work: Path) -> list[Path]:
    """A distillation's complete checkpoints, oldest first (distill._latest_checkpoint takes the last)."""
    return sorted(p.parent for p in (work / "checkpoints").glob(f"step-*/{DISTILL_STATE}"))


def _check_distill_checkpoint(ckpt: Path) -> None:
    """distill_state.json, the model (and FSDP optimizer) safetensors, and accelerate's optimizer / RNG files whole
    (a torch zip file's directory is at its end; a pickle ends with its STOP byte)."""
    older = [p for p in _complete_steps(ckpt.parent.parent) if p.name < ckpt.name]
    fix = ("The checkpoint cannot be resumed (a full disk, `df -h`, or a failing one). "
           + (f"Delete {ckpt} to resume from the one before it ({older[-1].name}), or run without --resume to "
              "start over." if older else RESTART))
    state = _read_json(ckpt / DISTILL_STATE, fix)
    try:
        if state.get("sharded") == "fsdp":
            files = [ckpt / f"shard-{r}.safetensors" for r in range(int(state.get("processes", 1)))]
        else:
            files = sorted(ckpt.glob("*.safetensors"))
            if not files:
                raise DamagedFileError(f"{ckpt} holds no model weights (*.safetensors). {fix}", ckpt)
    except (TypeError, ValueError) as exc:
        raise DamagedFileError(f"{ckpt / DISTILL_STATE} is damaged ({exc}). {fix}", ckpt / DISTILL_STATE) from None
    for f in files:
        _checked_names(f, fix)
    for f in sorted(ckpt.glob("*.bin")) + sorted(ckpt.glob("*.pt")) + sorted(ckpt.glob("*.pkl")):
        _check_torch_file(f, fix)


def _check_torch_file(f: Path, fix: str) -> None:
    """A torch.save file whole, without unpickling it: a zip (torch's format since 1.6; its directory is at the
    end, and each member must end inside the file), or else a plain pickle ending with its STOP byte."""
    size = f.stat().st_size
    with open(f, "rb") as fh:
        magic = fh.read(4)
        fh.seek(max(size - 1, 0))
        last = fh.read(1)
    if magic == b"PK\x03\x04":
        try:
            with zipfile.ZipFile(f) as zf:
                end = max((i.header_offset + i.compress_size for i in zf.infolist()), default=0)
            if end > size:
                raise zipfile.BadZipFile(f"a member ends past byte {end}")
        except zipfile.BadZipFile as exc:
            raise DamagedFileError(f"{f} is truncated or corrupt ({exc}; {size} bytes). {fix}", f, found=size) from None
    elif f.suffix == ".pkl" and last != b".":  # pickle's STOP opcode ends every pickle
        raise DamagedFileError(f"{f} is truncated (a pickle ends with its STOP byte; {size} bytes). {fix}", f,
                               found=size)
    elif size == 0:
        raise DamagedFileError(f"{f} is empty. {fix}", f, found=0)


__all__ = ["DamagedFileError", "check_safetensors", "check_safetensors_folder", "check_gguf", "gguf_reader",
           "check_source", "check_resume_dir"]
