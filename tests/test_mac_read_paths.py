"""Under `disk_mac_key`, a slot without a valid MAC is refused on every path that reads
slots: the single read, the vectored batch read (zero-copy runs and bounced slots), the
restore from the header scan and from the index journal; the kvikio path, which cannot check
a MAC in GPU memory, is refused outright under a key.  A slot is "without a valid MAC" when it
was written without the key (an older cache, or someone who cannot sign) or with another
key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from io_actors.storage.buffers import page_aligned_buffer
from io_actors.storage.index_journal import INDEX_FILE
from io_actors.storage.interfaces import SlotIO
from io_actors.storage.posix import PosixSlotStore
from io_actors.storage.slot_format import MacMismatch
from statekv.ids import SlotId
from tests.test_persistence import MAC_KEY, block, config, key, meta

OTHER_KEY = b"another-key-16by"
SIGNERS = {"unsigned": None, "other key": OTHER_KEY}


def write_slots(directory: Path, signer: bytes | None, slots: range) -> None:
    """Slots written by a store that signs with `signer`, then one slot (the last + 1)
    signed with MAC_KEY: the neighbour that must still be served."""
    store = PosixSlotStore(directory, config(), mac_key=signer)
    for s in slots:
        store.write(SlotId(s), key(s), block(s), meta(s))
    store.close()
    good = slots.stop
    store = PosixSlotStore(directory, config(), mac_key=MAC_KEY)
    store.write(SlotId(good), key(good), block(good), meta(good))
    store.close()


@pytest.fixture(params=sorted(SIGNERS))
def signer(request: pytest.FixtureRequest) -> bytes | None:
    return SIGNERS[request.param]


@pytest.fixture
def keyed(tmp_path: Path, signer: bytes | None) -> Iterator[PosixSlotStore]:
    write_slots(tmp_path, signer, range(3))
    store = PosixSlotStore(tmp_path, config(), mac_key=MAC_KEY)
    yield store
    store.close()


def test_the_single_read_refuses_it(keyed: PosixSlotStore) -> None:
    dst = page_aligned_buffer(keyed.payload_len)
    with pytest.raises(MacMismatch):
        keyed.read(SlotId(0), key(0), dst)
    keyed.read(SlotId(3), key(3), dst)
    assert torch.equal(dst, block(3))
    assert keyed.statistics().mac_failures == 1


@pytest.mark.parametrize("buffers", ["zero-copy", "bounced"])
def test_the_vectored_read_refuses_each_and_serves_the_signed_neighbour(
    keyed: PosixSlotStore, buffers: str,
) -> None:
    def buffer() -> torch.Tensor:
        if buffers == "zero-copy":  # page aligned: the run goes to the kernel as it is
            return page_aligned_buffer(keyed.payload_len)
        # One byte off a page boundary: each slot bounces through the staging buffer.
        return torch.zeros(keyed.payload_len + 1, dtype=torch.uint8)[1:]

    reads = [SlotIO(slot=SlotId(s), key=key(s), buffer=buffer()) for s in range(4)]
    outcome = keyed.read_many(reads)
    assert [type(o) for o in outcome[:3]] == [MacMismatch] * 3, outcome
    assert outcome[3] is None and torch.equal(reads[3].buffer, block(3))
    assert keyed.statistics().mac_failures == 3


@pytest.mark.parametrize("rebuild", ["header scan", "index journal"])
def test_the_restore_refuses_it(tmp_path: Path, signer: bytes | None, rebuild: str) -> None:
    """An unsigned slot is reclaimed by the rebuild.  A slot signed with another key cannot
    be told from a good one by its header alone (the MAC covers the payload, which a
    rebuild does not read): it is restored, and every read of it refuses it."""
    write_slots(tmp_path, signer, range(3))
    if rebuild == "header scan":
        (tmp_path / INDEX_FILE).unlink()
    store = PosixSlotStore(tmp_path, config(), mac_key=MAC_KEY)
    try:
        restored = [s.slot for s in store.recovery.slots]
        if signer is None:
            assert restored == [3]
            # (With the journal, the keyed open that wrote slot 3 reclaimed them already.)
            assert store.recovery.unauthenticated == (3 if rebuild == "header scan" else 0)
        else:
            assert restored == [0, 1, 2, 3]
        dst = page_aligned_buffer(store.payload_len)
        for s in range(3):
            with pytest.raises(MacMismatch):
                store.read(SlotId(s), key(s), dst)
        store.read(SlotId(3), key(3), dst)
        assert torch.equal(dst, block(3))
    finally:
        store.close()


def _kvikio_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import kvikio  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.gpu
@pytest.mark.skipif(not _kvikio_ready(), reason="needs CUDA and kvikio")
def test_the_kvikio_path_is_never_taken_under_a_key(tmp_path: Path) -> None:
    """kvikio reads straight into GPU memory, where a keyed MAC cannot be checked: under a
    key the store refuses to open (naming the key), so no slot is ever read that way; the
    cache with backend='kvikio' and disk_mac_key is refused naming disk_mac_key."""
    from io_actors.embed import BlockingCache
    from io_actors.storage.kvikio_store import KvikioSlotStore
    from statekv.errors import ConfigError
    from tests.io_helpers import small_config

    write_slots(tmp_path / "store", None, range(3))
    with pytest.raises(ConfigError) as info:
        KvikioSlotStore(tmp_path / "store", config(), mac_key=MAC_KEY)
    assert info.value.field == "mac_key"
    cache_config = small_config(tmp_path / "cache", backend="kvikio", disk_mac_key=MAC_KEY,
                                device="cuda")
    with pytest.raises(ConfigError) as info:
        BlockingCache(cache_config)
    assert info.value.field == "disk_mac_key"
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("slots*"))
