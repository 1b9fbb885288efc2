"""KV state: the contiguous per-sequence cache, paged pools, the radix prefix cache and sessions."""

from freetoken_agent.runtime.kv.cache import KVCache
from freetoken_agent.runtime.kv.paged import PagedKVCache
from freetoken_agent.runtime.kv.pool import OutOfPages, PagePool
from freetoken_agent.runtime.kv.radix import RadixCache
from freetoken_agent.runtime.kv.session import KVConfig, KVManager, Session

__all__ = ["KVCache", "KVConfig", "KVManager", "OutOfPages", "PagePool", "PagedKVCache", "RadixCache", "Session"]
