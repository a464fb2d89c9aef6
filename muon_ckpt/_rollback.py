"""All-or-nothing loads: what a load may change, captured before it changes it.

A load writes into the live tensors (DCP reads in place, so DTensors reshard on the way), and
a failure can come after some of them are written: a checksum that fails in the last file, a
rank whose read failed while the others succeeded, a hyperparameter that does not fit.
``Rollback`` keeps what is needed to undo that:

- the optimizer's structure (which params have state, the state dicts' entries, every param
  group's hyperparameters), and each ``extra`` object's state dict (host copies): cheap;
- the values of every live tensor the load will write into (model parameters and buffers,
  optimizer states that existed before the load, offloaded states through their host views):
  one host copy of this rank's share of the state, taken into the manager's reusable host
  staging buffers (page-locked where CUDA is), so device tensors copy at PCIe speed and no
  device memory is used. States created by the load itself are not copied: undoing the load
  removes them again.

``restore()`` puts everything back; ``done()`` gives the host copies up.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor

from muon_ckpt._tensors import host_copy, local_tensor
from muon_ckpt.io import HostStaging

__all__ = ["Rollback"]


class Rollback:
    def __init__(
        self,
        optimizer: torch.optim.Optimizer | None,
        extra: dict[str, Any],
        staging: HostStaging,
    ) -> None:
        self._optimizer = optimizer
        self._extra = extra
        self._staging = staging
        self._state: dict[Any, dict[str, Any]] = {}
        self._groups: list[dict[str, Any]] = []
        if optimizer is not None:
            self._state = {p: dict(st) for p, st in optimizer.state.items()}
            self._groups = [
                {k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                for g in optimizer.param_groups
            ]
        self._extra_sd = {name: host_copy(obj.state_dict()) for name, obj in extra.items()}
        self._pairs: list[tuple[Tensor, Tensor]] = []
        self._extra_touched = False

    def keep_values(self, sd: dict[str, Any], skip: set[str]) -> None:
        """Copy the values of ``sd``'s tensors (live tensors, or host views of offloaded
        states), except the keys in ``skip`` (states this load created), before DCP writes."""
        live = {k: v for k, v in sd.items() if isinstance(v, Tensor) and k not in skip}
        staged = self._staging.stage(live, copy_cpu=True)
        self._staging.finish()  # Sync: every copy has landed before DCP writes into a source
        self._pairs = [(local_tensor(live[k]), local_tensor(staged[k])) for k in live]
        self._extra_touched = True  # DCP writes into the tensors of extra's state dicts too

    @torch.no_grad()
    def restore(self) -> None:
        """Undo the load: values, optimizer structure and hyperparameters, extra state."""
        for dst, src in self._pairs:
            dst.copy_(src)
        opt = self._optimizer
        if opt is not None:
            for p in list(opt.state):
                if p not in self._state:
                    del opt.state[p]  # created by this load
            for p, entries in self._state.items():
                st = opt.state[p]
                st.clear()
                st.update(entries)
            for g, saved in zip(opt.param_groups, self._groups, strict=True):
                for k in [k for k in g if k != "params" and k not in saved]:
                    del g[k]
                g.update(saved)
        if self._extra_touched:
            for name, obj in self._extra.items():
                obj.load_state_dict(host_copy(self._extra_sd[name]))
        self.done()

    def done(self) -> None:
        self._pairs = []
