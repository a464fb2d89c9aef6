"""Distributed Muon optimizer (Newton-Schulz on owner ranks, AdamW for non-matrix params)."""

from optim._report import NSWork, UpdateRule
from optim.muon import Muon
from optim.newton_schulz import set_ns_compile

__all__ = ["Muon", "NSWork", "UpdateRule", "set_ns_compile"]
