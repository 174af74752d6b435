"""Every export format on the embedded model (SmolLM2-135M-Instruct), checked where an export can go wrong.

On a tiny random model the next-token distribution is nearly uniform, so a wrong layer moves KL by less than any
bar. Here, per format:
- every quantized layer, read back from the file by an independent reader (or the format library's own), equals
  our dequantized weight tensor for tensor (bit for bit where the format stores our codes and scales);
- the export, reloaded through its loader, predicts what our compressed model predicts on WikiText-2 test text:
  top-1 agreement, and KL(ours ‖ export) against the KL the quantization itself costs, KL(float ‖ ours), on the
  same windows. One wrong layer costs a share of the quantization's own KL far above these bars: zeroing one
  layer of the int4 g32 model measured KL 0.05 (block 29 v_proj), 0.08 (block 10 q_proj) and 0.42 (block 10
  down_proj) against the quantization's 0.33.
GGUF Q8_0 and F16 on this model: tests/test_export_gguf.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from compress.arch import get_arch
from compress.export import export_model
from compress.export.verify import compare_logits, export_logits, model_logits
from compress.core.nn import QuantLinear
from compress.stages.quantize import QuantizeStage, apply_quantize, plan_quantize
from compress.core.scheme import QuantScheme, scheme
from tests.conftest import requires_data
from tests.test_export_awq_gptq import unpack_awq, unpack_gptq
from tests.test_export_gguf import HF_TO_GGUF, decode, heads_for, read_tensors, unpermute_rows

pytestmark = requires_data
pytest.importorskip("compressed_tensors")
pytest.importorskip("llama_cpp")

INT4_ASYM_G32 = scheme("int4", "group", 32, symmetric=False)
INT4_SYM_G32 = scheme("int4", "group", 32)
# format: (scheme, max KL(ours || export) as a share of KL(float || ours), min top-1 agreement with ours)
CASES = {
    # bfloat16 scales: the dtype vLLM holds them in for this bf16 model, so the file is our model bit for bit
    "compressed-tensors": (scheme("int4", "group", 64, symmetric=False, scale_dtype="bfloat16"), 0.01, 0.99),
    "awq": (INT4_ASYM_G32, 0.01, 0.99),  # float tensors in float16 (AWQ's dtype): measured KL ~1e-4 of int4's
    "gptq": (INT4_SYM_G32, 0.01, 0.99),
    "fp8": (QuantScheme("fp8_e4m3", "tensor", None, True, "float32"), 0.01, 0.99),
    "dense": (scheme("int8", "channel"), 0.1, 0.98),  # weights rounded to bfloat16: ~2% of int8's own small KL
    # llama.cpp quantizes activations to 8-bit blocks for Q4 matmuls and keeps an fp16 KV cache: its own KL is
    # ~1% of int4's (test_export_gguf.py explains the near-tie flips behind ~96% top-1)
    "gguf-q4_0": (INT4_SYM_G32, 0.1, 0.93),
    "gguf-q4_1": (INT4_ASYM_G32, 0.1, 0.93),
}


class Embedded:
    """The float model, two WikiText-2 test windows of 256 tokens, and quantized copies made on demand."""

    def __init__(self):
        from compress.pipeline.report import eval_windows
        from compress.model.load import default_model_path, load_model

        loaded = load_model("default")
        self.float, self.tokenizer, self.gguf = loaded.model, loaded.tokenizer, str(default_model_path())
        self.windows = eval_windows(self.tokenizer, "test", 256, 2)
        self.float_logits = model_logits(self.float, self.windows)
        self._models: dict = {}

    def quantized(self, sch: QuantScheme):
        if sch not in self._models:
            import copy

            model = copy.deepcopy(self.float)
            stage = QuantizeStage(scheme=sch)
            apply_quantize(model, plan_quantize(model, get_arch(model), stage), stage)
            self._models[sch] = (model, model_logits(model, self.windows))
        return self._models[sch]


@pytest.fixture(scope="module")
def embedded():
    return Embedded()


def stored_weights(fmt: str, folder, model) -> dict[str, torch.Tensor]:
    """Each quantized layer's weight [N, K] as the file stores it, decoded without our exporters' code."""
    if fmt.startswith("gguf-"):
        kind = fmt.split("-")[1].upper()
        tensors = read_tensors(next(folder.glob("*.gguf")))
        out = {}
        for i in range(model.config.num_hidden_layers):
            for hf, gname in HF_TO_GGUF.items():
                vals = torch.from_numpy(decode(np.array(tensors[f"blk.{i}.{gname}.weight"].data), kind)[0])
                heads = heads_for(gname, model.config)
                out[f"model.layers.{i}.{hf}"] = unpermute_rows(vals, heads) if heads else vals
        return out
    t = load_file(str(folder / "model.safetensors"))
    names = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    if fmt == "compressed-tensors":
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        out = {}
        for n in names:  # the library's own unpacker; codes are stored signed (code - 8)
            shape = torch.Size(t[f"{n}.weight_shape"].tolist())
            q = unpack_from_int32(t[f"{n}.weight_packed"], 4, shape).float()
            scale = t[f"{n}.weight_scale"].float()
            zp = unpack_from_int32(t[f"{n}.weight_zero_point"], 4, torch.Size([shape[0], scale.shape[1]]),
                                   packed_dim=0).float()
            g = shape[1] // scale.shape[1]
            out[n] = (q - zp.repeat_interleave(g, 1)) * scale.repeat_interleave(g, 1)
        return out
    if fmt == "awq":
        return {n: unpack_awq(t[f"{n}.qweight"], t[f"{n}.qzeros"], t[f"{n}.scales"]) for n in names}
    if fmt == "gptq":
        return {n: unpack_gptq(t[f"{n}.qweight"], t[f"{n}.qzeros"], t[f"{n}.scales"], t[f"{n}.g_idx"], 4)
                for n in names}
    if fmt == "fp8":
        return {n: t[f"{n}.weight"].float() * t[f"{n}.weight_scale"].float() for n in names}
    return {n: t[f"{n}.weight"].float() for n in names}  # dense


# awq, fp8 and gguf-q4_1 (15-21 s each) run with the slow set: their layouts are checked on tiny models by default
SLOW = ("awq", "fp8", "gguf-q4_1")


@pytest.mark.parametrize("fmt", [pytest.param(f, marks=pytest.mark.slow) if f in SLOW else f for f in CASES])
def test_export_of_the_embedded_model(fmt, embedded, tmp_path):
    sch, kl_share, min_top1 = CASES[fmt]
    model, ours = embedded.quantized(sch)
    out = tmp_path / fmt
    export_model(model, embedded.tokenizer, fmt, out, source_gguf=embedded.gguf if fmt.startswith("gguf") else None)

    stored = stored_weights(fmt, out, model)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert sorted(stored) == sorted(layers) and len(layers) == 210
    for name, m in layers.items():
        w = m.qtensor().dequantize(torch.float32)
        if fmt == "dense":  # dequantized, then stored in bfloat16
            assert torch.equal(stored[name], w.to(torch.bfloat16).float()), name
        elif fmt == "gguf-q4_1":  # Q4_1 stores the group minimum m = -z·s in float16: it rounds, by half an ulp
            bound = (w.abs().amax(1, keepdim=True) * 2 ** -11).expand_as(w)
            assert bool(((stored[name] - w).abs() <= bound).all()), name
        else:
            assert torch.equal(stored[name], w), name

    _, theirs = export_logits(out, embedded.windows)
    quantization = compare_logits(embedded.float_logits, ours)["kl"]
    export = compare_logits(ours, theirs)
    assert quantization > 1e-3  # the quantization is visible on this model, so the bar below means something
    assert export["kl"] < kl_share * quantization, (export, quantization)
    assert export["top1_agreement"] >= min_top1, export
