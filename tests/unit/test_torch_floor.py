"""The minimum torch in pyproject.toml is one the code runs on.

``NEWER_APIS`` lists torch APIs that appeared after torch 2.0, with the release that
brought each. Every one the framework's sources call must be no newer than the floor that
``pyproject.toml`` declares (pip installs that floor on a machine whose torch is older,
and set-up keeps an installed GPU build that satisfies it): ``get_total_norm`` came in
2.6, so a floor of 2.4 let 2.4 and 2.5 fail at the first step. A new API that raises the
need goes into the table, and the floor follows.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("parallel", "cosmoflow", "unet3d", "scripts")

# API (as written in the code) -> the torch release that introduced it (release notes).
NEWER_APIS: dict[str, tuple[int, int]] = {
    "get_total_norm": (2, 6),
    "clip_grads_with_norm_": (2, 6),
    "torch.amp.GradScaler": (2, 3),
    "nn.CircularPad3d": (2, 1),
    "add_safe_globals": (2, 4),
    "nn.RMSNorm": (2, 4),
}


def declared_floor() -> tuple[int, int]:
    """The ``torch>=X.Y`` of pyproject.toml's dependencies."""
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    found = re.findall(r'"torch>=(\d+)\.(\d+)[^"]*"', text)
    assert len(found) == 1, f"pyproject.toml: expected one 'torch>=X.Y' requirement, found {found}"
    return int(found[0][0]), int(found[0][1])


def used_apis() -> dict[str, list[str]]:
    """Each API of ``NEWER_APIS`` that the sources use, with the files using it."""
    used: dict[str, list[str]] = {}
    for folder in SOURCES:
        for path in sorted((REPO / folder).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            for api in NEWER_APIS:
                if re.search(rf"\b{re.escape(api)}\b", text):
                    used.setdefault(api, []).append(str(path.relative_to(REPO)))
    return used


def test_the_declared_torch_floor_has_every_api_the_code_calls():
    floor = declared_floor()
    too_new = {api: (NEWER_APIS[api], files) for api, files in used_apis().items() if NEWER_APIS[api] > floor}
    assert not too_new, (f"pyproject.toml allows torch {floor[0]}.{floor[1]}, but the code calls "
                         + "; ".join(f"{api} (torch {v[0]}.{v[1]}, in {', '.join(f)})" for api, (v, f) in too_new.items()))


def test_the_installed_torch_meets_the_floor():
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    assert (major, minor) >= declared_floor(), torch.__version__
    assert hasattr(torch.nn.utils, "get_total_norm")


def test_set_up_installs_the_same_floor_where_no_torch_is_present():
    text = (REPO / "scripts" / "setup.sh").read_text(encoding="utf-8")
    floors = set(re.findall(r"torch>=(\d+\.\d+)", text))
    assert floors == {"{}.{}".format(*declared_floor())}, floors
