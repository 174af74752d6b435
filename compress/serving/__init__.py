"""Serving-side loops: greedy decoding over a static KV cache, captured in a CUDA graph on a GPU
(static_decode.py), and the CUDA-graph helpers the decoder and the dispatcher's timings share (cuda_graph.py)."""
from ..kernels.cuda_graph import HostSync, capture, capture_problem, no_host_sync
from .static_decode import StaticDecoder, greedy_generate, static_problem

__all__ = ["HostSync", "StaticDecoder", "capture", "capture_problem", "greedy_generate", "no_host_sync",
           "static_problem"]
