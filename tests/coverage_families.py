"""The coverage matrix's families: every decoder-only text family of transformers 5.25 that compress claims, and the
vision-language models whose language model it quantizes, as a tiny random model of its own config class, and what
running RTN, GPTQ and AWQ on it gives (tests/test_coverage.py checks it, bench/coverage_matrix.py writes
docs/coverage.md from it).

The tiny models come from compress/arch/tiny.py (hidden 64, 4 heads of 16, 4 experts, the fewest layers that hold
every kind of layer), with grouped heads (2 key/value heads, as real models have) and, where a family has sliding
windows, windows of 32 tokens under 64-token calibration windows (the issue 45 bar). `KNOWN` holds what does not
work today, with the reason: the matrix asserts that it still fails that way, so a fix has to update it.
"""
from __future__ import annotations

import copy
import math
import traceback
import warnings
from dataclasses import dataclass, field

import torch
import transformers

SEQ_LEN, N_SAMPLES, WINDOW = 64, 2, 32
METHODS = ("rtn", "gptq", "awq")
SCHEME = {"dtype": "int4", "group_size": 16}
STAGES = {
    "rtn": [{"stage": "quantize", "method": "rtn", "scheme": SCHEME}],
    "gptq": [{"stage": "quantize", "method": "gptq", "scheme": SCHEME}],
    "awq": [{"stage": "awq", "n_grid": 4, "search_samples": 1},
            {"stage": "quantize", "method": "rtn", "scheme": SCHEME}],
}
REPLAY_TOLERANCE = 1e-5


@dataclass(frozen=True)
class Family:
    model_type: str
    name: str  # as users call it
    issue: bool = True  # one of the 37 families of issue 45
    overrides: dict = field(default_factory=dict)


# the 16 families of compress/arch/tables.py before issue 47, the 21 others of issue 45, and a few more of
# transformers 5.25 (Seed-OSS has a table entry since issue 47 item 5)
FAMILIES: dict[str, Family] = {f.model_type: f for f in [
    Family("llama", "Llama"), Family("mistral", "Mistral"), Family("qwen2", "Qwen2"), Family("qwen3", "Qwen3"),
    Family("gemma", "Gemma"), Family("gemma2", "Gemma 2"), Family("phi3", "Phi-3"), Family("opt", "OPT"),
    Family("gpt_neox", "GPT-NeoX (Pythia)"), Family("gpt2", "GPT-2"), Family("mixtral", "Mixtral"),
    Family("qwen2_moe", "Qwen2-MoE"), Family("qwen3_moe", "Qwen3-MoE"), Family("olmoe", "OLMoE"),
    Family("gpt_oss", "gpt-oss"), Family("deepseek_v3", "DeepSeek-V3"),
    Family("qwen3_5_text", "Qwen3.5"), Family("qwen3_5_moe_text", "Qwen3.5-MoE"), Family("qwen3_next", "Qwen3-Next"),
    Family("gemma3_text", "Gemma 3"), Family("gemma4_text", "Gemma 4"), Family("olmo2", "OLMo 2"),
    Family("olmo3", "OLMo 3"), Family("granite", "Granite 3"), Family("granitemoehybrid", "Granite 4 (hybrid)"),
    Family("glm4", "GLM-4"), Family("glm4_moe", "GLM-4.5 (MoE)"), Family("exaone4", "EXAONE 4"),
    Family("smollm3", "SmolLM3"), Family("ministral3", "Ministral 3"), Family("falcon_h1", "Falcon-H1"),
    Family("nemotron_h", "Nemotron-H"), Family("jamba", "Jamba"), Family("bamba", "Bamba"),
    Family("kimi_linear", "Kimi-Linear"), Family("llama4_text", "Llama 4"), Family("cohere2", "Command R7B (Cohere 2)"),
    Family("cohere", "Command R (Cohere)", issue=False), Family("phi", "Phi-2", issue=False),
    Family("starcoder2", "StarCoder2", issue=False), Family("ernie4_5", "ERNIE 4.5", issue=False),
    Family("seed_oss", "Seed-OSS", issue=False),
    # vision-language models (issue 48): their language model, calibrated on text; the vision tower stays float
    Family("qwen2_5_vl", "Qwen2.5-VL", issue=False, overrides=dict(num_key_value_heads=2)),
    Family("qwen3_vl", "Qwen3-VL", issue=False, overrides=dict(num_key_value_heads=2)),
    Family("gemma3", "Gemma 3 (vision)", issue=False, overrides=dict(num_key_value_heads=2, sliding_window=WINDOW)),
    Family("mllama", "Llama 3.2 Vision", issue=False, overrides=dict(num_key_value_heads=2)),
    Family("mistral3", "Mistral 3 (Small 3.1 vision)", issue=False, overrides=dict(num_key_value_heads=2)),
]}

# what fails today, per family: method (or "all") -> a part of the error, and whether it is a refusal (a clear
# ValueError naming the cause and the fix) or an error (a raw exception: a bug)
KNOWN: dict[str, dict[str, tuple[str, str]]] = {}  # family -> method (or "all") -> (status, reason): none today


def known(family: str, method: str) -> tuple[str, str] | None:
    entry = KNOWN.get(family, {})
    return entry.get(method) or entry.get("all")


def tiny_family_config(family: str):
    from compress.arch.tiny import tiny_config
    base = transformers.AutoConfig.for_model(family)
    # grouped heads as real models have them; not under multi-head latent attention (its keys have every head)
    mla = getattr(base, "kv_lora_rank", None) is not None
    overrides = {"num_key_value_heads": 2} if hasattr(base, "num_key_value_heads") and not mla else {}
    if getattr(base, "sliding_window", None):
        overrides["sliding_window"] = WINDOW
    return tiny_config(base, {**overrides, **FAMILIES[family].overrides})


