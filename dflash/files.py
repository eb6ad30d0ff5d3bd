"""Paths and directories: what ships with the package, and writes that are never half done."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

ASSETS = Path(__file__).parent / "assets"
# Names that address what ships with the package, per kind of path.
SHIPPED = {
    "target": {"demo": "demo_target"},
    "data": {"demo": "demo_data/train.jsonl", "demo_heldout": "demo_data/heldout.jsonl"},
}


def local_path(kind: str, path: str) -> Path:
    """``path`` as a local path, or the shipped asset it names (``demo`` and friends)."""
    name = SHIPPED[kind].get(path)
    return ASSETS / name if name else Path(path).expanduser()


def staging_dir(final: Path) -> Path:
    """An empty directory beside ``final`` to write into before :func:`publish`."""
    tmp = final.with_name(f".tmp_{final.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def publish(tmp: Path, final: Path) -> Path:
    """Replace ``final`` by the finished ``tmp`` in one rename, so a crash leaves either
    the old directory or the new one, never a half-written one."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final
