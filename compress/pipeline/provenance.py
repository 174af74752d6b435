"""Where a run's output came from: one record, built once per run (the in-memory run and the streamed run alike),
that the saved checkpoint (compress.json), every export (export.json) and the report's header all take their
provenance from."""
from __future__ import annotations

from pathlib import Path

from .._version import __version__
from ..recipe import Recipe


def provenance(recipe: Recipe, source: str) -> dict:
    """The run's provenance: the compress version, the recipe (its sha256 and text as written) and the source model
    as resolved (a path or hub id: the same for a model loaded whole and one streamed block by block). Stored as it
    is in the saved checkpoint."""
    return {"compress_version": __version__, "recipe_sha256": recipe.sha256, "recipe": recipe.text, "source": source}


def export_provenance(record: dict, out: Path) -> dict:
    """What an export written into OUTPUT/exports/ records of the run (beside the exporter's own fields): the recipe,
    the compress checkpoint it came with (`out`) and the original model."""
    return {"recipe_sha256": record["recipe_sha256"], "recipe": record["recipe"], "source_model": str(out.resolve()),
            "original_model": record["source"]}
