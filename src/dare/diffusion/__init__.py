"""Diffusion training primitives: keyed noise, forward corruption, and target log-probabilities."""
from .corruption import (apply_mask, bernoulli_mask, block_diffusion_inputs, cart_weights, exact_count_mask,
                         scatter_into)
from .logprob import DEFAULT_CHUNK, linear_log_prob, score_targets
from .noise import derive_seed, keyed_generator, sample_time, stratified_times

__all__ = [
    "apply_mask", "bernoulli_mask", "block_diffusion_inputs", "cart_weights", "exact_count_mask", "scatter_into",
    "DEFAULT_CHUNK", "linear_log_prob", "score_targets", "derive_seed", "keyed_generator", "sample_time",
    "stratified_times",
]
