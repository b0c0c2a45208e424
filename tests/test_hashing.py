"""Block keys: stable across processes, chained, and separated by salt, LoRA and model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from statekv import KVCacheManager, UsageError
from statekv.hashing import DIGEST_SIZE, MAX_TOKEN_ID, chain_key, root_key, token_bytes
from statekv.ids import BlockHash
from tests.harness import Executor, block_keys, config, fresh_tokens

REPO = Path(__file__).resolve().parent.parent

# Keys persisted on disk must be found again after a restart and after an upgrade: a change
# of the key derivation has to be deliberate (a new personalization/version string), and
# then these pinned values change with it.
GOLDEN_ROOT = "7fb25dafdfdf61b421e443eeb4e577152f562f7e6980ccdfdf34316da9eb6d2d"
GOLDEN_BLOCK = "709127cfca161a3544791185cc23ad2942909330bffe75800c5f5358323d071c"
GOLDEN_TENANT_ROOT = "d05b7508aa72ec225e6fbfde78a67757dc62a8a8d4d87ee1196e644adca47d75"

KEYS_SCRIPT = """
import json
from statekv.hashing import chain_key, root_key, token_bytes
root = root_key("model-x", "tenant-a", 3)
keys = [root.hex()]
key = root
for block in ([1, 2, 3, 4], [5, 6, 7, 8], [0, 4294967295, 7, 7]):
    key = chain_key(key, token_bytes(block))
    keys.append(key.hex())
