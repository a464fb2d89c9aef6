"""Compressed tensor items (``compression="zstd"``): the encoding (``_codec``), and DCP's
extension registry that lets plain ``torch.distributed.checkpoint`` read them."""

from muon_ckpt.store._codec import (
    DESCRIPTOR,
    MIN_COMPRESS_BYTES,
    ZIP_SLACK,
    BadEncoding,
    Encoder,
    decode,
    extension_registry,
    require_zstd,
    stride_of,
)

__all__ = [
    "DESCRIPTOR",
    "MIN_COMPRESS_BYTES",
    "ZIP_SLACK",
    "BadEncoding",
    "Encoder",
    "decode",
    "extension_registry",
    "require_zstd",
    "stride_of",
]
