"""Checksums of every tensor a shipped quantization recipe leaves in a model (QuantLinear buffers and the float
tensors), and of the report sections the run writes (calibration, per-block errors, every stage's section, what was
kept in float), on tiny random Llama, Qwen2 and OPT models, 4 x 32 calibration tokens. Run it in two checkouts and
compare the files: a refactor of the runner, the stages or the quantizers must leave every checksum unchanged.

    python bench/runner_checksums.py OUT.json
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compress.arch import get_arch  # noqa: E402
from compress.core.nn import QuantLinear  # noqa: E402
from compress.pipeline.calibration import compress_model  # noqa: E402
from compress.recipe import load_recipe  # noqa: E402
from compress.stages import make_plan  # noqa: E402
from tests.conftest import make_tiny_model  # noqa: E402
from tests.tiny_tokenizer import make_tiny_tokenizer  # noqa: E402

RECIPES = ("int4_rtn", "int8_absmax", "gptq_int4", "awq_int4", "awq_gptq_int4", "awq_int3", "smoothquant_w8a8",
           "llm_int8", "fp8_dynamic", "fp8_static_kv", "hqq_int4", "int8_zeropoint")
FAMILIES = ("llama", "qwen2", "opt")


def checksum(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, m in sorted(model.named_modules()):
        if isinstance(m, QuantLinear):
            for t in (m.qdata, m.scale, m.zero_point, m.input_scale, m.outlier_cols):
                if t is not None:
                    h.update(name.encode())
                    h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    for name, t in sorted(model.state_dict().items()):
        if t.is_floating_point() and t.element_size() > 1:
            h.update(name.encode())
            h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    torch.set_num_threads(1)
    out = {}
    for family in FAMILIES:
        for name in RECIPES:
            recipe = load_recipe(ROOT / "recipes" / f"{name}.yaml",
                                 ["calibration.n_samples=4", "calibration.seq_len=32"])
            model = make_tiny_model(family)
            arch = get_arch(model)
            sections, _ = compress_model(model, make_tiny_tokenizer(), recipe, make_plan(model, arch, recipe.stages),
                                         "cpu", progress=False, log=lambda m: None)
            out[f"{family}/{name}"] = checksum(model)
            # the report sections the run writes (calibration, block errors, each stage's section, kept in float)
            out[f"{family}/{name}/report"] = hashlib.sha256(json.dumps(sections, sort_keys=True, default=str)
                                                            .encode()).hexdigest()
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
    print(f"{len(out)} checksums written to {sys.argv[1]}")


if __name__ == "__main__":
    main()
