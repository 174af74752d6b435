"""The entry point of the sensitivity measurement: `measure_sensitivity` builds a layer × option table
(precision.Sensitivity) with the pass that suits the model, block by block (fisher_blocks.py) or whole-model
(precision.py). Kept apart from both so that neither imports the other's caller."""
from __future__ import annotations

import numpy as np
from torch import Tensor, nn

from .fisher_blocks import blocks_problem, fisher_by_blocks
from ..core.nn import linear_weight
from .mixed import (ERROR_METHODS, HESSIAN_BUDGET, SENSITIVITIES, AWQModel, Sensitivity, fisher_pass, measured_kl,
        option_bytes, option_name, rtn_error, solve_layers, solved_error)
from ..core.scheme import QuantScheme


def measure_sensitivity(model: nn.Module, windows: Tensor, names: list[str], menu: list[QuantScheme | None],
                        kind: str = "fisher", seed: int = 0, progress=None, error_method: str = "rtn",
                        hessian_budget: int = HESSIAN_BUDGET, hessian_windows: Tensor | None = None,
                        awq: AWQModel | None = None, driver: str = "auto", blocks=None,
                        device=None) -> Sensitivity:
    """The sensitivity table of layers `names` (full module names of linear layers of `model`) to every option of
    `menu` (None = float), on token windows [N, T]. `fisher` and `output_error` come from the same pass and are both
    returned; `kl` measures every (layer, option) with a forward of all windows. `error_method`: the weight error is
    round-to-nearest's (rtn), GPTQ's (gptq), or that of AWQ (as `awq` describes the recipe's stage) then
    round-to-nearest or GPTQ (awq_rtn, awq_gptq); all but rtn are solved first (solve_layers), on `hessian_windows`,
    default `windows` (GPTQ fitted on the very windows its error is then measured on looks better than it will on
    other text, the more so the wider the layer). `progress(what, done, total)` is called as each phase advances.

    driver: how the fisher pass runs. `blocks` (fisher_blocks.py): one decoder block at a time, memory bounded by
    a block (the only way for a streamed model: `blocks` is then its block source, `device` where blocks compute);
    `model`: whole-model forwards and backwards (every layer's output errors of a window held until its backward);
    `auto`: blocks where the model's family allows it (fisher_blocks.blocks_problem), else model. The two give the
    same costs (tests). The model is left as it was."""
    if kind not in SENSITIVITIES:
        raise ValueError(f"sensitivity {kind!r}; choose one of {list(SENSITIVITIES)}")
    if error_method not in ERROR_METHODS:
        raise ValueError(f"error_method {error_method!r}; choose one of {list(ERROR_METHODS)}")
    modules = {n: model.get_submodule(n) for n in names}
    shapes = {n: tuple(linear_weight(m).shape) for n, m in modules.items()}
    options = [option_name(o) for o in menu]
    nbytes = option_bytes([shapes[n] for n in names], menu)
    out = Sensitivity(list(names), options, nbytes, tokens=int(windows.numel()))
    hessian_windows = windows if hessian_windows is None else hessian_windows
    why = "the measured KL runs the whole model per layer" if kind == "kl" else \
        blocks_problem(model, names)
    if driver == "auto":
        driver = "model" if why and blocks is None else "blocks"
    if driver == "blocks" and why:
        raise ValueError(f"this sensitivity cannot be measured block by block: {why}; run it on a model that fits "
                         "in memory (model.stream: false), or with sensitivity: fisher")
    if driver not in ("blocks", "model"):
        raise ValueError(f"driver {driver!r}; choose auto, blocks or model")
    out.driver = driver
    was_training = model.training
    model.eval()
    try:
        if driver == "blocks":
            out.costs.update(fisher_by_blocks(model, windows, modules, menu, nbytes, seed, progress, error_method,
                                              awq, hessian_windows, hessian_budget, blocks, device))
            return out
        if error_method != "rtn":
            total = len(names)

            def forward():
                for k in range(hessian_windows.shape[0]):
                    model(input_ids=hessian_windows[k:k + 1], use_cache=False)

            solved = solve_layers(forward, {i: (n, m) for i, (n, m) in enumerate(modules.items())}, menu, nbytes,
                                  int(hessian_windows.numel()), error_method, awq, hessian_budget,
                                  _counter(progress, f"{error_method} solutions", total))
            error = solved_error(solved)
        else:
            error = rtn_error(menu)
        if kind == "kl":
            out.costs["kl"] = measured_kl(model, windows, modules, menu, nbytes, progress, error)
        else:
            out.costs.update(fisher_pass(model, windows, modules, menu, nbytes, seed, progress, error))
    finally:
        model.train(was_training)
    return out


def _counter(progress, what: str, total: int):
    """A callable that advances progress(what, done, total) by one per call (None without progress)."""
    if progress is None:
        return None
    done = [0]

    def step():
        done[0] += 1
        progress(what, done[0], total)
    return step
