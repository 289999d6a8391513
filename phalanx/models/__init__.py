"""Small example models for the examples, tests and benchmarks."""

from phalanx.models.gpt import GPT, GPTConfig, gpt_tp_plan
from phalanx.models.moe import MoE, Router

__all__ = ["GPT", "GPTConfig", "gpt_tp_plan", "MoE", "Router"]
