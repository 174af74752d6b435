"""Which transformers class builds a model: a vision-language model of the table (its entry has `vision`) is built
whole, vision tower and projector included, by AutoModelForImageTextToText. Its own module so that the tiny models
(arch/tiny.py) build with it without importing the package's spec finder."""
from __future__ import annotations

from .tables import FAMILIES


def is_vision_language(config) -> bool:
    """Whether `config` is a vision-language model's composite config of a family in the table (its entry has
    `vision`): loaded with AutoModelForImageTextToText, its language model quantized, the rest kept float."""
    return bool(FAMILIES.get(getattr(config, "model_type", None), {}).get("vision"))


def auto_model_class(config):
    """The transformers Auto class that builds a model of `config`: AutoModelForImageTextToText for a vision-language
    model of the table (AutoModelForCausalLM would refuse Qwen2.5-VL's config, and build Llama 3.2 Vision without its
    vision tower), else AutoModelForCausalLM."""
    import transformers
    return transformers.AutoModelForImageTextToText if is_vision_language(config) else \
        transformers.AutoModelForCausalLM
