"""muon-ckpt: checkpoint distributed training runs, centred on optimizer state."""

__version__ = "0.1.0"

__all__ = ["__version__"]
