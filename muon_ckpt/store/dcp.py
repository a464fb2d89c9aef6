"""DCP's side of a stored step: its ``.metadata`` read without unpickling untrusted bytes
(and checked: paths, byte ranges, chunks that tile each tensor) and written in columns (its
stored items a ``StorageIndex``), and the filesystem its readers and writers go through (a
Storage's)."""

from muon_ckpt.store._chunklist import ChunkList, chunk_list
from muon_ckpt.store._chunks import check_held_chunks, tiling_problem
from muon_ckpt.store._dcpfs import DelegatingFileSystem, dcp_filesystem
from muon_ckpt.store._files import check_files
from muon_ckpt.store._index import Gathered, StorageIndex, Written
from muon_ckpt.store._metadata import bytes_keys, parse_metadata, tensor_entries, unpack_metadata
from muon_ckpt.store._packed import dump_metadata, metadata_bytes

__all__ = [
    "ChunkList",
    "DelegatingFileSystem",
    "Gathered",
    "StorageIndex",
    "Written",
    "bytes_keys",
    "check_files",
    "check_held_chunks",
    "chunk_list",
    "dcp_filesystem",
    "dump_metadata",
    "metadata_bytes",
    "parse_metadata",
    "tensor_entries",
    "tiling_problem",
    "unpack_metadata",
]