_MODELS: dict[str, torch.nn.Module] = {}


def family_model(family: str) -> torch.nn.Module:
    """A fresh copy of the family's tiny random model (built once per process: the matrix shares them)."""
    if family not in _MODELS:
        from compress.arch.tiny import tiny_model
        _MODELS[family] = tiny_model(tiny_family_config(family))
    return copy.deepcopy(_MODELS[family])


@dataclass
class Row:
    family: str
    method: str
    status: str = "ok"  # ok, refused (a clear error naming the cause), error (anything else)
    reason: str = ""
    arch: str = ""
    pairs: int = 0  # scaling pairs AWQ scaled (its run), or could scale (the others: the plan's pairs)
    pair_slots: int = 0  # every pair instance of every block, scaled or not
    replay_error: float = math.nan
    quantized: int = 0  # parameters (elements) in quantized weights
    listed: int = 0  # parameters kept in float, each with its reason
    params: int = 0
    summary: str = ""  # the AWQ run's report summary (where it did not scale every pair)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _ids(n: int, seq_len: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n, seq_len), generator=torch.Generator().manual_seed(1))


def replay_error(model, arch, ids) -> float:
    """max |a block's output replayed - its output in the model's own forward| over every block (each replayed as
    the runner calls it, with its own captured arguments, on the replayed outputs of the block before), relative to
    the largest output."""
    from compress.calibrate.blockwise import block_forward, capture_block_inputs
    blocks = arch.block_list(model)
    own: list[list[torch.Tensor]] = [[] for _ in blocks]
    hooks = [b.register_forward_hook(lambda m, a, out, i=i: own[i].append(out[0] if isinstance(out, tuple) else out))
             for i, b in enumerate(blocks)]
    try:
        with torch.no_grad():
            for row in ids:
                model(input_ids=row[None], use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inputs, _ = capture_block_inputs(model, arch, ids, "cpu")
    worst, scale = 0.0, 0.0
    for i, block in enumerate(blocks):
        out = block_forward(block, inputs)
        for got, want in zip(out, own[i]):
            worst = max(worst, float((got - want).abs().max()))
            scale = max(scale, float(want.abs().max()))
        inputs = inputs.advance(out)
    return worst / max(scale, 1e-30)


def applicable_pairs(model, arch, quantized: set[str]) -> tuple[int, int]:
    """(pairs AWQ could scale, pair instances in all) over every block, for the layers the plan quantizes."""
    from compress.arch import block_pairs
    from compress.transforms.smoothing import pair_skip_reason
    usable = total = 0
    for i, block in enumerate(arch.block_list(model)):
        prefix = f"{arch.blocks}.{i}."
        mine = {n[len(prefix):] for n in quantized if n.startswith(prefix)}
        for prev, balance, _, _ in block_pairs(block, arch.awq):
            total += 1
            usable += pair_skip_reason(block, prev, balance, mine) is None
    return usable, total + len([s for s in arch.awq_skip if s[0] != "all pairs"]) * len(arch.block_list(model))


def run_method(family: str, method: str, calib_file, replay: bool = True, run: bool = True) -> Row:
    """The family's tiny model through `method` (compress_model: calibration windows of 64 tokens, the recipe's
    stages block by block), as a row of the matrix; every exception becomes the row's status and reason. Before the
    run: the block replay error (`replay`), the plan's parameter accounting and the AWQ pairs it could scale (all
    that is measured with `run` false)."""
    from compress.arch import get_arch
    from compress.recipe import from_dict
    from compress.pipeline.calibration import compress_model
    from compress.stages import make_plan
    from tests.tiny_tokenizer import make_tiny_tokenizer

    row = Row(family, method)
    try:
        model = family_model(family)
        row.params = sum(p.numel() for p in model.parameters())
        arch = get_arch(model)
        row.arch = arch.family
        if replay:
            row.replay_error = replay_error(model, arch, _ids(2, SEQ_LEN, model.get_input_embeddings().num_embeddings))
        recipe = from_dict({"model": "unused", "calibration": {"kind": "files", "files": [str(calib_file)],
                                                               "n_samples": N_SAMPLES, "seq_len": SEQ_LEN},
                            "stages": STAGES[method]})
        plan = make_plan(model, arch, recipe.stages)
        step = plan.steps[-1]
        row.quantized = sum(e.shape[0] * e.shape[1] for e in step.quantized)
        row.listed = sum(n for _, n, _ in step.float_params)
        row.pairs, row.pair_slots = applicable_pairs(model, arch, {e.name for e in step.quantized})
        if not run:
            return row
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sections, _ = compress_model(model, make_tiny_tokenizer(), recipe, plan, "cpu", progress=False,
                                         log=lambda *a: None)
        if method == "awq":
            awq = sections["stages"][0]
            row.pairs = awq["unscaled"]["scaled"]
            row.pair_slots = awq["unscaled"]["pairs"]
            row.summary = awq.get("summary") or ""
        from compress.core.nn import QuantLinear
        done = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
        missing = {e.name for e in step.quantized} - done
        if missing:
            row.status, row.reason = "error", f"planned but not quantized: {sorted(missing)[:3]}"
    except ValueError as e:
        row.status, row.reason = "refused", str(e)
    except Exception as e:  # a raw error: recorded as the matrix's fact, with where it came from
        where = traceback.extract_tb(e.__traceback__)[-1]
        row.status = "error"
        row.reason = f"{type(e).__name__}: {e} (at {where.filename.rpartition('/')[2]}:{where.lineno})"
    return row
