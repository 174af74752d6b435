"""Image-caption calibration samples for a vision-language model (calibration kind `images`).

The folder holds .png / .jpg / .jpeg images and their captions, either in `captions.jsonl` (one
`{"image": "cat.png", "caption": "a cat on a mat"}` per line; only the images it lists are used) or, without it, in
a `.txt` file beside each image with the same stem (`cat.png` + `cat.txt`). A sample is one image and its caption
as the model's own processor (AutoProcessor from the model folder) renders them: the caption in one user turn after
the image, through the processor's chat template, so that the text holds the image placeholder the processor
expands to the model's image tokens. The processor returns the token ids with the image inputs of its family
(pixel_values, image_grid_thw, aspect_ratio_ids, cross_attention_mask, ...), and the calibration pass feeds them
all through the model's forward: the decoder blocks see the image tokens' hidden states. Each sample keeps its own
length (calibration.seq_len does not apply).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import Tensor

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
CAPTIONS = "captions.jsonl"


def image_captions(folder: str | Path) -> list[tuple[Path, str]]:
    """The folder's (image path, caption) pairs, in name order (captions.jsonl's order when it has one)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"calibration folder {folder} does not exist; point calibration.folder at a folder of "
                                f"images with their captions ({CAPTIONS} or a .txt beside each image)")
    index = folder / CAPTIONS
    if index.is_file():
        pairs = []
        for n, line in enumerate(index.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("image"), str) or \
                    not isinstance(row.get("caption"), str):
                raise ValueError(f"{index}:{n}: each line is {{\"image\": FILE, \"caption\": TEXT}}; got {line!r}")
            path = folder / row["image"]
            if not path.is_file():
                raise FileNotFoundError(f"{index}:{n}: no image {path}")
            pairs.append((path, row["caption"]))
    else:
        images = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        missing = [p.name for p in images if not p.with_suffix(".txt").is_file()]
        if missing:
            raise FileNotFoundError(f"calibration folder {folder} has no {CAPTIONS}, and no caption .txt beside "
                                    f"{missing[:3]}: add {CAPTIONS} or a .txt of the same stem for each image")
        pairs = [(p, p.with_suffix(".txt").read_text(encoding="utf-8").strip()) for p in images]
    if not pairs:
        raise ValueError(f"calibration folder {folder} holds no images ({', '.join(IMAGE_SUFFIXES)})")
    return pairs


def load_processor(source: str):
    """The model's processor (transformers AutoProcessor from its folder); a clear error where there is none."""
    import transformers
    try:
        processor = transformers.AutoProcessor.from_pretrained(source)
    except Exception as exc:  # transformers raises OSError, ValueError, ImportError (a missing backend), ...
        raise ValueError(f"calibration kind 'images' renders the samples with the model's processor, and "
                         f"AutoProcessor could not load one from {source}: {type(exc).__name__}: {exc}. Save the "
                         f"model's processor (processor_config.json / preprocessor_config.json) in its folder, or "
                         f"calibrate on text") from exc
    if getattr(processor, "image_processor", None) is None:
        raise ValueError(f"{source}: the model's processor ({type(processor).__name__}) has no image processor: "
                         f"calibration kind 'images' needs a vision-language model's processor")
    if not getattr(processor, "chat_template", None):
        raise ValueError(f"{source}: the processor has no chat template, which places the image placeholder its "
                         f"family expects; add the model's chat_template (chat_template.jinja) to its folder")
    return processor


def render(processor, image_path: Path, caption: str) -> dict[str, Tensor]:
    """One sample: the image and its caption in a user turn, through the processor's chat template and the
    processor (batch of 1): input_ids with the family's image inputs."""
    from PIL import Image
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": caption}]}]
    text = processor.apply_chat_template(messages, tokenize=False)
    with Image.open(image_path) as im:
        image = im.convert("RGB")
    out = processor(text=[text], images=[image], return_tensors="pt")
    return {k: v for k, v in out.items() if isinstance(v, Tensor)}


class ImageSamples:
    """Calibration samples of kind images: per sample, the model inputs the processor returned (input_ids [1, L]
    and the image inputs), each at its own length L. The calibration pass runs the model on each (capture_block_
    inputs); a text pass's [n, seq_len] windows are a Tensor instead."""

    def __init__(self, inputs: list[dict[str, Tensor]], names: list[str]):
        self.inputs, self.names = inputs, names

    def __len__(self) -> int:
        return len(self.inputs)

    def __iter__(self):
        return iter(self.inputs)

    @property
    def tokens(self) -> int:
        return sum(int(s["input_ids"].numel()) for s in self.inputs)

    def fingerprint(self) -> str:
        """sha256 of every sample's inputs (names, dtypes, shapes, bytes): identifies exactly what was used."""
        h = hashlib.sha256()
        for sample in self.inputs:
            for k in sorted(sample):
                t = sample[k].contiguous()
                h.update(f"{k}:{t.dtype}:{tuple(t.shape)};".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


def image_samples(folder: str, processor, n_samples: int, seed: int) -> ImageSamples:
    """`n_samples` image-caption pairs of the folder, chosen at random (seeded) when it holds more, in its order,
    rendered by `processor`."""
    pairs = image_captions(folder)
    if len(pairs) < n_samples:
        raise ValueError(f"calibration folder {folder} holds {len(pairs)} captioned images; n_samples={n_samples} "
                         f"needs more: lower calibration.n_samples or add images")
    picks = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed))[:n_samples].sort().values
    chosen = [pairs[int(i)] for i in picks]
    return ImageSamples([render(processor, p, c) for p, c in chosen], [p.name for p, _ in chosen])
