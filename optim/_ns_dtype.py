"""How Newton-Schulz runs: its dtype (``ns_dtype``: bfloat16 where the device multiplies it
fast, else float32) and its method (``ns_method``: the Gram iteration for wide matrices where
it is the faster one, else the standard one).

A bf16 matrix product is ~4x faster than fp32 on a CPU with AVX512-BF16 or AMX (and on a
CUDA GPU with bf16 tensor cores), but ~40x SLOWER on a CPU without them, where torch falls back
to a scalar loop (768^2: 2 GFLOP/s against 74 GFLOP/s in fp32). ``ns_dtype="auto"`` picks per
device from its features, never from a timing: a measured probe could flip between two runs
on one host, and N ranks == 1 process must run the very same arithmetic.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

__all__ = [
    "NS_DTYPES",
    "NS_DTYPE_CHOICES",
    "NS_METHODS",
    "NS_METHOD_CHOICES",
    "auto_ns_dtype",
    "auto_ns_method",
    "fast_bf16_reason",
    "resolve_ns_dtype",
    "resolve_ns_method",
]

NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
NS_DTYPE_CHOICES = ("auto", *NS_DTYPES)
NS_METHODS = ("standard", "gram")
NS_METHOD_CHOICES = ("auto", *NS_METHODS)

_log = logging.getLogger("optim.muon")


def _cpu_has(name: str) -> bool:
    check = getattr(torch.cpu, f"_is_{name}_supported", None)  # (private: absent -> no)
    try:
        return bool(check()) if check is not None else False
    except (RuntimeError, AttributeError):
        return False


@functools.cache
def _cpu_bf16_unit() -> str | None:
    """The CPU's bf16 matrix unit torch's oneDNN matmul uses, or None."""
    if _cpu_has("amx_tile"):
        return "AMX"
    if _cpu_has("avx512_bf16"):
        return "AVX512-BF16"
    if _arm_bf16():
        return "Arm BF16"
    return None


def _arm_bf16() -> bool:
    # On aarch64, oneDNN's bf16 check is the CPU's BF16 extension (BFMMLA); on x86 it also
    # accepts AVX512 without BF16, which only emulates bf16, so it is asked on Arm only.
    import platform

    if platform.machine().lower() not in ("aarch64", "arm64"):
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (RuntimeError, AttributeError):
        return False


@functools.cache
def _cuda_bf16(index: int) -> str | None:
    major, minor = torch.cuda.get_device_capability(index)
    # Tensor cores take bf16 from sm80 (Ampere) on; older GPUs emulate it.
    return f"sm{major}{minor} bf16 tensor cores" if major >= 8 else None


def fast_bf16_reason(device: torch.device) -> str | None:
    """Why ``device`` multiplies bf16 matrices fast (its unit), or None where it does not."""
    if device.type == "cuda":
        return _cuda_bf16(device.index if device.index is not None else 0)
    if device.type == "cpu":
        if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
            return None  # without oneDNN, bf16 matmul is the scalar fallback
        return _cpu_bf16_unit()
    return None


_logged: set[tuple[str, str]] = set()


def auto_ns_dtype(device: torch.device) -> str:
    """What ``ns_dtype="auto"`` means on ``device``: ``"bf16"`` or ``"fp32"`` (logged once)."""
    reason = fast_bf16_reason(device)
    choice = "bf16" if reason else "fp32"
    if (device.type, choice) not in _logged:
        _logged.add((device.type, choice))
        why = f"it has {reason}" if reason else "it has no fast bf16 matrix unit"
        _log.info("Muon: ns_dtype='auto' runs Newton-Schulz in %s on %s (%s)", choice, device, why)
    return choice


def resolve_ns_dtype(group: dict[str, Any]) -> None:
    """Replace a param group's ``ns_dtype="auto"`` by what it means on its params' device."""
    if group["ns_dtype"] == "auto" and group["params"]:
        group["ns_dtype"] = auto_ns_dtype(group["params"][0].device)


def auto_ns_method(device: torch.device, ns_dtype: str) -> str:
    """What ``ns_method="auto"`` means for a group of ``ns_dtype`` on ``device``: ``"gram"``
    (the Gram iteration for matrices whose aspect ratio exceeds 2) in fp32, on every device;
    ``"standard"`` for bf16. A bf16 group's Gram iteration computes in float16: CPUs without
    float16 matrix units multiply that slowly, and on an H100 it was 1.10x the standard
    iteration on the GPT-like set (docs/benchmarks.md, Gram Newton-Schulz)."""
    del device  # the same choice on every device today; kept for the next measurement
    return "gram" if ns_dtype == "fp32" else "standard"


def resolve_ns_method(group: dict[str, Any]) -> None:
    """Replace a param group's ``ns_method="auto"`` by what it means for its (resolved)
    ``ns_dtype`` on its params' device; call after ``resolve_ns_dtype``."""
    if group["ns_method"] == "auto" and group["params"] and group["ns_dtype"] != "auto":
        group["ns_method"] = auto_ns_method(group["params"][0].device, group["ns_dtype"])
