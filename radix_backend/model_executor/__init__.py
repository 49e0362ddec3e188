"""From a checkpoint to forward passes: loading (HF directories, GGUF files), quantization, the model
runner, and tensor-parallel workers."""
