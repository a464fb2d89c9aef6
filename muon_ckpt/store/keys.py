"""The DCP keys of a checkpoint, by parameter name (``_layout``'s docstring shows them all)."""

from muon_ckpt.store._layout import (
    KEY_FORMAT_VERSION,
    extra_key,
    model_key,
    optim_group_key,
    optim_state_key,
    rank_extra_key,
)

__all__ = [
    "KEY_FORMAT_VERSION",
    "extra_key",
    "model_key",
    "optim_group_key",
    "optim_state_key",
    "rank_extra_key",
]
