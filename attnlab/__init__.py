"""attnlab: a JAX/Flax research framework for studying attention mechanisms."""

__version__ = "0.1.0"
