"""Text for calibration and evaluation: load, tokenize, cut into windows, fingerprint.

Sources: a hub dataset (id, config, split, text field), local .txt/.jsonl/.parquet files, the
WikiText-2 raw files (local copy when present, hub otherwise), or text sampled from the model
itself (data-free). The local data folder is COMPRESS_DATA_DIR, else ../shared/data next to
the working directory or the project checkout.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

DATA_ENV = "COMPRESS_DATA_DIR"
_PROJECT_ROOT = Path(__file__).resolve().parents[2]


def find_data_dir() -> Path | None:
    """The shared evaluation-data folder, or None when there is none."""
    env = os.environ.get(DATA_ENV)
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"{DATA_ENV}={env} is not a folder; point it at the data folder or unset it")
        return path
    for base in (Path.cwd(), _PROJECT_ROOT):
        path = base.parent / "shared" / "data"
        if path.is_dir():
            return path
    return None


@dataclass(frozen=True)
class TextSource:
    """Where text comes from. `kind` picks which of the other fields apply."""

    kind: Literal["wikitext2", "hub", "files", "self", "texts", "images"] = "wikitext2"
    split: str = "validation"  # wikitext2 / hub
    dataset: str | None = None  # hub: dataset id, e.g. "mit-han-lab/pile-val-backup"
    config: str | None = None  # hub: dataset config name
    data_files: str | None = None  # hub: passed to load_dataset(data_files=...)
    text_field: str = "text"  # hub / jsonl / parquet column
    files: tuple[str, ...] = ()  # files: .txt, .jsonl or .parquet paths
    texts: tuple[str, ...] = ()  # texts: the documents themselves (the Python API's `dataset=`)
    folder: str | None = None  # images: image-caption pairs for a vision-language model (calibrate/images.py)


_WIKITEXT_FILES = {"test": "wiki.test.raw", "validation": "wiki.valid.raw", "valid": "wiki.valid.raw",
                   "train": "wiki.train.raw"}


_SLICE = re.compile(r"^(\w+)(?:\[(\d{0,3})%?:(\d{0,3})%?\])?$")


def parse_split(split: str) -> tuple[str, int, int]:
    """`validation`, or a percent slice of its rows as in Hugging Face datasets: `validation[:50%]`,
    `validation[50%:]`. Returns (name, start %, end %). Tuning defaults on one half of the validation split and
    scoring them on the other keeps both off the test split."""
    m = _SLICE.match(split.strip())
    if not m or m.group(1) not in _WIKITEXT_FILES:
        raise ValueError(f"wikitext2 split {split!r}; use one of {sorted(set(_WIKITEXT_FILES) - {'valid'})}, "
                         "optionally sliced by percent of its rows: validation[:50%], validation[50%:]")
    start, end = int(m.group(2) or 0), int(m.group(3) or 100)
    if not 0 <= start < end <= 100:
        raise ValueError(f"wikitext2 split {split!r}: the slice must satisfy 0 <= start < end <= 100 (percent)")
    return m.group(1), start, end


def wikitext2_rows(split: str) -> list[str]:
    """WikiText-2 raw v1 as the hub's rows (one per line; a blank line of the file is '').

    The local raw file is decoded to the hub's rows as described in the data folder's README, so
    "\\n\\n".join(rows) is byte-for-byte the text the GPTQ/AWQ perplexity protocol tokenizes. A percent slice
    (`validation[50%:]`) keeps those rows of the split.
    """
    name, start, end = parse_split(split)
    rows = _wikitext2_split_rows(name)
    return rows[len(rows) * start // 100: len(rows) * end // 100]


def _wikitext2_split_rows(split: str) -> list[str]:
    data_dir = find_data_dir()
    path = data_dir / "wikitext-2-raw" / _WIKITEXT_FILES[split] if data_dir else None
    if path is not None and path.is_file():
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        return ["" if line == " \n" else line for line in lines]
    return _hub_texts("wikitext", "wikitext-2-raw-v1", None, "test" if split == "test" else split, "text",
                      hint=f"no local copy at {path} (set {DATA_ENV}) and the hub is unreachable")


def _hub_texts(dataset: str, config: str | None, data_files: str | None, split: str, field: str,
               hint: str = "") -> list[str]:
    import datasets

    try:
        ds = datasets.load_dataset(dataset, config, data_files=data_files, split=split)
    except Exception as exc:  # datasets raises many types for "offline" / "not found"
        raise RuntimeError(f"could not load hub dataset {dataset!r} (config={config!r}, split={split!r}): {exc}. "
                           f"{hint or 'Without network, use local files (kind: files) or kind: self.'}") from exc
    if field not in ds.column_names:
        raise ValueError(f"dataset {dataset!r} has no text field {field!r}; its columns: {ds.column_names}")
    return list(ds[field])


def _file_texts(paths: tuple[str, ...], field: str) -> list[str]:
    if not paths:
        raise ValueError("calibration kind 'files' needs `files:` (a list of .txt, .jsonl or .parquet paths)")
    texts: list[str] = []
    for p in map(Path, paths):
        if not p.is_file():
            raise FileNotFoundError(f"calibration file {p} does not exist")
        if p.suffix == ".txt":
            texts.append(p.read_text(encoding="utf-8"))
        elif p.suffix == ".jsonl":
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
                if line.strip():
                    row = json.loads(line)
                    if field not in row:
                        raise ValueError(f"{p}:{n}: no field {field!r} (set text_field); keys: {sorted(row)}")
                    texts.append(row[field])
        elif p.suffix == ".parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(p)
            if field not in table.column_names:
                raise ValueError(f"{p}: no column {field!r} (set text_field); columns: {table.column_names}")
            texts.extend(table.column(field).to_pylist())
        else:
            raise ValueError(f"{p}: unsupported file type {p.suffix!r}; use .txt, .jsonl or .parquet")
    return texts


def load_texts(source: TextSource) -> list[str]:
    if source.kind == "wikitext2":
        return wikitext2_rows(source.split)
    if source.kind == "hub":
        if not source.dataset:
            raise ValueError("calibration kind 'hub' needs `dataset:` (a hub dataset id)")
        return _hub_texts(source.dataset, source.config, source.data_files, source.split, source.text_field)
    if source.kind == "files":
        return _file_texts(source.files, source.text_field)
    if source.kind == "texts":
        if not source.texts or not all(isinstance(t, str) for t in source.texts):
            raise ValueError("calibration kind 'texts' needs `texts:` (a non-empty list of strings)")
        return list(source.texts)
    if source.kind == "images":
        raise ValueError("calibration kind 'images' holds image-caption samples for the calibration pass of a "
                         "vision-language model, not text windows: a stage that needs text windows (prune, auto_precision, "
                         "prune_experts) needs a text calibration kind")
    raise ValueError(f"load_texts cannot read kind {source.kind!r}; text of kind 'self' comes from sample_from_model")


def tokenize_joined(texts: list[str], tokenizer) -> Tensor:
    """Join documents with a blank line and tokenize once: int64 [1, T]. No special tokens are added."""
    ids = tokenizer("\n\n".join(texts), return_tensors="pt", add_special_tokens=False,
                    verbose=False).input_ids
    return ids.to(torch.int64)


def sequential_windows(ids: Tensor, seq_len: int, max_windows: int | None = None) -> Tensor:
    """Non-overlapping windows [n, seq_len] from the start of [1, T]; the tail is dropped."""
    n = ids.shape[1] // seq_len
    if n == 0:
        raise ValueError(f"the text has {ids.shape[1]} tokens, fewer than one window of seq_len={seq_len}")
    if max_windows is not None:
        n = min(n, max_windows)
    return ids[0, : n * seq_len].reshape(n, seq_len)


def random_windows(ids: Tensor, n_samples: int, seq_len: int, seed: int) -> Tensor:
    """`n_samples` distinct non-overlapping windows chosen at random (seeded), in text order."""
    available = ids.shape[1] // seq_len
    if available < n_samples:
        raise ValueError(f"the calibration text has {ids.shape[1]} tokens = {available} windows of {seq_len}; "
                         f"n_samples={n_samples} needs more. Lower n_samples or seq_len, or add text.")
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randperm(available, generator=gen)[:n_samples].sort().values
    grid = ids[0, : available * seq_len].reshape(available, seq_len)
    return grid[picks]


@torch.no_grad()
def sample_from_model(model, n_samples: int, seq_len: int, seed: int, batch_size: int = 8) -> Tensor:
    """Data-free calibration text (as in LLM-QAT): a random first token, then sampling at temperature 1."""
    vocab = model.get_input_embeddings().weight.shape[0]
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    rows = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for start in range(0, n_samples, batch_size):
            b = min(batch_size, n_samples - start)
            first = torch.randint(0, vocab, (b, 1), generator=gen).to(device)
            out = model.generate(first, attention_mask=torch.ones_like(first), do_sample=True, top_k=0,
                                 top_p=1.0, temperature=1.0, max_new_tokens=seq_len - 1,
                                 min_new_tokens=seq_len - 1, pad_token_id=0)
            rows.append(out[:, :seq_len].cpu())
    return torch.cat(rows)


def calibration_windows(source: TextSource, tokenizer, model, n_samples: int, seq_len: int, seed: int) -> Tensor:
    """`n_samples` seeded windows [n, seq_len] of the source's text, or sampled from `model` for kind `self`."""
    if source.kind == "self":
        return sample_from_model(model, n_samples, seq_len, seed)
    return random_windows(tokenize_joined(load_texts(source), tokenizer), n_samples, seq_len, seed)


def fingerprint(ids: Tensor) -> str:
    """sha256 of the token ids (int64, row-major): identifies exactly what text was used."""
    return hashlib.sha256(ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


def eval_windows(tokenizer, split: str, seq_len: int, max_windows: int | None) -> torch.Tensor:
    """WikiText-2 `split` as consecutive windows of seq_len tokens (the GPTQ/AWQ perplexity protocol)."""
    return sequential_windows(tokenize_joined(wikitext2_rows(split), tokenizer), seq_len, max_windows)
