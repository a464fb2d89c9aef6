"""The save path and the one verifying load path.

Save: ``HostStaging`` (snapshot copies into reused host buffers), ``ChecksumWriter`` (DCP
writer that checksums every file as it writes it), ``SaveJob`` (write + commit + retention,
here or in the background). Load: ``VerifyingReader`` (DCP reader that checks every byte it
hands on against the manifest; local files through ``_itemread``), ``CheckpointReader`` (the
same in one process, for import, export and inspect). ``SafeLoadPlanner`` and ``dcp_failure``
keep DCP from unpickling untrusted bytes and turn its failures into muon-ckpt errors;
``unbounded_records`` says whether torch.load of a zip could expand beyond its bytes (every
stored item is checked with it before torch.load, as are import's torch.save files).
"""

from muon_ckpt.io._dcp import DCP_ERRORS, SafeLoadPlanner, dcp_failure, interrupt_in
from muon_ckpt.io._itemzip import unbounded_records
from muon_ckpt.io._open import CheckpointReader
from muon_ckpt.io._reader import VerifyingReader
from muon_ckpt.io._save import SaveJob, WriteSpec
from muon_ckpt.io._staging import HostStaging

__all__ = [
    "DCP_ERRORS",
    "CheckpointReader",
    "HostStaging",
    "SafeLoadPlanner",
    "SaveJob",
    "VerifyingReader",
    "WriteSpec",
    "dcp_failure",
    "interrupt_in",
    "unbounded_records",
]
