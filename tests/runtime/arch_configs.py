"""The tiny per-type configs live in the library (``freetoken_agent.evals.fuzz.tiny``) so the option fuzzer can
build them too; this module keeps the tests' import path. Add per-type overrides there, in ``OVERRIDES``."""

from freetoken_agent.evals.fuzz.tiny import (  # noqa: F401
    N_LAYERS,
    OVERRIDES,
    causal_lm_class,
    make_config,
    make_model,
    moe_causal_lm_types,
    save_checkpoint,
    shrink,
)
