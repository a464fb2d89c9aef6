"""The state a checkpoint holds, in the shape DCP writes: model, optimizer and extra state as
one flat dict keyed by parameter name (``FlatState``), fitted to a checkpoint before a load
and applied after it; host copies of it for saves and for undoing a failed load."""

from muon_ckpt.state._about import ABOUT, describe
from muon_ckpt.state._apply import apply_loaded
from muon_ckpt.state._extra import check_objects, check_stateful, extra_digests, module_extra_states
from muon_ckpt.state._fit import LoadReport, fit
from muon_ckpt.state._flat import PARTS, FlatState, check_parts, prepare_optimizer_state
from muon_ckpt.state._names import canonical_names, param_fqns, strip_wrappers
from muon_ckpt.state._offloaded import freeze_offloaded, offloaded_views, optimizer_name
from muon_ckpt.state._rollback import Rollback
from muon_ckpt.state._rules import RuleCheck, record_rules
from muon_ckpt.state._staging import HostStaging
from muon_ckpt.state._structure import structure_records
from muon_ckpt.state._values import load_value, loadable, pack, unpack

__all__ = [
    "ABOUT",
    "PARTS",
    "FlatState",
    "HostStaging",
    "LoadReport",
    "Rollback",
    "RuleCheck",
    "apply_loaded",
    "canonical_names",
    "check_objects",
    "check_parts",
    "check_stateful",
    "describe",
    "extra_digests",
    "fit",
    "freeze_offloaded",
    "load_value",
    "loadable",
    "module_extra_states",
    "offloaded_views",
    "optimizer_name",
    "pack",
    "param_fqns",
    "prepare_optimizer_state",
    "record_rules",
    "strip_wrappers",
    "structure_records",
    "unpack",
]
