"""A GGUF file read tensor by tensor, for the streamed run: each tensor is dequantized when its block is reached.

transformers converts a GGUF file as a whole (every tensor dequantized to float32 in memory); for a model that does
not fit, that is the whole model resident at once. This reads the file memory-mapped (gguf's GGUFReader), and on
`get(name)` dequantizes the one tensor and applies the same per-tensor conversion transformers applies (its tensor
name map and its architecture's tensor processor, e.g. Llama's q/k head permutation undone), so the tensors equal
transformers' bit for bit (test). Architectures whose processor spreads one GGUF tensor over several of the model's
(mixture-of-experts layouts) or reads other tensors are not read this way: `gguf_tensor_source` returns None and the
streamed run converts them whole, as before, and says so.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from .integrity import gguf_reader

# processors whose process(weights, name) depends on that tensor alone and keeps its name (transformers 5)
_PER_TENSOR = ("TensorProcessor", "LlamaTensorProcessor")


class GGUFSource:
    """names() / get(name) of a GGUF file, in the model's state-dict names (see the module docstring)."""

    def __init__(self, reader, processor, mapping: dict[str, str]):
        self.reader, self.processor = reader, processor
        self.mapping = mapping  # GGUF tensor name -> the model's name
        self.index = {mapping[t.name]: k for k, t in enumerate(reader.tensors) if t.name in mapping}

    def names(self) -> set[str]:
        return set(self.index)

    def get(self, name: str) -> Tensor:
        from gguf import dequantize

        tensor = self.reader.tensors[self.index[name]]
        weights = dequantize(tensor.data, tensor.tensor_type)
        result = self.processor.process(weights=weights, name=tensor.name, tensor_key_mapping=self.mapping,
                                        parsed_parameters={})  # read only by the MoE processors
        return torch.from_numpy(np.copy(result.weights))


def gguf_tensor_source(path: str, skeleton: nn.Module) -> GGUFSource | None:
    """The file's tensors one at a time, named as `skeleton` (a meta model built from the file's config) names them;
    None where the architecture's conversion is not per tensor."""
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map, read_field)

    reader = gguf_reader(path)  # checked first; its odd errors on a damaged file made clear (integrity.py)
    architecture = read_field(reader, "general.architecture")[0]
    cls = TENSOR_PROCESSORS.get(architecture, TensorProcessor)
    if cls.__name__ not in _PER_TENSOR:
        return None
    processor = cls(config=skeleton.config.to_dict())  # Llama's reads the head counts, named as in the HF config
    mapping = _name_map(reader, architecture, skeleton)
    if mapping is None:  # transformers' map also tries every submodule's names (slower: seconds on a 135M model)
        mapping = get_gguf_hf_weights_map(skeleton, processor)
    return GGUFSource(reader, processor, mapping)


def _name_map(reader, architecture: str, skeleton: nn.Module) -> dict[str, str] | None:
    """GGUF tensor name -> the model's name by gguf's table for the file's own architecture (the table the GGUF
    writer names its tensors by, export/gguf_names.py), from the model's full names; None when that leaves a tensor
    of the file unnamed."""
    from ..export.gguf_names import gguf_name, tensor_name_map

    table = tensor_name_map(architecture, skeleton.config.get_text_config().num_hidden_layers)
    if table is None:
        return None
    mapping = {}
    for name in skeleton.state_dict(keep_vars=True):
        found = gguf_name(table, name)
        if found is not None:
            mapping[found] = name
    return mapping if all(t.name in mapping for t in reader.tensors) else None
