"""Tokenizers (``tokenizer.json`` via ``tokenizers``; tiktoken vocabularies) and Jinja chat templates."""

from freetoken_agent.runtime.tokenizer.chat import ChatTemplate
from freetoken_agent.runtime.tokenizer.tokenizer import IncrementalDecoder, Tokenizer

__all__ = ["ChatTemplate", "IncrementalDecoder", "Tokenizer"]
