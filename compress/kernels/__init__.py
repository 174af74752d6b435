"""Matmul paths for quantized layers. `reference.py` holds the pure-torch implementations: the test oracle
and the fallback on every device."""
