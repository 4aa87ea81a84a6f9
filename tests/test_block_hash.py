"""Prefix-cache block hashes (tokenloom/core/block_hash.py): vLLM's prefix_caching_hash_algo.

Blocks built to collide under the old scheme (Python's tuple hash) no longer share a cached block; each
algorithm chains from its root and gives the same digests in another process; a bad name, or xxhash
without its package, is refused; the disk tier refuses the old scheme's files.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys

import pytest

from tokenloom.config import CacheConfig, ConfigError, SchedulerConfig
from tokenloom.core import block_hash as bh
from tokenloom.core.kv_cache_manager import KVCacheManager
from tokenloom.core.request import Request
from tokenloom.core.scheduler_factory import make_scheduler
from tokenloom.kv_transfer.offloading.disk import DiskFiles, file_name, open_dir
from tokenloom.router.prefix_index import prompt_block_hashes
from tokenloom.sampling_params import SamplingParams

ALGOS = bh.HASH_ALGOS
BS = 16
# Python hashes an int as its value modulo 2**61 - 1, so a token id and that id plus the modulus hash alike,
# and so do two tuples that differ only there (tuple hash is a function of its items' hashes).
INT_HASH_MODULUS = 2**61 - 1
# tokenloom's root parent before the digests (its ROOT_PARENT_HASH).
OLD_ROOT_PARENT = 0x746F6B656E6C6F6F


def _request(rid: str, tokens: list[int], algo: str) -> Request:
    request = Request(rid, tokens, SamplingParams(max_tokens=4))
    request.set_block_size(BS, algo)
    return request


@pytest.fixture(autouse=True)
def _default_root_seed(monkeypatch):
    """Digests here are those of the fixed root seed (PYTHONHASHSEED would seed the root, as in vLLM)."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


@pytest.mark.parametrize("algo", ALGOS)
def test_blocks_built_to_collide_under_the_old_hash_share_no_cached_block(algo):
    victim = list(range(100, 100 + BS))
    forged = [victim[0] + INT_HASH_MODULUS] + victim[1:]
    # The attack on the old scheme: the forged block had the victim's hash, so it would have been served
    # the victim's KV.
    assert hash((OLD_ROOT_PARENT, tuple(victim))) == hash((OLD_ROOT_PARENT, tuple(forged)))

    kv = KVCacheManager(num_blocks=8, block_size=BS, max_model_len=256)
    first = _request("victim", victim + [1], algo)
    blocks, n = kv.get_computed_blocks(first)
    kv.allocate_slots(first, BS + 1, n, blocks)
    first.num_computed_tokens = BS + 1

    attacker = _request("attacker", forged + [1], algo)
    assert attacker.block_hashes[0] != first.block_hashes[0]
    assert kv.get_computed_blocks(attacker)[1] == 0
    # Control: the victim's own prompt again is a hit, so the miss above is the hash's doing.
    assert kv.get_computed_blocks(_request("again", victim + [2], algo))[1] == BS


@pytest.mark.parametrize("algo", ALGOS)
def test_each_algorithm_chains_from_its_root(algo):
    fn = bh.get_hash_fn_by_name(algo)
    tokens = list(range(3 * BS))
    hashes = _request("r", tokens, algo).block_hashes
    root = bh.root_parent_hash(algo)
    assert root == fn(bh.DEFAULT_ROOT_SEED)  # vLLM's NONE_HASH under a fixed seed
    assert hashes[0] == fn((root, tuple(tokens[:BS]), None))
    assert hashes[1] == fn((hashes[0], tuple(tokens[BS:2 * BS]), None))
    assert all(isinstance(h, bytes) and len(h) == (32 if algo.startswith("sha256") else 16) for h in hashes)
    # The same block at another depth, or under a LoRA adapter, is another block.
    repeated = _request("s", tokens[:BS] * 2, algo).block_hashes
    assert repeated[0] == hashes[0] and repeated[1] != repeated[0]
    assert bh.hash_block_tokens(None, tuple(tokens[:BS]), (7,), algo) != hashes[0]
    # The router's prefix index keys are the engines' hashes.
    assert prompt_block_hashes(tokens, BS, None, algo) == hashes


