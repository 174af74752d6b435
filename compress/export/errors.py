"""The export error, apart from the registry so that the format modules can raise it without importing it back."""


class ExportError(ValueError):
    """The model cannot be written in the requested format; raised before anything is written (or, for a refusal
    that needs a layer's data in a streamed export, before that layer is written, with nothing left behind)."""