print(json.dumps(keys))
"""


def _keys_here() -> list[str]:
    root = root_key("model-x", "tenant-a", 3)
    keys = [root.hex()]
    key = root
    for block in ([1, 2, 3, 4], [5, 6, 7, 8], [0, MAX_TOKEN_ID, 7, 7]):
        key = chain_key(key, token_bytes(block))
        keys.append(key.hex())
    return keys


@pytest.mark.parametrize("hash_seed", ["0", "1", "12345"])
def test_keys_are_the_same_in_another_process_with_another_hash_seed(hash_seed: str) -> None:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    out = subprocess.run(
        [sys.executable, "-c", KEYS_SCRIPT], capture_output=True, text=True, check=True,
        cwd=REPO, env=env,
    ).stdout
    assert json.loads(out) == _keys_here()


def test_keys_match_their_pinned_values() -> None:
    root = root_key("", None, None)
    assert root.hex() == GOLDEN_ROOT
    assert chain_key(root, token_bytes([1, 2])).hex() == GOLDEN_BLOCK
    assert root_key("llama", "tenant", 7).hex() == GOLDEN_TENANT_ROOT


def test_keys_are_32_byte_digests() -> None:
    root = root_key("m", None, None)
    assert len(root) == DIGEST_SIZE == 32
    assert len(chain_key(root, token_bytes([1]))) == DIGEST_SIZE


def test_token_ids_are_encoded_as_little_endian_uint32() -> None:
    assert token_bytes([1, 256, MAX_TOKEN_ID]) == (
        b"\x01\x00\x00\x00" + b"\x00\x01\x00\x00" + b"\xff\xff\xff\xff"
    )
    assert token_bytes([]) == b""
    assert token_bytes(range(3)) == token_bytes([0, 1, 2])


def test_a_block_key_depends_on_every_block_before_it() -> None:
    bs = 2
    a = block_keys([1, 2, 3, 4, 5, 6], bs)
    b = block_keys([9, 2, 3, 4, 5, 6], bs)
    assert len(a) == len(b) == 3
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_the_same_block_under_different_parents_has_different_keys() -> None:
    root = root_key("", None, None)
    block = token_bytes([5, 6])
    parent_a = chain_key(root, token_bytes([1, 2]))
    parent_b = chain_key(root, token_bytes([3, 4]))
    assert chain_key(parent_a, block) != chain_key(parent_b, block)
    assert chain_key(root, block) != chain_key(parent_a, block)


def test_token_order_within_a_block_matters() -> None:
    root = root_key("", None, None)
    assert chain_key(root, token_bytes([1, 2])) != chain_key(root, token_bytes([2, 1]))


def test_salts_separate_key_spaces() -> None:
    assert root_key("m", "tenant-a", None) != root_key("m", "tenant-b", None)
    assert root_key("m", "tenant-a", None) != root_key("m", None, None)


def test_no_salt_and_empty_salt_are_different_tenants() -> None:
    assert root_key("m", None, None) != root_key("m", "", None)


def test_lora_ids_separate_key_spaces_and_none_differs_from_zero() -> None:
    assert root_key("m", None, 1) != root_key("m", None, 2)
    assert root_key("m", None, None) != root_key("m", None, 0)


def test_model_fingerprints_separate_key_spaces() -> None:
    assert root_key("weights-v1", None, None) != root_key("weights-v2", None, None)
    assert root_key("", None, None) != root_key("weights-v1", None, None)


def test_fields_of_the_root_cannot_be_shifted_into_each_other() -> None:
    assert root_key("ab", "c", None) != root_key("a", "bc", None)
    assert root_key("", "x", None) != root_key("x", None, None)
    assert root_key("m", "", 0) != root_key("m", None, 0)


@pytest.mark.parametrize(
    "tokens", [[-1], [MAX_TOKEN_ID + 1], [1.5], ["7"], [None], [1, 2, 2**64]],
)
def test_bad_token_ids_raise_usage_error_naming_token_ids(tokens: list[object]) -> None:
    with pytest.raises(UsageError) as info:
        token_bytes(tokens)  # type: ignore[arg-type]
    assert info.value.field == "token_ids"


def test_boundary_token_ids_are_accepted() -> None:
    assert len(token_bytes([0, MAX_TOKEN_ID])) == 8


# ---------------------------------------------------------------------- through the manager


def test_manager_keys_are_the_chained_keys_of_full_blocks() -> None:
    ex = Executor(KVCacheManager(config(model_fingerprint="fp")))
    tokens = fresh_tokens(7)
    ex.serve("a", tokens, salt="s", lora=4)
    expected = block_keys(tokens, ex.bs, fingerprint="fp", salt="s", lora=4)
    assert len(expected) == 3
    assert set(ex.cached()) == set(expected)


def test_managers_with_different_model_fingerprints_never_share_keys() -> None:
    tokens = fresh_tokens(5)
    one = Executor(KVCacheManager(config(model_fingerprint="weights-v1")))
    two = Executor(KVCacheManager(config(model_fingerprint="weights-v2")))
    one.serve("a", tokens)
    two.serve("a", tokens)
    assert len(one.cached()) == len(two.cached()) == 2
    assert set(one.cached()).isdisjoint(two.cached())


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"salt": "tenant-a"}, {"salt": "tenant-b"}),
        ({"salt": None}, {"salt": ""}),
        ({"salt": "tenant-a"}, {"salt": None}),
        ({"lora": 1}, {"lora": 2}),
        ({"lora": None}, {"lora": 0}),
    ],
)
def test_requests_in_different_key_spaces_never_share_a_block(
    first: dict[str, object], second: dict[str, object],
) -> None:
    ex = Executor(KVCacheManager(config()))
    tokens = fresh_tokens(5)
    ex.serve("a", tokens, **first)  # type: ignore[arg-type]
    match = ex.add("b", tokens, **second)  # type: ignore[arg-type]
    assert match.matched_tokens == 0
    again = ex.add("c", tokens, **first)  # type: ignore[arg-type]
    assert again.matched_tokens == 4


@pytest.mark.parametrize("tokens", [[1, -1, 3], [1, 2**32], [1.0, 2.0], ["a"], [None]])
def test_add_request_with_bad_token_ids_raises_usage_error_and_registers_nothing(
    tokens: list[object],
) -> None:
    cache = KVCacheManager(config())
    before = cache.statistics()
    with pytest.raises(UsageError) as info:
        cache.add_request("a", tokens, now=0.0)  # type: ignore[arg-type]
    assert info.value.field == "token_ids"
    assert not cache.has_request("a")
    assert cache.statistics() == before


def test_append_tokens_with_bad_token_ids_raises_usage_error_and_appends_nothing() -> None:
    cache = KVCacheManager(config())
    cache.add_request("a", [1, 2, 3], now=0.0)
    with pytest.raises(UsageError) as info:
        cache.append_tokens("a", [4, -5])
    assert info.value.field == "token_ids"
    assert cache.request_status("a").num_tokens == 3


def test_key_helper_agrees_with_hashing_module() -> None:
    """The harness computes keys the way the module does (guards the tests' own helper)."""
    keys = block_keys([1, 2, 3, 4, 5], 2, fingerprint="f", salt="s", lora=1)
    root = root_key("f", "s", 1)
    first = chain_key(root, token_bytes([1, 2]))
    assert keys == [first, chain_key(first, token_bytes([3, 4]))]
    assert all(isinstance(k, bytes) for k in keys)
    assert BlockHash(keys[0]) == first
