"""Declared version ranges are tested ranges: setup.py's lower bounds are the pins `make test-oldest` runs
(requirements/oldest.txt), and a Triton whose interpreter computes wrong answers is refused with the reason."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from fastbert import ops
from fastbert.backends import triton as triton_backend

ROOT = Path(__file__).resolve().parents[1]


def lower_bounds() -> dict[str, str]:
    """Every `name>=version` setup.py declares."""
    text = (ROOT / "setup.py").read_text()
    return {name.lower(): version for name, version in re.findall(r'"([A-Za-z0-9_.-]+)>=([0-9.]+)"', text)}


def oldest_pins() -> dict[str, str]:
    """Every `name==version` in requirements/oldest.txt."""
    text = (ROOT / "requirements" / "oldest.txt").read_text()
    return {name.lower(): version for name, version in re.findall(r"^([A-Za-z0-9_.-]+)==([0-9.]+)", text, re.M)}


def release(version: str) -> tuple[int, ...]:
    """A version as numbers without trailing zeros: 6.0.0 and 6.0 are one release."""
    parts = [int(part) for part in version.split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def test_every_declared_lower_bound_is_the_version_make_test_oldest_installs() -> None:
    bounds, pins = lower_bounds(), oldest_pins()
    claimed = {"torch", "transformers", "tokenizers", "triton", "sentence-transformers", "onnx", "onnxruntime"}
    assert claimed <= bounds.keys()
    for name, version in bounds.items():
        assert name in pins, f"setup.py declares {name}>={version}, which make test-oldest never installs"
        assert release(pins[name]) == release(version), f"setup.py: {name}>={version}; make test-oldest: {pins[name]}"


@pytest.mark.parametrize("version", [(3, 6), (3, 7)])
def test_an_old_triton_interpreter_is_refused_with_the_reason(version, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_backend, "triton_version", lambda: version)
    reason = triton_backend._device_check("cpu")
    assert reason is not None and "interpreter gives wrong answers" in reason and "triton >= 3.8" in reason
    with ops.use_backend("triton"), pytest.raises(Exception, match="interpreter gives wrong answers"):
        ops.bias_act(torch.randn(4, 8), torch.randn(8))  # a forced backend that cannot run raises, with why


def test_a_tested_triton_interpreter_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_backend, "triton_version", lambda: (3, 8))
    assert triton_backend._device_check("cpu") is None
