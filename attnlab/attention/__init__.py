"""Pure-functional attention primitives (no Flax): jnp arrays in, jnp arrays out."""

from attnlab.attention.core import FAST_SCORES
from attnlab.attention.core import HardAttention
from attnlab.attention.core import IMPLEMENTATIONS
from attnlab.attention.core import attend
from attnlab.attention.core import choose_implementation
from attnlab.attention.core import hard_attend
from attnlab.attention.core import local_attend
from attnlab.attention.core import local_window_weights
from attnlab.attention.core import masked_softmax
from attnlab.attention.core import merge_heads
from attnlab.attention.core import monotonic_centers
from attnlab.attention.core import predict_position
from attnlab.attention.core import reinforce_loss
from attnlab.attention.core import split_heads
from attnlab.attention.efficient import bigbird_attention
from attnlab.attention.efficient import bigbird_mask
from attnlab.attention.efficient import block_sparse_attention
from attnlab.attention.efficient import init_linformer_projections
from attnlab.attention.efficient import linear_attention
from attnlab.attention.efficient import linear_attention_weights
from attnlab.attention.efficient import linformer_attention
from attnlab.attention.efficient import linformer_weights
from attnlab.attention.efficient import performer_attention
from attnlab.attention.efficient import performer_features
from attnlab.attention.efficient import performer_weights
from attnlab.attention.efficient import sliding_window_attention
from attnlab.attention.efficient import sliding_window_mask
from attnlab.attention.masks import causal_mask
from attnlab.attention.masks import check_mask
from attnlab.attention.masks import combine
from attnlab.attention.masks import local_mask
from attnlab.attention.masks import padding_mask
from attnlab.attention.normalizers import NORMALIZERS
from attnlab.attention.normalizers import init_normalizer_params
from attnlab.attention.normalizers import normalize
from attnlab.attention.pooling import average_pooling
from attnlab.attention.pooling import context_attention_pooling
from attnlab.attention.pooling import init_context_pooling_params
from attnlab.attention.pooling import init_kernel_params
from attnlab.attention.pooling import learned_kernel_pooling
from attnlab.attention.pooling import leave_one_out_mask
from attnlab.attention.pooling import masked_mean
from attnlab.attention.pooling import nadaraya_watson
from attnlab.attention.positions import AlibiBias
from attnlab.attention.positions import T5Bias
from attnlab.attention.positions import alibi_bias
from attnlab.attention.positions import alibi_slopes
from attnlab.attention.positions import init_t5_table
from attnlab.attention.positions import sinusoidal
from attnlab.attention.positions import t5_bias
from attnlab.attention.positions import t5_relative_bucket
from attnlab.attention.registry import MECHANISMS
from attnlab.attention.registry import POSITIONS_BIAS
from attnlab.attention.registry import Mechanism
from attnlab.attention.registry import get_mechanism
from attnlab.attention.scores import PARAMETRIC_SCORES
from attnlab.attention.scores import SCORE_FNS
from attnlab.attention.scores import SCORE_PARAM_NAMES
from attnlab.attention.scores import additive
from attnlab.attention.scores import cosine
from attnlab.attention.scores import dot
from attnlab.attention.scores import general
from attnlab.attention.scores import get_score_fn
from attnlab.attention.scores import init_score_params
from attnlab.attention.scores import location
from attnlab.attention.scores import precompute_keys
from attnlab.attention.scores import scaled_dot

__all__ = [
    "AlibiBias", "MECHANISMS", "Mechanism", "NORMALIZERS", "POSITIONS_BIAS", "T5Bias",
    "alibi_bias", "alibi_slopes", "bigbird_attention", "bigbird_mask", "block_sparse_attention",
    "get_mechanism", "init_linformer_projections", "init_normalizer_params", "init_t5_table",
    "linear_attention", "linear_attention_weights", "linformer_attention", "linformer_weights",
    "normalize", "performer_attention", "performer_features", "performer_weights",
    "sliding_window_attention", "sliding_window_mask", "t5_bias", "t5_relative_bucket",
    "FAST_SCORES", "HardAttention", "IMPLEMENTATIONS", "PARAMETRIC_SCORES", "SCORE_FNS",
    "SCORE_PARAM_NAMES", "additive", "attend", "average_pooling", "causal_mask", "check_mask",
    "choose_implementation", "combine", "context_attention_pooling", "cosine", "dot", "general",
    "get_score_fn", "hard_attend", "init_context_pooling_params", "init_kernel_params", "init_score_params", "learned_kernel_pooling",
    "leave_one_out_mask", "local_attend", "local_mask", "local_window_weights", "location",
    "masked_mean", "masked_softmax", "merge_heads", "monotonic_centers", "precompute_keys",
    "nadaraya_watson", "padding_mask", "predict_position", "reinforce_loss",
    "scaled_dot", "sinusoidal", "split_heads",
]
