"""Compare what an engine computes from an export with what our model computes: the same windows and prompts.

Figures (over every scored position of every window):
  mean_abs_dlogp   mean |log p_engine(next token) - log p_ours(next token)|, nats
  top1_agreement   share of positions where the engine's most likely next token is ours
  greedy_match     per prompt, how many greedy tokens the engine produced before it first differs from ours
Our side runs as the run's model runs (float32 unless the model is in another dtype, its activation quantization
included); the engine runs in its own dtype (bfloat16 by default), so a dense export measures the floor of what
any quantized export can reach on the same engine.
"""
from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import torch
from torch import Tensor, nn

from . import EngineAnswer, EngineRequest, get_engine

PROMPTS = ("The capital of France is", "In 1905, Albert Einstein published four papers that",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")


def prompt_ids(tokenizer, prompts=PROMPTS) -> list[list[int]]:
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]


@torch.no_grad()
def reference(model: nn.Module, windows: Tensor) -> tuple[Tensor, Tensor]:
    """Our model's log p(next token) and most likely next token at positions 1..T-1 of each window: [B, T-1]."""
    device = next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))
    logp, top = [], []
    for w in windows:
        logits = model.forward(input_ids=w[None].to(device)).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1)
        logp.append(lp.gather(-1, w[1:, None].to(device))[:, 0].cpu())
        top.append(lp.argmax(-1).cpu())
    return torch.stack(logp), torch.stack(top)


@torch.no_grad()
def greedy(model: nn.Module, prompts: list[list[int]], n: int) -> list[list[int]]:
    device = next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))
    out = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        new = []
        for _ in range(n):  # no cache: a few short prompts, and the same forward as the windows'
            token = int(model.forward(input_ids=ids).logits[0, -1].argmax())
            new.append(token)
            ids = torch.cat([ids, torch.tensor([[token]], device=device)], 1)
        out.append(new)
    return out


def matching_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare(answer: EngineAnswer, logp: Tensor, top: Tensor, ours_greedy: list[list[int]]) -> dict:
    theirs = torch.tensor(answer.logprobs, dtype=torch.float64)
    return {"mean_abs_dlogp": float((theirs - logp.double()).abs().mean()),
            "top1_agreement": float((torch.tensor(answer.top1) == top).double().mean()),
            "positions": int(theirs.numel()),
            "greedy_match": [matching_prefix(g, o) for g, o in zip(answer.greedy, ours_greedy)]}


def summary(answer: EngineAnswer, figures: dict | None) -> dict:
    out = {k: v for k, v in asdict(answer).items() if k not in ("logprobs", "top1")}
    return {**out, **(figures or {})}


def engine_check(folder: str | Path, model: nn.Module, windows: Tensor, prompts: list[list[int]], engine: str,
                 max_new_tokens: int = 32, dtype: str = "bfloat16", env: dict | None = None,
                 python: str | None = None, reference_figures=None, also: dict | None = None,
                 timeout: float = 3600) -> dict:
    """Load `folder` in `engine` and compare it with `model` (the run's model). Where the engine's default settings
    change the model (vLLM CPU's W4A8), the result also holds a second run with them off, under `plain`.
    `reference_figures`: (logp, top, greedy) of `model` computed once by the caller for several exports. `also`:
    other references, {name: (logp, top)} (e.g. the model with float activations), compared under `vs`."""
    record = json.loads((Path(folder) / "export.json").read_text())
    chosen = get_engine(engine)
    if (why := chosen.formats(record["format"])) is not None:
        return {"engine": engine, "format": record["format"], "loads": False, "error": why, "served": False}
    logp, top, ours = reference_figures or (*reference(model, windows), greedy(model, prompts, max_new_tokens))
    request = EngineRequest(str(folder), windows.tolist(), prompts, max_new_tokens, dtype, dict(env or {}), python,
                            timeout)
    answer = chosen.run(request)
    result = {"engine": engine, "format": record["format"],
              **summary(answer, compare(answer, logp, top, ours) if answer.loads else None)}
    if answer.loads and also:
        result["vs"] = {name: {k: v for k, v in compare(answer, *ref, ours).items() if k != "greedy_match"}
                        for name, ref in also.items()}
    if answer.loads and (plain := chosen.plain_env(answer)) is not None:
        second = chosen.run(replace(request, env={**request.env, **plain}))
        result["plain"] = {"env": plain, **summary(second, compare(second, logp, top, ours) if second.loads
                                                   else None)}
    return result
