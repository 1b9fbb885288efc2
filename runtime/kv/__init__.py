"""KV state: the per-sequence cache the decoder appends to."""

from freetoken_agent.runtime.kv.cache import KVCache

__all__ = ["KVCache"]
