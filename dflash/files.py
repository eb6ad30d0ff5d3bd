"""Paths and directories: what ships with the package, writes that are never half done,
and the digests that let a directory be read back only as it was written."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
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


DIGESTS = "digests.json"  # written last into a directory: every other file's size and SHA-256
# Each file is hashed in chunks of this many bytes, several at once (hashlib lets go of the
# GIL while it hashes, so a writer's thread does not hold up training's), and a mismatch
# names the byte range that changed.
CHUNK_BYTES = 64 * 2**20
READ_BYTES = 8 * 2**20


class DamagedFiles(ValueError):
    """A directory whose files are not those its digests were written for."""


def _hash_chunk(path: Path, offset: int, size: int) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        f.seek(offset)
        left = size
        while left:
            block = f.read(min(left, READ_BYTES))
            if not block:
                break
            digest.update(block)
            left -= len(block)
    return digest.hexdigest()


def _chunks(path: Path, size: int, chunk: int, pool: ThreadPoolExecutor) -> list[str]:
    """The SHA-256 of each ``chunk`` bytes of the ``size`` bytes of ``path``, hashed at once."""
    return list(pool.map(lambda at: _hash_chunk(path, at, min(chunk, size - at)), range(0, size, chunk)))


def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="digest")


def write_digests(directory: Path) -> Path:
    """Record the size and chunk digests of every file under ``directory`` in
    :data:`DIGESTS`, written last: a directory holding it was written whole."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != DIGESTS)
    with _pool() as pool:
        record = {str(p.relative_to(directory)): {"bytes": (size := p.stat().st_size),
                                                   "sha256": _chunks(p, size, CHUNK_BYTES, pool)} for p in files}
    out = directory / DIGESTS
    out.write_text(json.dumps({"algorithm": "sha256", "chunk_bytes": CHUNK_BYTES, "files": record}, indent=1) + "\n")
    return out


def verify_digests(directory: Path) -> bool:
    """Check every file ``directory``'s digests name against them: True when all match,
    False when there are no digests to check (a directory written before they were
    kept). Raises :class:`DamagedFiles` naming the first file that differs and how:
    missing, truncated or grown, or a byte range whose digest changed."""
    path = directory / DIGESTS
    if not path.is_file():
        return False
    try:
        recorded = json.loads(path.read_text())
        chunk, files = int(recorded["chunk_bytes"]), dict(recorded["files"])
    except (ValueError, KeyError, TypeError) as e:
        raise DamagedFiles(f"{path}: unreadable digests ({e})") from None
    if recorded.get("algorithm") != "sha256":
        raise DamagedFiles(f"{path}: digests of algorithm {recorded.get('algorithm')!r}, not sha256")
    with _pool() as pool:
        for name, entry in files.items():
            file = directory / name
            if not file.is_file():
                raise DamagedFiles(f"{file}: missing (its digest was written with the directory)")
            size = file.stat().st_size
            if size != entry["bytes"]:
                how = "truncated" if size < entry["bytes"] else "grown"
                raise DamagedFiles(f"{file}: {how}, {size} bytes where {entry['bytes']} were written")
            found = _chunks(file, size, chunk, pool)
            if len(found) != len(entry["sha256"]):
                raise DamagedFiles(f"{path}: {len(entry['sha256'])} chunk digests for {file.name}, whose "
                                   f"{size} bytes make {len(found)}")
            for i, (got, want) in enumerate(zip(found, entry["sha256"])):
                if got != want:
                    end = min(size, (i + 1) * chunk)
                    raise DamagedFiles(f"{file}: bytes {i * chunk}-{end} differ from what was written (SHA-256 "
                                       f"{got[:12]}, {want[:12]} recorded)")
    return True
