"""Running a recipe: the resident run (`resident.py`) and the streamed run (`streamed.py`), the calibration pass they
share (`calibration.py`), the whole-model stages, the memory plan made before any heavy work, and the report."""
