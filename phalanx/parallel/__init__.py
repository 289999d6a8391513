"""Parallel strategies: data, ZeRO, pipeline, tensor, and their composition."""
