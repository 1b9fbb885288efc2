"""The byte-level BPE tokenizer of the built-in model, trained with ``tokenizers`` on the training text."""

from __future__ import annotations

from collections.abc import Iterable

from freetoken_agent.evals.builtin.template import MARKUP_TOKENS, SPECIAL_TOKENS
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192) -> Tokenizer:
    """Train a GPT-2-style byte-level BPE of exactly ``vocab_size`` ids (special and markup tokens included).

    Special tokens get the first ids (``<|endoftext|>`` = 0, ``<|im_start|>`` = 1, ``<|im_end|>`` = 2), the
    markup tokens (``<tool_call>`` …) the last ones; none of them is ever split.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(MARKUP_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens(list(MARKUP_TOKENS))
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} ids, expected {vocab_size} (too little text?)")
    return tok


def hf_tokenizer(tok: Tokenizer, chat_template: str):  # -> transformers.PreTrainedTokenizerFast
    """Wrap ``tok`` for ``save_pretrained``: EOS ``<|im_end|>``, PAD ``<|endoftext|>``, no BOS, the chat template."""
    from freetoken_agent.evals.builtin.template import EOS_TOKEN, PAD_TOKEN
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                                      model_max_length=4096, clean_up_tokenization_spaces=False)
    wrapped.chat_template = chat_template
    return wrapped
