"""Adapters from the benchmark files in the data folder (upstream releases) to the columns the official
lm-eval tasks read (their hub exports). Facts: ../../../shared/LMEVAL_OFFLINE.md, section 2.2. Used by the
task files beside this one through `!function adapters.<name>`; compress copies this file next to them."""
from __future__ import annotations

import json
import re
from pathlib import Path


def arc_docs(dataset):
    """Upstream ARC rows {question: {stem, choices: [{text, label}]}, answerKey} -> the hub's flat columns."""
    def flat(doc):
        q = doc["question"]
        return {"question": q["stem"], "choices": {"text": [c["text"] for c in q["choices"]],
                                                   "label": [c["label"] for c in q["choices"]]},
                "answerKey": doc["answerKey"]}
    return dataset.map(flat, remove_columns=dataset.column_names)


def boolq_docs(dataset):
    """SuperGLUE BoolQ keeps `label` as a JSON bool; the hub's class index is an int (cast, not map: a map keeps
    the bool type in datasets 5)."""
    from datasets import Value
    return dataset.cast_column("label", Value("int64"))


def piqa_dataset(data_dir: str, **_):
    """PIQA validation: goal/sol1/sol2 from valid.jsonl joined by line with the labels in valid-labels.lst."""
    from datasets import Dataset, DatasetDict
    folder = Path(data_dir) / "piqa"
    rows = [json.loads(line) for line in (folder / "valid.jsonl").read_text().splitlines() if line.strip()]
    labels = [int(x) for x in (folder / "valid-labels.lst").read_text().split()]
    if len(rows) != len(labels):
        raise ValueError(f"{folder}: {len(rows)} questions but {len(labels)} labels")
    return DatasetDict({"validation": Dataset.from_list([{**r, "label": y} for r, y in zip(rows, labels)])})


def _is_title(line: str) -> bool:
    s = re.sub(r"= = =|= =", "=", line).strip()  # sub-headings collapse to "= ... =" too; top level is "= x ="
    return line.startswith(" = ") and not line.startswith(" = = ") and s.startswith("= ") and s.endswith(" =")


def wiki_pages(path: Path) -> list[str]:
    """The raw WikiText file cut into pages before each top-level title, lines joined with "\\n", empty chunks
    dropped but the last kept: the rule of the hub's wikitext_document_level loading script."""
    pages, current = [], []
    for line in path.read_text(encoding="utf-8").split("\n"):
        if _is_title(line) and current:
            text = "\n".join(current)
            if text.strip():
                pages.append(text)
            current = []
        current.append(line)
    pages.append("\n".join(current))
    return pages


def wikitext_dataset(data_dir: str, **_):
    from datasets import Dataset, DatasetDict
    folder = Path(data_dir) / "wikitext-2-raw"
    return DatasetDict({split: Dataset.from_list([{"page": p} for p in wiki_pages(folder / name)])
                        for split, name in (("test", "wiki.test.raw"), ("validation", "wiki.valid.raw"))})
