"""Weight quantizers and their registry.

A quantizer is one function of one signature, `quantize(w [out, in], scheme, options, inputs) -> QuantizedTensor`,
and a frozen dataclass of its options. `QUANTIZERS` maps a recipe's `method:` to it; the quantize stage, recipe
validation, `compress inspect` and the calibration pass reach every method through this table and nothing else.
A new method is its own file, one line in `QUANTIZERS`, and its tests (`hqq.py` is the worked example).
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Callable

from torch import Tensor

from ..calibrate.observers import InputStats
from ..core.qtensor import QuantizedTensor
from ..core.scheme import QuantScheme
from .autoround import AutoRoundOptions, autoround_problem, quantize_autoround_layer, tune_block
from .gptq import GPTQConfig, gptq_problem, quantize_gptq_layer
from .gptq_kron import quantize_gptq_kron_layer
from .hqq import HQQOptions, hqq_problem, quantize_hqq
from .rtn import RTNOptions, quantize_rtn
from .trellis import TrellisOptions, quantize_trellis, trellis_format, trellis_problem


@dataclass(frozen=True)
class LayerInputs:
    """What the calibration pass saw of one layer's inputs, as the layer sees them now: where an earlier stage
    (AWQ, SmoothQuant) divided them by s per channel (`divisor`), the statistics are corrected for it here, once.
    `stats` is None for a layer the pass did not observe (calibration-free methods need nothing). `clip`: AWQ's
    clipping as factors [rows, groups] of each group's range, for a method that takes its grid from them (GPTQ,
    with the awq stage's clip_to: grid). `shared`: a scratch dict the caller keeps across the layers of one block,
    where a method may keep what layers reading the same input can reuse (GPTQ: the factor of their Hessian); None:
    nothing is shared. `out_divisor`: what the layer's outputs are divided by since the model was loaded (a smoothing
    stage folded 1/s into it, the previous op of a pair: v_proj before o_proj, up_proj before down_proj), for a method
    that weighs the outputs with what it measured on the original model (GPTQ against the KL's output side)."""

    name: str
    stats: InputStats | None = None
    divisor: Tensor | None = None
    clip: Tensor | None = None
    shared: dict | None = dataclasses.field(default=None, compare=False)
    out_divisor: Tensor | None = None

    def _need(self, why: str) -> InputStats:
        if self.stats is None:
            raise ValueError(f"{self.name}: {why} needs the layer's calibration inputs, and this layer was not seen by "
                             "the block-by-block pass (it is outside the decoder blocks). Add it to `ignore:` or "
                             "quantize it in a separate stage with a calibration-free method or a dynamic scheme.")
        return self.stats

    def hessian(self, why: str = "GPTQ") -> Tensor:
        """H = 2/n Σ x xᵀ of the inputs the layer sees now (H / (s sᵀ) after a smoothing stage)."""
        return self._need(why).hessian_mean(self.divisor)

    def absmax(self, why: str = "a static activation scheme") -> Tensor:
        """max |x| per input channel, as the layer sees its inputs now."""
        return self._need(why).input_absmax(self.divisor)


def _any_scheme(scheme: QuantScheme) -> str | None:
    return None


def _gptq(w: Tensor, scheme: QuantScheme, options: GPTQConfig, inputs: "LayerInputs") -> QuantizedTensor:
    """GPTQ against the layer's output error, or, where options.output_hessians names the output side of the
    model's KL Hessian (the kl_hessians stage), against both sides (gptq_kron.py)."""
    layer = quantize_gptq_kron_layer if options.output_hessians else quantize_gptq_layer
    return layer(w, scheme, options, inputs)


@dataclass(frozen=True)
class Quantizer:
    """A registered weight quantization method."""

    quantize: Callable[[Tensor, QuantScheme, Any, LayerInputs], QuantizedTensor]
    options: type  # frozen dataclass; a recipe sets its fields under the stage's `options:`
    needs_hessian: bool = False  # the calibration pass accumulates each planned layer's input Hessian
    problem: Callable[[QuantScheme], str | None] = _any_scheme  # why it cannot produce a scheme (None: it can)
    # a block-level method: tune_block(block, {name: weight}, scheme, options, BlockSamples, compute_dtype, schemes)
    # -> ({name: QuantizedTensor}, record) quantizes a decoder block's planned linears jointly against the block's
    # float output, inside the calibration pass; `quantize` is then only called for layers outside the blocks
    tune_block: Callable | None = None
    # code(scheme, options): the stored format beyond the scheme's grid (trellis codes: a core.trellis.TrellisFormat,
    # whose layers are TrellisLinear), known at plan time so that a skeleton and a resumed run build the right layers;
    # None: the scheme's integer or float grid (QuantLinear)
    code: Callable[[QuantScheme, Any], Any] | None = None


QUANTIZERS: dict[str, Quantizer] = {
    "rtn": Quantizer(quantize_rtn, RTNOptions),  # round to nearest: scales from min/max or absmax
    "gptq": Quantizer(_gptq, GPTQConfig, needs_hessian=True, problem=gptq_problem),
    "hqq": Quantizer(quantize_hqq, HQQOptions, problem=hqq_problem),  # no calibration data
    "autoround": Quantizer(quantize_autoround_layer, AutoRoundOptions, problem=autoround_problem,
                           tune_block=tune_block),  # SignRound: learned rounding and clipping, block by block
    # QTIP-style trellis codes (core/trellis.py): incoherence, then BlockLDLQ with a Viterbi tile quantizer
    "trellis": Quantizer(quantize_trellis, TrellisOptions, needs_hessian=True, problem=trellis_problem,
                         code=trellis_format),
}


def get_quantizer(name: str) -> Quantizer:
    if name not in QUANTIZERS:
        raise ValueError(f"unknown quantization method {name!r}; known: {sorted(QUANTIZERS)}")
    return QUANTIZERS[name]


def build_options(method: str, values: Any) -> Any:
    """The options dataclass of `method` from a recipe mapping (None: the defaults), checking names and types."""
    cls = get_quantizer(method).options
    if values is None:
        return cls()
    if isinstance(values, cls):
        return values
    if not isinstance(values, dict):
        raise ValueError(f"`options` of method {method} must be a mapping, got {values!r}")
    fields = [f.name for f in dataclasses.fields(cls)]
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        if key not in fields:
            raise ValueError(f"unknown option `{key}` for method {method}; its options: {fields or 'none'}")
        tp = hints[key]
        ok = isinstance(value, bool) if tp is bool else \
            (isinstance(value, (int, float)) and not isinstance(value, bool)) if tp is float else \
            (isinstance(value, int) and not isinstance(value, bool)) if tp is int else True
        if not ok:
            raise ValueError(f"option `{key}` of method {method} must be {tp.__name__}, got {value!r}")
    return cls(**{k: float(v) if hints[k] is float else v for k, v in values.items()})


__all__ = ["QUANTIZERS", "Quantizer", "LayerInputs", "get_quantizer", "build_options", "quantize_rtn"]
