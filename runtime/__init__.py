"""The MoE inference engine (``freetoken_agent.runtime``).

Parts, one folder each: ``checkpoint/`` (reading HF folders), ``model/`` (ModelSpec + the generic decoder),
``generation/`` (sampling, stopping), ``tokenizer/`` (tokenizers, chat templates); ``engine.py`` is the API.
The runtime never imports the SDK, tools or evals.
"""
