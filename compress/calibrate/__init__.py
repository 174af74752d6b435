"""Calibration: text in windows, the block-by-block pass, the statistics observers collect, and their reduction over
data-parallel processes."""
