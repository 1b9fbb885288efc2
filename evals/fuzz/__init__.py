"""Config-option fuzzing: tiny random checkpoints of every MoE type (``tiny``), option variants read from the
transformers config classes (``variants``), and the parity sweep against transformers (``options``)."""
