"""Sequence mixers other than softmax attention (recurrent layers of hybrid models); state lives in the KV cache."""
