"""The token mixers of hybrid models besides attention: state-space layers (Mamba in Jamba, Bamba, Falcon-H1,
Nemotron-H) and linear attention (gated DeltaNet in Qwen3-Next / Qwen3.5, Kimi Delta Attention). Their linear layers
(in_proj, x_proj, dt_proj, out_proj, the q/k/v/gate projections) are quantized like any other; what drives their
recurrence stays in float, and the report lists each such parameter with the reason (float_reason): never skipped
silently. The recurrent state itself is an activation, computed in float by the layer's own code."""
from __future__ import annotations

from torch import nn

# the recurrence's own parameters, by name: one value per head (or channel), a vanishing share of the model
RECURRENT = {
    "A_log": "state-space decay (A_log, one per head): the recurrent state is multiplied by exp(dt * A) at every "
             "token, so a rounding error compounds along the sequence; kept in float",
    "A": "state-space decay (A, one per head): the recurrent state is multiplied by exp(dt * A) at every token; "
         "kept in float",
    "D": "state-space skip (D, one per head or channel): kept in float, as every checkpoint format does",
    "dt_bias": "state-space time-step bias (dt_bias, one per head): it sets how fast the recurrent state decays; "
               "kept in float",
}
CONV = ("causal depthwise convolution of a state-space or linear-attention layer ({taps} taps per channel): not a "
        "matmul, weight-only integer schemes apply to linear layers")


def float_reason(module: nn.Module, param: str) -> str | None:
    """Why parameter `param` of `module` (not a linear layer) stays in float, where it is a recurrent layer's: its
    convolution, or a parameter of the recurrence (RECURRENT). None for anything else."""
    if isinstance(module, nn.Conv1d) and module.groups > 1:
        return CONV.format(taps=module.kernel_size[0])
    return RECURRENT.get(param) if not isinstance(module, (nn.Linear, nn.Embedding)) else None


# linears of a recurrent layer that the layer's code does not call but reads the weight of: transformers' Mamba-1
# mixer (Jamba, Mamba, Falcon-Mamba) computes `dt_proj.weight @ time_step` itself (the layer is only called when the
# config says the checkpoint was quantized on loading), so a quantized dt_proj would have no weight to read
READ_AS_WEIGHT = {
    "dt_proj": "Mamba time-step projection: the mixer multiplies by dt_proj.weight itself instead of calling the "
               "layer, and its output sets how fast the recurrent state decays; kept in float",
}


def float_linear_reason(model: nn.Module, name: str) -> str | None:
    """Why linear `name` stays in float though it is a linear layer (READ_AS_WEIGHT, in a layer with a recurrence:
    A_log beside it), or None."""
    parent, _, leaf = name.rpartition(".")
    if leaf not in READ_AS_WEIGHT:
        return None
    owner = model.get_submodule(parent) if parent else model
    return READ_AS_WEIGHT[leaf] if any(p in RECURRENT for p, _ in owner.named_parameters(recurse=False)) else None
