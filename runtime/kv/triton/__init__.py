"""Triton paged attention for GPUs (decode: one query per sequence, keys/values read through a page table).

Importing this package does not import triton; the launcher does, when it runs.
"""

from freetoken_agent.runtime.kv.triton.paged_attention import paged_attention_decode, reference_paged_attention

__all__ = ["paged_attention_decode", "reference_paged_attention"]
