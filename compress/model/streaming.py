"""Weights streamed from disk: a model whose decoder blocks live on the meta device until the runner reaches them.

`open_streamed` builds the model skeleton from its config (no weight read), materialises what lies outside the
decoder blocks (embeddings, final norm, head) at the run's dtype, and returns a `Streamed` whose `load(i)` reads
block i's tensors from the checkpoint files and `release(block)` sends the block back to the meta device. Memory is
then the outside modules plus one block, whatever the model's size.

Sources: a local safetensors folder (read tensor by tensor with plain file reads, `shards.ShardReader`: the file's
pages never count in the resident set), a hub id (its safetensors files downloaded first), or a GGUF file (the
default model among them) read tensor by tensor, each dequantized when its block is reached (`gguf_source.py`);
a GGUF architecture whose conversion is not per tensor is converted whole by transformers (resident once).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from ..arch import ArchSpec, get_arch, get_module
from ..core.profile import phase_of
from .gguf_source import gguf_tensor_source
from .integrity import check_safetensors_folder
from ..arch.moe import hub_names, moe_blocks, split_expert
from ..export.shards import ShardReader

STREAM_KINDS = ("folder", "hub", "gguf", "default")


class StateSource:
    """Tensors from a model already in memory (a GGUF file transformers converted as a whole)."""

    def __init__(self, state: dict[str, Tensor]):
        self.state = state

    def names(self) -> set[str]:
        return set(self.state)

    def get(self, name: str) -> Tensor:
        return self.state[name]


@dataclass
class Streamed:
    """A skeleton model whose blocks are read from `source` one at a time (see the module docstring)."""

    model: nn.Module
    arch: ArchSpec
    source: object  # ShardReader or StateSource: names(), get(name)
    dtype: torch.dtype
    keys: dict[str, str]  # the model's state-dict name -> the checkpoint's tensor name
    where: str  # what the weights are read from, for the report
    tokenizer: object = None
    source_name: str = ""  # the source as resolved (a path or hub id)
    kind: str = ""  # folder | hub | gguf | default
    loaded_blocks: int = field(default=0)
    keep: frozenset = frozenset()  # tensors read at their stored dtype (a compressed model's codes and scales)
    fused: dict = field(default_factory=dict)  # experts module -> (layout, fused name -> checkpoint name)

    def _state(self, prefix: str, module: nn.Module, skip: str | None = None, profile=None) -> dict[str, Tensor]:
        """The tensors of `module` (at `prefix`) read from the checkpoint at the run's dtype, except those under
        `skip` (timed as phases read and convert of `profile`, a core.profile.Profile, when given)."""
        return self._convert(self._read(prefix, module, skip, profile), prefix, profile)

    def _read(self, prefix: str, module: nn.Module, skip: str | None = None, profile=None) -> dict[str, Tensor]:
        """The tensors of `module` (at `prefix`, but those under `skip`) as the checkpoint stores them."""
        out, blocks = {}, {}
        for rel in module.state_dict(keep_vars=True):
            full = f"{prefix}.{rel}" if prefix else rel
            if full not in self.keys or (skip is not None and full.startswith(skip + ".")):
                continue
            key = self.keys[full]
            if key.startswith(FUSED):  # expert e's slice of its block's fused tensors, each read once per call
                moe, e, part = key[len(FUSED):].split("|")
                if moe not in blocks:
                    layout, files = self.fused[moe]
                    blocks[moe] = (layout, {n: self.source.get(f) for n, f in files.items()})
                t = split_expert(blocks[moe][0], blocks[moe][1], int(e))[part].contiguous()
            else:
                with phase_of(profile, "read"):
                    t = self.source.get(key)
                if profile is not None:
                    profile.add_work("read", nbytes=t.numel() * t.element_size())
            out[rel] = t
        return out

    def _convert(self, stored: dict[str, Tensor], prefix: str, profile=None) -> dict[str, Tensor]:
        """Tensors as read (`_read`) at the run's dtype (but `keep`'s)."""
        out = {}
        with phase_of(profile, "convert"):
            for rel, t in stored.items():
                full = f"{prefix}.{rel}" if prefix else rel
                out[rel] = t.to(self.dtype) if t.is_floating_point() and full not in self.keep else t
        return out

    def read_block(self, i: int, profile=None) -> dict[str, Tensor]:
        """Block i's tensors as the checkpoint stores them, for `load` (safe on a helper thread: it only reads)."""
        prefix = f"{self.arch.blocks}.{i}"
        return self._read(prefix, get_module(self.model, prefix), profile=profile)

    def load(self, i: int, profile=None, stored: dict[str, Tensor] | None = None) -> nn.Module:
        """Decoder block i with its weights at the run's dtype: `stored` (read_block's, read ahead) or read now
        (`profile`: see _state)."""
        prefix = f"{self.arch.blocks}.{i}"
        block = get_module(self.model, prefix)
        if stored is None:
            stored = self._read(prefix, block, profile=profile)
        block.load_state_dict(self._convert(stored, prefix, profile), strict=True, assign=True)
        self.loaded_blocks += 1
        return block

    @staticmethod
    def release(block: nn.Module) -> None:
        """Back to the meta device: the block's memory is freed (its structure and QuantLinear schemes stay)."""
        to_meta(block)

    def load_outside(self, skip: str | None = None) -> None:
        """Read everything outside the decoder blocks (embeddings, final norm, head) but the module at `skip` (left
        on the meta device unless it is tied to what is read), and tie the head again."""
        blocks = self.arch.blocks
        state = self._state("", self.model, skip=blocks)
        if skip is not None and not self.tied:
            state = {k: v for k, v in state.items() if not k.startswith(skip + ".")}
        self.model.load_state_dict(state, strict=False, assign=True)
        self.model.tie_weights()
        still = [n for n, p in self.model.named_parameters() if p.is_meta and not n.startswith(blocks + ".")
                 and not (skip is not None and n.startswith(skip + "."))]
        if still:
            raise ValueError(f"{self.where}: weights outside the decoder blocks were not found: {still[:5]}")

    @property
    def tied(self) -> bool:
        """Whether the head shares the input embedding's weight."""
        return bool(getattr(self.model.config.get_text_config(), "tie_word_embeddings", False))

    def release_outside(self) -> None:
        """The embeddings and the head leave memory while the blocks pass (the runner has its block-0 inputs):
        `load_outside` reads the head again for its quantization and the scoring."""
        for path in dict.fromkeys((self.arch.embed, self.arch.lm_head)):
            to_meta(get_module(self.model, path))

    def outside_tensors(self, path: str, save_dtype: torch.dtype):
        """(name, tensor) of the module at `path` read from the checkpoint as the in-memory run would save them
        (at the run's dtype, then `save_dtype`), without holding the module: the embedding's way to the output."""
        module = get_module(self.model, path)
        for rel in module.state_dict(keep_vars=True):
            full = f"{path}.{rel}"
            if full in self.keys:
                t = self.source.get(self.keys[full])
                yield full, (t.to(self.dtype).to(save_dtype) if t.is_floating_point() else t)


