"""The wire of the SocketConnector: a prefill engine serves its prompts' KV blocks by block hash over TCP,
a decode engine fetches the blocks of its request (pure Python sockets, no torch).

One connection per fetch, length-prefixed, little-endian:

    request   magic "TLKVREQ2" | fingerprint digest (32) | count (uint32) | count x block hash (32)
    response  magic "TLKVRSP2" | status (uint8: 0 ok, 1 another fingerprint) | count (uint32)
              | count x (block hash (32) | crc32 (uint32) | payload)

A block hash is its digest (core/block_hash.py) zero-padded to 32 bytes; both ends run one algorithm, as it
is part of the fingerprint. Version 1 of the wire sent 64-bit ints: its magic differs, so an engine of
either version refuses the other's messages instead of misreading them.

The response holds the longest prefix of the requested hashes the server has (a prefix of blocks is all a
request can use); the client checks each block's hash, length and crc32 and keeps the prefix that checks.
A server of another fingerprint (model, dtype, block size, KV layout: spec.py) answers status 1 and no
blocks. No authentication: bind it to an address only the decode engines reach (kv_ip, default
127.0.0.1)."""

from __future__ import annotations

import logging
import socket
import socketserver
import struct
import threading
import zlib
from collections import OrderedDict

from tokenloom.core.block_hash import MAX_DIGEST_BYTES, padded_hash

logger = logging.getLogger(__name__)

REQUEST_MAGIC = b"TLKVREQ2"
RESPONSE_MAGIC = b"TLKVRSP2"
_REQUEST_HEAD = struct.Struct("<8s32sI")
_RESPONSE_HEAD = struct.Struct("<8sBI")
_HASH = MAX_DIGEST_BYTES  # a block hash on the wire: padded_hash()
_BLOCK_HEAD = struct.Struct(f"<{_HASH}sI")
STATUS_OK = 0
STATUS_OTHER_FINGERPRINT = 1
MAX_BLOCKS_PER_FETCH = 1 << 20  # a bound on what a request may ask (a garbled count is refused)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


class BlockStore:
    """The prefill side's sent blocks: block hash -> bytes, bounded by bytes, least recently used dropped
    first. Written by the worker side after each forward, read by the server's threads. Keyed by the hashes
    as the wire carries them (padded_hash: idempotent, so a hash given either way finds its block)."""

    def __init__(self, capacity_bytes: int, block_nbytes: int) -> None:
        self.capacity = max(1, capacity_bytes // block_nbytes)  # in blocks
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: bytes) -> bool:
        with self._lock:
            return padded_hash(block_hash) in self._blocks

    def put(self, block_hash: bytes, payload: bytes) -> None:
        key = padded_hash(block_hash)
        with self._lock:
            self._blocks[key] = payload
            self._blocks.move_to_end(key)
            while len(self._blocks) > self.capacity:
                self._blocks.popitem(last=False)

    def prefix(self, hashes: list[bytes]) -> list[tuple[bytes, bytes]]:
        """The stored blocks of the longest prefix of `hashes` (made most recent)."""
        out = []
        with self._lock:
            for h in map(padded_hash, hashes):
                payload = self._blocks.get(h)
                if payload is None:
                    break
                self._blocks.move_to_end(h)
                out.append((h, payload))
        return out


class BlockServer:
    """Serves a BlockStore on (host, port) from a thread; one thread per connection."""

    def __init__(self, store: BlockStore, digest: bytes, host: str, port: int) -> None:
        owner = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                owner._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            allow_reuse_address = True
            daemon_threads = True

        self.store = store
        self.digest = digest
        try:
            self._server = Server((host, port), Handler)
        except OSError as exc:
            raise RuntimeError(f"SocketConnector: cannot listen on {host}:{port} ({exc}); give each prefill engine "
                               "its own kv_port") from None
        self.address = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kv-block-server", daemon=True)
        self._thread.start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(30.0)
            magic, digest, count = _REQUEST_HEAD.unpack(_recv_exact(sock, _REQUEST_HEAD.size))
            if magic != REQUEST_MAGIC or count > MAX_BLOCKS_PER_FETCH:
                return  # not our protocol: drop the connection
            wire = bytes(_recv_exact(sock, _HASH * count))
            hashes = [wire[i:i + _HASH] for i in range(0, len(wire), _HASH)]
            if digest != self.digest:
                sock.sendall(_RESPONSE_HEAD.pack(RESPONSE_MAGIC, STATUS_OTHER_FINGERPRINT, 0))
                return
            blocks = self.store.prefix(hashes)
            sock.sendall(_RESPONSE_HEAD.pack(RESPONSE_MAGIC, STATUS_OK, len(blocks)))
            for h, payload in blocks:
                sock.sendall(_BLOCK_HEAD.pack(h, zlib.crc32(payload)))
                sock.sendall(payload)
        except (OSError, ConnectionError, struct.error) as exc:
            logger.info("KV block server: a fetch ended early (%s)", exc)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def fetch_blocks(host: str, port: int, digest: bytes, hashes: list[bytes], block_nbytes: int,
                 timeout_s: float = 30.0) -> list[bytearray]:
    """The payloads of the longest prefix of `hashes` the server at (host, port) has and that checks.
    Raises OSError / ConnectionError when the server cannot be reached or the exchange breaks, and
    ValueError when it was written under another fingerprint."""
    with socket.create_connection((host, port), timeout=min(timeout_s, 5.0)) as sock:
        sock.settimeout(timeout_s)
        wire = b"".join(padded_hash(h) for h in hashes)
        sock.sendall(_REQUEST_HEAD.pack(REQUEST_MAGIC, digest, len(hashes)) + wire)
        magic, status, count = _RESPONSE_HEAD.unpack(_recv_exact(sock, _RESPONSE_HEAD.size))
        if magic != RESPONSE_MAGIC:
            raise ConnectionError(f"{host}:{port} is not a tokenloom KV block server")
        if status == STATUS_OTHER_FINGERPRINT:
            raise ValueError(f"the prefill engine at {host}:{port} runs another model or cache options")
        out: list[bytearray] = []
        for expected in hashes[: min(count, len(hashes))]:
            h, crc = _BLOCK_HEAD.unpack(_recv_exact(sock, _BLOCK_HEAD.size))
            payload = _recv_exact(sock, block_nbytes)
            if h != padded_hash(expected) or zlib.crc32(payload) != crc:
                logger.warning("KV fetch from %s:%d: block %d of %d does not check; the rest is computed", host, port,
                               len(out), len(hashes))
                break
            out.append(payload)
        return out
