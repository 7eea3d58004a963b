"""attnlab: a JAX/Flax research framework for studying attention mechanisms.

Importing attnlab changes nothing in the process; the CPU tuning (allocator thresholds, the
device split over cores) is switched on by the entry points through attnlab.backends.cpu.enable.
"""

__version__ = "0.1.0"