def trim_heap() -> None:
    """Hand the allocator's free memory back to the system (glibc's malloc_trim) after a block leaves: tensors
    below glibc's mmap threshold (32 MB once raised) are freed into the heap, which otherwise keeps the pages and
    grows the resident set block after block. Elsewhere a no-op."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def to_meta(module: nn.Module) -> None:
    """Parameters and persistent buffers to the meta device (what a checkpoint holds and loading restores);
    non-persistent buffers (Gemma's embedding scale, rotary tables) stay, since no checkpoint would restore them."""
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                m._parameters[name] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                m._buffers[name] = torch.empty_like(b, device="meta")


def _renamed(model: nn.Module, names: set[str]) -> dict[str, str]:
    """The checkpoint's tensor names as the model names them, through transformers' own renamings for this
    architecture (GPT-NeoX's `embed_out` is `lm_head`, old `LayerNorm.gamma` is `.weight`, ...); transforms that
    merge or split tensors (stacked MoE experts) are not renamings, and a name they would produce stays missing."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
        renamings = [c for c in get_model_conversion_mapping(model) if type(c) is WeightRenaming]
    except ImportError:  # an older transformers: checkpoints use the model's names
        renamings = []
    out = {}
    for name in names:
        key = name
        for r in renamings:
            key = r.rename_source_key(key)[0]
        out[key] = name
    return out


FUSED = "fused:"  # a key naming expert e's tensor inside its block's fused checkpoint tensors


def _checkpoint_names(model: nn.Module, have: set[str], tied: set[str],
                      hub: bool = True) -> tuple[dict[str, str], dict]:
    """Map the model's state-dict names to the checkpoint's: equal after transformers' renamings, or differing by
    the base model's prefix (a checkpoint saved from the base model). Tied weights absent from the file are tied
    again after loading. A family whose checkpoints store the experts fused (gpt-oss) maps each expert's tensor to
    its block's fused tensors (returned as experts module -> (layout, fused name -> checkpoint name)). Raises
    ValueError naming what is missing."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    renamed = _renamed(model, have)
    # a MoE expert's layer under the family's checkpoint name (Mixtral's experts.{e}.w1); a compress checkpoint
    # (hub=False) names them as compress does
    hub = hub_names(model) if hub else hub_names(nn.Module())

    def find(name: str) -> str | None:
        candidates = [name] + ([hub.tensor(name)] if hub.projections else [])
        if prefix and name.startswith(prefix + "."):
            candidates.append(name[len(prefix) + 1:])
        elif prefix:
            candidates.append(f"{prefix}.{name}")
        return next((renamed.get(c, c) for c in candidates if c in renamed or c in have), None)

    keys, missing = {}, []
    fused = {}  # experts stored fused (gpt-oss): expert e's tensors are sliced from the block's fused ones
    if hub.fused:
        for moe, block in moe_blocks(model).items():
            files = {n: find(f"{moe}.{n}") for n in block.layout.fused_names()}
            missing += [f"{moe}.{n}" for n, f in files.items() if f is None]
            fused[moe] = (block.layout, files)
    for name in model.state_dict(keep_vars=True):
        moe = next((m for m in fused if name.startswith(m + ".")), None)
        if moe is not None:
            e, _, part = name[len(moe) + 1:].partition(".")
            keys[name] = f"{FUSED}{moe}|{e}|{part}"
            continue
        found = find(name)
        if found is not None:
            keys[name] = found
        elif name not in tied:
            missing.append(name)
    if missing:
        raise ValueError(f"the checkpoint lacks tensors the model's config implies: {missing[:5]} "
                         f"({len(missing)} in all); it cannot be streamed block by block. Set model.stream: false "
                         "to load it through transformers as a whole.")
    return keys, fused


def _tied_names(model: nn.Module) -> set[str]:
    """State-dict names that share storage with an earlier one (lm_head.weight tied to the embedding)."""
    seen, tied = set(), set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            tied.add(name)
        seen.add(id(t))
    return tied


def check_streamable(model: nn.Module, arch: ArchSpec) -> str | None:
    """Why this model's evaluation cannot be streamed block by block (None when it can): after the last block the
    run applies the final norm and the head itself, so the family must name its final norm and add nothing else."""
    if not arch.final_norm:
        return f"model family {arch.family!r} has no final_norm entry in compress/arch/tables.py"
    if getattr(get_module(model, arch.blocks.rpartition(".")[0]), "project_out", None) is not None:
        return "this model projects the final hidden states (OPT project_out) after its final norm"
    return None


def open_streamed(kind: str, where: str, dtype: torch.dtype, revision: str | None = None,
                  trust_remote_code: bool = False) -> Streamed:
    """The skeleton with its outside modules materialised, for a source `models._classify` resolved."""
    from .load import load_model, model_skeleton

    from transformers import AutoTokenizer

    name, given = where, kind
    if kind == "hub":
        where = _download(where, revision)
        kind = "folder"
    if kind not in ("gguf", "default", "folder"):
        raise ValueError(f"a {kind} model cannot be streamed; set model.stream: false")
    where, _, model = model_skeleton(where, revision, trust_remote_code, dtype)
    model.tie_weights()  # the meta skeleton is built untied; tied names are then found by identity
    if kind in ("gguf", "default"):  # read tensor by tensor where the conversion allows (gguf_source.py)
        source = gguf_tensor_source(where, model)
        origin = f"{where} (GGUF, tensor by tensor)"
        folder, file = os.path.split(where)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
        if source is None:  # transformers converts it as a whole: its state dict is the source
            loaded = load_model(where, str(dtype).replace("torch.", ""), "cpu", revision, trust_remote_code)
            source, origin = StateSource(loaded.model.state_dict()), f"{where} (converted whole by transformers)"
            del loaded
    else:
        source, origin = ShardReader(where), f"{where} (safetensors, tensor by tensor)"
        tokenizer = AutoTokenizer.from_pretrained(where, trust_remote_code=trust_remote_code)
    arch = get_arch(model)
    for block in arch.block_list(model):  # persistent buffers are read with their block (see open_compressed)
        to_meta(block)
    if why := check_streamable(model, arch):
        raise ValueError(f"cannot stream this model: {why}. Set model.stream: false.")
    keys, fused = _checkpoint_names(model, source.names(), _tied_names(model))
    streamed = Streamed(model, arch, source, dtype, keys, origin, tokenizer, name, given, fused=fused)
    streamed.load_outside(skip=arch.lm_head)  # the head is read when it is needed, after the blocks
    return streamed


def open_compressed(folder: str | Path) -> Streamed:
    """A compress checkpoint (save_compressed, or a streamed run's output) opened to be read block by block: the
    skeleton with its QuantLinear layers on the meta device, nothing materialised. Float tensors are read at the
    checkpoint's own dtype (output.save_dtype), codes and scales at theirs."""
    from transformers import AutoTokenizer

    from ..export.native import COMPRESS_META, compressed_skeleton

    folder = Path(folder)
    check_safetensors_folder(folder)  # a truncated or corrupt shard is refused before any block is read
    reader = ShardReader(folder)
    meta = json.loads((folder / COMPRESS_META).read_text())
    dtype = getattr(torch, meta.get("save_dtype", "bfloat16"))
    model, keep = compressed_skeleton(folder, dtype, {n: reader.shape(n)[0] for n in reader.names()})
    model.tie_weights()
    arch = get_arch(model)
    for block in arch.block_list(model):  # the skeleton's persistent buffers (DeepSeek's routing bias) are real
        to_meta(block)  # zeros: a block's are read with it, not written with every other part
    keys, _ = _checkpoint_names(model, reader.names(), _tied_names(model), hub=False)
    return Streamed(model.eval(), arch, reader, dtype, keys, f"{folder} (compress checkpoint, block by block)",
                    AutoTokenizer.from_pretrained(folder), str(folder), "compressed", keep=frozenset(keep))


def stream_parts(streamed: Streamed, progress: bool = False):
    """Materialise the model one part at a time: each decoder block in turn (released before the next), then what
    lies outside the blocks. Yields a label per part; whatever reads the model meanwhile sees one part resident and
    the rest on the meta device (a streamed export writes the part's tensors, `export/hf.py`)."""
    from tqdm.auto import tqdm

    n = len(streamed.arch.block_list(streamed.model))
    for i in tqdm(range(n), desc="blocks", disable=not progress, leave=False):
        block = streamed.load(i)
        yield f"block {i}"
        streamed.release(block)
        trim_heap()
    streamed.load_outside()
    yield "outside the blocks"
    for path in dict.fromkeys((streamed.arch.embed, streamed.arch.lm_head, streamed.arch.final_norm)):
        to_meta(get_module(streamed.model, path))
    trim_heap()


def _download(repo: str, revision: str | None) -> str:
    """The hub model's config, tokenizer and safetensors files in the local cache (nothing is unpickled)."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo, revision=revision,
                                 allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"])
    except Exception as exc:  # noqa: BLE001 - any hub failure gets the same advice
        raise OSError(f"could not download {repo!r} from the hub: {exc}. Use a local folder instead.") from exc


__all__ = ["Streamed", "open_streamed", "open_compressed", "stream_parts", "check_streamable", "STREAM_KINDS"]
