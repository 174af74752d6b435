"""What the API returns: `Report` (report.json as an object) and `Result` (the compressed model in memory, its
report, and the ways to write it: `save`, `export`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from ..recipe import Recipe


@dataclass(frozen=True)
class Report:
    """A run's or an evaluation's report. `data` is report.json's content; the properties read the headline
    figures of one model (`compressed` after a run, `model` after evaluate), None where not measured."""
    data: dict

    @property
    def subject(self) -> str:
        models = self.models
        return "compressed" if "compressed" in models else next((n for n in models if n != "baseline"), "baseline")

    @property
    def models(self) -> dict:
        return (self.data.get("eval") or {}).get("models") or {}

    def figure(self, key: str, model: str | None = None):
        return self.models.get(model or self.subject, {}).get(key)

    @property
    def ppl(self) -> float | None:
        return self.figure("ppl")

    @property
    def baseline_ppl(self) -> float | None:
        return self.figure("ppl", "baseline")

    @property
    def kl(self) -> float | None:
        """Mean KL(baseline || model) per token, in nats."""
        return self.figure("kl")

    @property
    def top1_agreement(self) -> float | None:
        return self.figure("top1_agreement")

    @property
    def weight_bytes(self) -> int | None:
        weights = self.figure("weights") or {}
        return weights.get("total")

    def markdown(self) -> str:
        """report.md's text."""
        from ..pipeline.report import render_markdown
        return render_markdown(self.data)

    def __getitem__(self, key: str):
        return self.data[key]

    def __repr__(self) -> str:
        def f(v):
            return "n/a" if v is None else f"{v:.4g}"
        return (f"Report({self.subject}: ppl {f(self.ppl)} (baseline {f(self.baseline_ppl)}), KL {f(self.kl)}, "
                f"top-1 {f(self.top1_agreement)}, weights {self.weight_bytes} bytes)")


@dataclass
class Result:
    """A compressed model in memory (its QuantLinear layers compute what the saved checkpoint will), its tokenizer,
    the recipe that made it and its report; `output` is the run folder when `compress(..., output=...)` wrote one."""
    model: nn.Module
    tokenizer: object
    recipe: Recipe
    report: Report
    output: Path | None = None
    record: dict = field(default_factory=dict, repr=False)  # provenance (pipeline/provenance.py)

    def save(self, path: str | Path, overwrite: bool = False) -> Path:
        """The run folder `compress run` writes, without exports: the checkpoint (model*.safetensors, config.json,
        compress.json, the tokenizer), report.json / report.md and the recipe files; staged and renamed into place.
        `compress.load(path)`, `compress eval`, `compress export` and `compress verify` read it."""
        from ..export.card import write_run_cards
        from ..export.native import save_compressed
        from ..export.staging import staged
        from ..pipeline.calibration import check_output, write_run_report

        path = Path(path)
        check_output(path, overwrite)
        output = self.recipe.output
        report = {k: v for k, v in self.report.data.items() if k != "exports"}  # exports stay where they were
        with staged(path) as tmp:
            save_compressed(self.model, self.tokenizer, tmp, self.record, output.save_dtype, output.max_shard_bytes)
            write_run_report(report, tmp)
            (tmp / "recipe.yaml").write_text(self.recipe.text or self.recipe.resolved_yaml())
            (tmp / "recipe.resolved.yaml").write_text(self.recipe.resolved_yaml())
            write_run_cards(report, tmp)  # README.md, the Hub's model card
        return path

    def export(self, fmt: str, path: str | Path, overwrite: bool = False) -> Path:
        """Write the model as format `fmt` (`compress export --help` lists them) into folder `path`; export.json
        records the recipe and the original model. Refused, before anything is written, when the format cannot
        hold the model (the error names the layers and why)."""
        from ..export import export_model
        from ..export.card import write_card
        from ..measure.memory import folder_bytes

        meta = {"recipe_sha256": self.record.get("recipe_sha256"), "recipe": self.record.get("recipe"),
                "source_model": str(self.output.resolve()) if self.output else None,
                "original_model": self.record.get("source")}
        source = str(self.record.get("source") or "")
        record = export_model(self.model, self.tokenizer, fmt, path, meta, overwrite=overwrite,
                              source_gguf=source if source.endswith(".gguf") else None,
                              max_shard_bytes=self.recipe.output.max_shard_bytes)
        entry = {"format": fmt, "folder": str(path), "loaders": record.get("loaders", ""),
                 "bytes": folder_bytes(path), "notes": record.get("notes") or []}
        write_card(path, self.report.data, fmt, self.recipe.resolved_yaml(), entry, record)  # the model card
        return Path(path)
