"""Running a recipe: one sequence over a model source (`source.py`), the model loaded whole (`resident.py`) or
streamed from disk block by block (`streamed.py`), the calibration pass they
share (`calibration.py`), the whole-model stages, the memory plan made before any heavy work, and the report."""
