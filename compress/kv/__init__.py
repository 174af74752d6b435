"""KV cache formats: fp8 / NVFP4 with calibrated per-layer scales, and KIVI-style int8 / int4."""
