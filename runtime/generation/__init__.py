"""Sampling and stopping rules for token generation."""

from freetoken_agent.runtime.generation.sampling import SamplingParams, Sampler, StopChecker

__all__ = ["SamplingParams", "Sampler", "StopChecker"]
