"""Flax modules that own parameters and call attnlab.attention: attention, Transformer blocks,
embeddings. See each module's docstring (attention.py documents the KV cache and sowing)."""

from attnlab.layers.attention import POSITION_BIASES
from attnlab.layers.attention import SCORES
from attnlab.layers.attention import T5_NUM_BUCKETS
from attnlab.layers.attention import MultiHeadAttention
from attnlab.layers.attention import mix_heads
from attnlab.layers.attention import project_kv
from attnlab.layers.attention import repeat_kv_heads
from attnlab.layers.dense import Dense
from attnlab.layers.dense import default_kernel_init
from attnlab.layers.dense import matmul
from attnlab.layers.embeddings import POSITIONS
from attnlab.layers.embeddings import Embeddings
from attnlab.layers.normalization import LayerNorm
from attnlab.layers.normalization import layer_norm
from attnlab.layers.transformer import ACTIVATIONS
from attnlab.layers.transformer import MLP
from attnlab.layers.transformer import NORM_POSITIONS
from attnlab.layers.transformer import TransformerBlock
from attnlab.layers.transformer import get_activation

__all__ = [
    "ACTIVATIONS", "Dense", "Embeddings", "LayerNorm", "MLP", "MultiHeadAttention",
    "NORM_POSITIONS", "POSITIONS", "POSITION_BIASES", "SCORES", "T5_NUM_BUCKETS",
    "TransformerBlock", "default_kernel_init", "get_activation", "layer_norm", "matmul",
    "mix_heads", "project_kv", "repeat_kv_heads",
]
