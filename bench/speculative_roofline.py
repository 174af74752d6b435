"""Recompute the roofline columns of a saved `compress speculate --output` result: the models are loaded again as
the command loads them (no decoding), their serving bytes (quantized layers as stored, floats at bf16) recorded, and
the roofline speed-up at every measured α and K written back. For results saved before the command counted serving
bytes (it counted the in-memory bytes: a float32 target made every draft look cheap).

    python bench/speculative_roofline.py RESULT.json --draft DRAFT [--draft-int4] [--accelerator H100-SXM]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `compress` from a checkout, installed or not

from compress.measure.memory import serving_bytes  # noqa: E402
from compress.measure.speculation import SELF_DRAFT, int4_copy, roofline_rows  # noqa: E402
from compress.model.load import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result")
    ap.add_argument("--target", default="default")
    ap.add_argument("--draft", required=True)
    ap.add_argument("--draft-int4", action="store_true")
    ap.add_argument("--accelerator", action="append", default=[])
    args = ap.parse_args()
    result = json.loads(Path(args.result).read_text())
    target = load_model(args.target, "auto", "cpu").model
    if args.draft == SELF_DRAFT:
        draft = int4_copy(target)[0]
    else:
        draft = load_model(args.draft, "auto", "cpu").model
        if args.draft_int4:
            draft = int4_copy(draft)[0]
    result["target_serving_bytes"], result["draft_serving_bytes"] = serving_bytes(target), serving_bytes(draft)
    result["roofline"] = roofline_rows(result, target.config, draft.config, args.accelerator or ["H100-SXM"])
    Path(args.result).write_text(json.dumps(result, indent=1, default=str))
    for r in result["roofline"]:
        print(f"{r['accelerator']} K={r['k']}: draft {r['draft_cost']:.2f}, speed-up {r['speedup']:.2f}x")


if __name__ == "__main__":
    main()