def test_sha256_is_vllms_digest():
    """vLLM's sha256: SHA-256 of the pickled (parent, tokens, extra_keys), from sha256 of the seed."""
    root = hashlib.sha256(pickle.dumps(bh.DEFAULT_ROOT_SEED, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert bh.root_parent_hash("sha256") == root
    expected = hashlib.sha256(pickle.dumps((root, (1, 2, 3), None), protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert bh.hash_block_tokens(None, (1, 2, 3)) == expected


@pytest.mark.parametrize(("value", "encoded"), [
    # RFC 8949, Appendix A.
    (0, "00"), (23, "17"), (24, "1818"), (100, "1864"), (1000, "1903e8"), (1000000, "1a000f4240"),
    (1000000000000, "1b000000e8d4a51000"), (-1, "20"), (-100, "3863"), (-1000, "3903e7"), (b"", "40"),
    (b"\x01\x02\x03\x04", "4401020304"), ("", "60"), ("a", "6161"), ("IETF", "6449455446"), ((), "80"),
    ((1, 2, 3), "83010203"), ((1, (2, 3), [4, 5]), "8301820203820405"), (None, "f6"), (False, "f4"), (True, "f5"),
])
def test_canonical_cbor_is_rfc_8949(value, encoded):
    assert bh.canonical_cbor(value).hex() == encoded


def test_digests_are_the_same_in_another_process():
    """The router, the P/D hand-off and the disk tier (across restarts) need one root in every process."""
    code = ("import json\nfrom tokenloom.core.block_hash import HASH_ALGOS, hash_block_tokens\n"
            "print(json.dumps({a: hash_block_tokens(hash_block_tokens(None, (1, 2), (5,), a), (3,), None, a).hex() "
            "for a in HASH_ALGOS}))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    here = {a: bh.hash_block_tokens(bh.hash_block_tokens(None, (1, 2), (5,), a), (3,), None, a).hex() for a in ALGOS}
    assert json.loads(out) == here


def test_pythonhashseed_seeds_the_root(monkeypatch):
    default = bh.root_parent_hash()
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    assert bh.root_parent_hash() == bh.sha256("1234") != default


def test_a_bad_name_is_refused():
    with pytest.raises(ValueError, match="Unsupported hash function: md5"):
        bh.get_hash_fn_by_name("md5")
    with pytest.raises(ConfigError, match="prefix_caching_hash_algo must be one of sha256, sha256_cbor, xxhash"):
        CacheConfig(prefix_caching_hash_algo="md5")


def test_xxhash_without_its_package_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "xxhash", None)  # `import xxhash` now raises ImportError
    with pytest.raises(ConfigError, match=r"xxhash is required .* `pip install xxhash`"):
        CacheConfig(prefix_caching_hash_algo="xxhash_cbor")
    with pytest.raises(ModuleNotFoundError, match="pip install xxhash"):
        bh.xxhash((b"", (1,), None))


def test_the_scheduler_hashes_requests_with_its_algorithm():
    cache = CacheConfig(num_blocks=16, block_size=BS, prefix_caching_hash_algo="sha256_cbor")
    scheduler = make_scheduler(SchedulerConfig(max_model_len=128), cache)
    request = Request("r", list(range(2 * BS + 1)), SamplingParams(max_tokens=4))
    scheduler.add_request(request)
    assert request.block_hashes == prompt_block_hashes(request.prompt_token_ids, BS, None, "sha256_cbor")


def test_the_disk_tier_refuses_the_old_schemes_files(tmp_path):
    """A format-1 directory (64-bit int hashes, 16-hex names) is emptied, never misread."""
    old_file = tmp_path / "00000000deadbeef.kvb"
    old_file.write_bytes(b"TLKVBLK1" + bytes(56 + 8))
    (tmp_path / "index.json").write_text(json.dumps({"format": 1, "fingerprint": {"format": 1, "block_size": 16}}))
    files = DiskFiles(tmp_path, b"d" * 32, block_nbytes=8)
    fingerprint = {"format": 2, "block_hash": "sha256", "block_size": 16}
    assert open_dir(files, fingerprint) == [] and not old_file.exists()
    # Digests of either length are filed under their hex and read back; a file under another name is not served.
    for algo in ("sha256", "xxhash"):
        h = bh.hash_block_tokens(None, (1, 2, 3), None, algo)
        files.write(h, bytes([len(h)]) * 8)
        assert (tmp_path / file_name(h)).exists() and files.read(h) == bytearray([len(h)]) * 8
    h, other = (bh.hash_block_tokens(None, (n,)) for n in (1, 2))
    files.write(h, bytes(8))
    files.path(h).rename(files.path(other))
    assert files.read(other) is None
    assert sorted(found for found, _ in open_dir(files, fingerprint)) == sorted(
        bh.hash_block_tokens(None, (1, 2, 3), None, a) for a in ("sha256", "xxhash"))
