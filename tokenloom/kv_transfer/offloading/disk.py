"""The disk tier's files: one file per block, named by its block hash, in one directory per engine.

A file is an 88-byte header and the block's bytes:

    magic (8) | fingerprint digest (32) | block hash (32) | payload bytes (uint64) | crc32 (uint32) | pad (4)

The block hash is the digest of core/block_hash.py (prefix_caching_hash_algo, part of the fingerprint),
zero-padded to 32 bytes; the file name is the digest in hex. Format 1 (64-bit int hashes, 16-hex names,
magic TLKVBLK1) is never misread as format 2: its index's fingerprint differs, so the directory is
emptied of every block file, the old names included.

Written atomically (a temporary name in the same directory, then os.replace), so a reader sees a whole
file or none; a file cut short or changed on disk fails its length or checksum and is deleted, never
served. `index.json` holds the fingerprint (model, dtype, block size, KV layout: spec.py); a directory
whose index names another fingerprint is emptied (of this tier's files only) with a log line saying what
changed. A lock file keeps a second engine out of a directory in use. No fsync: a crash or a power loss
can lose recent files (the checksum catches a torn one), never serve a wrong one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import struct
import zlib
from pathlib import Path
from typing import Any

from tokenloom.core.block_hash import MAX_DIGEST_BYTES, padded_hash

logger = logging.getLogger(__name__)

MAGIC = b"TLKVBLK2"
_HEADER = struct.Struct(f"<8s32s{MAX_DIGEST_BYTES}sQI4x")
HEADER_BYTES = _HEADER.size  # 88
SUFFIX = ".kvb"
INDEX = "index.json"
LOCK = ".lock"


def file_name(block_hash: bytes) -> str:
    return f"{block_hash.hex()}{SUFFIX}"


def hash_of(name: str) -> bytes | None:
    """The block hash a file name stands for, None for another file (a format-1 name among them: 16 hex
    digits are no digest's length here)."""
    stem = name[: -len(SUFFIX)]
    if not name.endswith(SUFFIX) or len(stem) not in _DIGEST_HEX_LENGTHS:
        return None
    try:
        return bytes.fromhex(stem)
    except ValueError:
        return None


# sha256's 32 bytes and XXH3-128's 16, in hex.
_DIGEST_HEX_LENGTHS = (64, 32)


def is_block_file(name: str) -> bool:
    """Any block file of this tier, of either format (emptying a directory deletes the old ones too)."""
    return name.endswith(SUFFIX) and not name.startswith(".")


class DiskFiles:
    """The files of one disk tier directory. Both connector sides open it: the scheduler side reads
    (`read`, at lookup, so a bad file is never counted as a hit) and deletes; the worker side writes."""

    def __init__(self, directory: str | os.PathLike, digest: bytes, block_nbytes: int) -> None:
        self.dir = Path(directory)
        self.digest = digest
        self.block_nbytes = block_nbytes
        self.file_bytes = HEADER_BYTES + block_nbytes

    def path(self, block_hash: bytes) -> Path:
        return self.dir / file_name(block_hash)

    def write(self, block_hash: bytes, payload: memoryview | bytes) -> None:
        """Raises OSError (disk full, permissions); the caller drops the entry."""
        if len(payload) != self.block_nbytes:
            raise ValueError(f"a block is {self.block_nbytes} bytes, got {len(payload)}")
        header = _HEADER.pack(MAGIC, self.digest, padded_hash(block_hash), len(payload), zlib.crc32(payload))
        final = self.path(block_hash)
        tmp = self.dir / f".tmp.{os.getpid()}.{final.name}"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def read(self, block_hash: bytes) -> bytearray | None:
        """The block's bytes, or None when the file is missing, truncated, foreign or corrupt (then it is
        deleted, with a log line)."""
        path = self.path(block_hash)
        try:
            with open(path, "rb") as f:
                header = f.read(HEADER_BYTES)
                payload = bytearray(self.block_nbytes)
                n = f.readinto(payload)
                extra = f.read(1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            logger.warning("KV disk tier: cannot read %s (%s); skipped", path, exc)
            return None
        why = self._check(header, block_hash)
        if why is None and (n != self.block_nbytes or extra):
            why = f"{HEADER_BYTES + n}{'+' if extra else ''} bytes, expected {self.file_bytes}"
        if why is None and zlib.crc32(payload) != _HEADER.unpack(header)[4]:
            why = "checksum mismatch"
        if why is not None:
            logger.warning("KV disk tier: %s is not a valid block file (%s); deleted, not served", path.name, why)
            path.unlink(missing_ok=True)
            return None
        return payload

    def _check(self, header: bytes, block_hash: bytes) -> str | None:
        if len(header) != HEADER_BYTES:
            return "truncated header"
        magic, digest, stored_hash, length, _ = _HEADER.unpack(header)
        if magic != MAGIC:
            return "not a tokenloom KV block file"
        if digest != self.digest:
            return "another fingerprint"
        if stored_hash != padded_hash(block_hash):
            return "block hash differs from its name"
        if length != self.block_nbytes:
            return f"payload of {length} bytes, expected {self.block_nbytes}"
        return None

    def delete(self, block_hash: bytes) -> None:
        self.path(block_hash).unlink(missing_ok=True)

    def touch(self, block_hash: bytes) -> None:
        """Recency survives a restart through the file's mtime (the LRU order is rebuilt from it)."""
        with contextlib.suppress(OSError):
            os.utime(self.path(block_hash))


def lock_dir(directory: Path) -> int:
    """An exclusive lock on the directory for this engine's lifetime (a second engine is refused)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(f"KV offloading directory {directory} is in use by another engine (one engine per "
                           "directory: give each its own --kv-offloading-dir)") from None
    return fd


def open_dir(files: DiskFiles, fingerprint: dict[str, Any]) -> list[tuple[bytes, int]]:
    """Make the directory this fingerprint's: returns the valid block files as (block hash, mtime_ns),
    oldest first. A missing or different index empties the directory of block files (logged)."""
    directory = files.dir
    for stale in directory.glob(".tmp.*"):  # a write cut by a crash
        stale.unlink(missing_ok=True)
    index_path = directory / INDEX
    old: dict[str, Any] | None = None
    try:
        old = json.loads(index_path.read_text())
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:
        logger.warning("KV disk tier: %s is unreadable (%s); starting empty", index_path, exc)
    names = [p for p in directory.iterdir() if is_block_file(p.name)]
    if old is None or old.get("fingerprint") != fingerprint:
        if old is not None:
            before = old.get("fingerprint") or {}
            changed = sorted(k for k in set(before) | set(fingerprint) if before.get(k) != fingerprint.get(k))
            logger.warning("KV disk tier %s was written under another model or cache options (%s differ): "
                           "starting empty, %d block files deleted", directory, ", ".join(changed), len(names))
        for path in names:
            path.unlink(missing_ok=True)
        tmp = directory / f".tmp.{os.getpid()}.{INDEX}"
        tmp.write_text(json.dumps({"format": 2, "fingerprint": fingerprint}, indent=1, sort_keys=True))
        os.replace(tmp, index_path)
        return []
    found: list[tuple[bytes, int]] = []
    for path in names:
        block_hash = hash_of(path.name)
        if block_hash is None:  # a block file of no known name under this fingerprint: not ours to serve
            logger.warning("KV disk tier: %s is not a valid block file name; deleted", path.name)
            path.unlink(missing_ok=True)
            continue
        try:
            st = path.stat()
            with open(path, "rb") as f:
                header = f.read(HEADER_BYTES)
        except OSError:
            continue
        why = files._check(header, block_hash)
        if why is None and st.st_size != files.file_bytes:
            why = f"{st.st_size} bytes, expected {files.file_bytes}"
        if why is not None:
            logger.warning("KV disk tier: %s is not a valid block file (%s); deleted", path.name, why)
            path.unlink(missing_ok=True)
            continue
        found.append((block_hash, st.st_mtime_ns))
    found.sort(key=lambda e: e[1])
    return found
