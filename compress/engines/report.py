"""An engine check's result as lines of text (`compress verify --engine`, bench/engines.py)."""
from __future__ import annotations


def _figures(r: dict) -> str:
    speed = f", {r['tokens_per_s']:.1f} tokens/s decoding" if r.get("tokens_per_s") else ""
    return (f"mean |dlogp| {r['mean_abs_dlogp']:.4f} nats, top-1 agreement {r['top1_agreement']:.4f} over "
            f"{r['positions']} positions; greedy tokens matching ours {r['greedy_match']}{speed}")


def engine_lines(result: dict) -> list[str]:
    head = f"{result['format']} in {result['engine']}{' ' + result['version'] if result.get('version') else ''}"
    if not result["loads"]:
        return [f"{head}: does not load: {result['error']}"]
    lines = [f"{head}: loads (method {result.get('method') or 'none (float)'}; "
             f"{', '.join(result.get('kernels') or []) or 'no kernel named in its log'})",
             f"  engine defaults: {_figures(result)}"]
    lines += [f"  note: {n}" for n in result.get("notes", [])]
    if (plain := result.get("plain")) is not None:
        setting = " ".join(f"{k}={v}" for k, v in plain["env"].items())
        lines.append(f"  with {setting}: " + (_figures(plain) if plain["loads"] else f"does not load: "
                                                                                       f"{plain['error']}"))
    return lines
