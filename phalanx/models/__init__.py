"""Small example models for the examples, tests and benchmarks."""

from phalanx.models.gpt import GPT, GPTConfig, gpt_tp_plan

__all__ = ["GPT", "GPTConfig", "gpt_tp_plan"]
