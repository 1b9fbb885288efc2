"""Reading Hugging Face model folders lazily: safetensors (mmap), sharded indexes, config, expert normalization."""

from freetoken_agent.runtime.checkpoint.reader import CheckpointReader, TensorInfo, load_config

__all__ = ["CheckpointReader", "TensorInfo", "load_config"]
