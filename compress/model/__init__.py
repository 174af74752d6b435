"""Where models come from: the hub, a local folder, a GGUF file, the embedded default, weights streamed from disk
block by block, sharded safetensors."""
