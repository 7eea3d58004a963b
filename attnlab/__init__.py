"""attnlab: a JAX/Flax research framework for studying attention mechanisms."""

from attnlab import allocator as _allocator

__version__ = "0.1.0"

_allocator.keep_freed_memory()
