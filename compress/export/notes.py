"""What a serving engine does with an export, as measured (bench/engines.py, docs/engines.md): written into the export's
record (export.json `notes`, printed by `compress export` and in the run's report) so that a user learns it before
serving, not from the engine's traceback. Facts about vLLM 0.32 (its CPU build measured here; its CUDA build read from
its source where stated), keyed by the layers' schemes."""
from __future__ import annotations

from torch import nn

# the engine versions whose loaders the export layouts were last run against (bench/engines.py, docs/engines.md);
# export.json records them beside the library versions it was written with
CHECKED_WITH = {"vllm": "0.32.0 (CPU build)", "llama.cpp": "llama-cpp-python 0.3.36",
                "mlx-lm": "0.32.2 (mlx-cpu 0.32.4, Linux)"}

W4A8 = ("vLLM's CPU build runs int4 weight-only layers with int8 activations by default (VLLM_CPU_INT4_W4A8=1, on "
        "AMX CPUs in bfloat16), which serves a visibly different model (docs/engines.md measures it); serve with "
        "VLLM_CPU_INT4_W4A8=0 to get the exported one")
CPU_INT4_ONLY = ("vLLM's CPU build serves weight-only integer layers at 4 bits only (CPUWNA16LinearKernel: uint4 / "
                 "uint4b8) and refuses these {bits}-bit layers; its CUDA build reads 2-8 bits (compressed-tensors "
                 "WNA16 types; not run here)")
GPTQ_ASYM = ("vLLM refuses asymmetric GPTQ checkpoints in every build (AutoGPTQConfig takes bits 4 / 8 with sym=true "
             "only); serve this model in vLLM from its compressed-tensors or awq export, or quantize with "
             "symmetric: true")
CPU_NO_STATIC_FP8 = ("vLLM's CPU build has no static fp8 activation kernel (_C::static_scaled_fp8_quant is not "
                     "built); it serves these layers on a GPU only (compute capability 8.9+)")

CPU_NO_FP4 = ("vLLM's CPU build has no NVFP4 / MXFP4 kernel (\"Marlin FP4 not available\", \"Failed to find a kernel "
              "that can implement\"): these layers serve on a GPU only")


def vllm_notes(model: nn.Module, fmt: str) -> list[str]:
    from .hf import quant_layers

    if fmt.startswith("gguf-") or fmt in ("dense", "native", "mlx"):
        return []
    schemes = {m.scheme for m in quant_layers(model).values()}
    weight_only_int = {s for s in schemes if s.act is None and not s.is_float and not s.is_micro}
    notes = []
    if any(s.bits == 4 for s in weight_only_int) and fmt in ("compressed-tensors", "awq", "gptq"):
        notes.append(W4A8)
    if other := sorted({s.bits for s in weight_only_int if s.bits != 4}):
        notes.append(CPU_INT4_ONLY.format(bits=" / ".join(map(str, other))))
    if fmt == "gptq" and any(not s.symmetric for s in weight_only_int):
        notes.append(GPTQ_ASYM)
    if any(s.is_float and not s.is_micro and s.act is not None and not s.act.dynamic for s in schemes):
        notes.append(CPU_NO_STATIC_FP8)
    if fmt in ("compressed-tensors", "modelopt-nvfp4") and any(s.is_micro and s.dtype == "fp4_e2m1" for s in schemes):
        notes.append(CPU_NO_FP4)
    return notes


def serving_notes(model: nn.Module, fmt: str) -> list[str]:
    """Every engine's notes on serving `model` exported as `fmt`."""
    return vllm_notes(model, fmt)
