"""A finished tiny run for the model-card and push tests (tests/test_card.py, tests/test_push.py): a tiny llama
with a byte-level BPE tokenizer (GGUF writes one), quantized, evaluated and exported by `compress run` itself."""
from __future__ import annotations

from pathlib import Path

import yaml

from tests.conftest import make_tiny_model, shared_data_dir
from tests.tiny_tokenizer import byte_bpe_tokenizer, word_text

INT8 = {"dtype": "int8", "group_size": 32}
INT4 = {"dtype": "int4", "group_size": 32}


def card_run(tmp: Path, formats: tuple[str, ...], scheme: dict = INT8, measure: bool = True) -> Path:
    """`compress run` into tmp/out; `measure`: perplexity (when the shared WikiText-2 data is here), speed, and each
    export reloaded and compared (verify_windows 1), as a real run reports them."""
    from compress import load_recipe, run

    source = tmp / "source"
    make_tiny_model("llama").save_pretrained(source)
    byte_bpe_tokenizer().save_pretrained(source)
    (tmp / "calib.txt").write_text(word_text(1024) + "\n")
    ppl = measure and shared_data_dir() is not None
    recipe = {"model": {"source": str(source), "dtype": "float32", "device": "cpu"},
              "calibration": {"kind": "files", "files": [str(tmp / "calib.txt")], "n_samples": 2, "seq_len": 32},
              "stages": [{"stage": "quantize", "method": "rtn", "scheme": scheme, "ignore": ["lm_head"]}],
              "eval": {"perplexity": ppl, "max_windows": 1, "seq_len": 32, "speed": measure, "prefill_tokens": 8,
                       "decode_tokens": 2, "speed_repeats": 1, "dispatch": False},
              "output": {"dir": str(tmp / "out"), "formats": list(formats),
                         "verify_windows": 1 if ppl else 0}}
    (tmp / "recipe.yaml").write_text("# tiny llama for the card tests\n" + yaml.safe_dump(recipe, sort_keys=False))
    run(load_recipe(tmp / "recipe.yaml"), progress=False, log=lambda *a: None)
    return tmp / "out"
