"""The compiled digest loop (target/_digest.pyx) against its reference: protocol.digest's
``Digests.feed`` of the bytes ``FileBackend.read_into`` gives (python-xxhash), for random data,
odd lengths and offsets, chunks that do not divide the loop's mapped windows and a last short
chunk; a failed read raises what the reference's read raises, a file cut shorter during the call
too; the call keeps hashing the file it began on when the namespace's descriptor number is reused
under it; and the replica's Digest command and the
primary's verify go through it (one call a command, one a unit) when the data is a plain file.

Each check broken on purpose, rebuilt and run (2026-12-07):

- the digest copied from ``XXH128_hash_t`` as it lies in memory (low half first, little-endian)
  instead of ``XXH128_canonicalFromHash``: every equality case here, the one-call command and
  the verify fail (and the loopback digests of test_digest_command.py);
- a chunk one byte longer (its end at ``chunk + 1``): every case with more than one chunk, the
  random ranges, the command and the verify fail;
- a file that ends inside the range taken as read (the stale buffer hashed): the truncated-file
  cases here and in test_digest_command.py fail;
- the output size checked with ``-(-length // chunk)`` under Cython's C division (rounds toward
  zero: room for one chunk too few passes): the refusal test failed, and found it;
- verify not taking the compiled loop for a plain file: the verify test fails (no calls).

And with the loop over a mapping (2026-12-08):

- no SIGBUS handler installed: the cut-shorter test kills the test run (Bus error, 3 runs of 3);
- the call mapping the namespace's ``fd`` itself, not a duplicate: the reused-number and the
  cut-shorter tests fail (no descriptor of the call's own is seen);
- a window mapped from its page without skipping to the range's offset in it: the odd-offset
  cases, the random ranges, the one-call command (and test_digest_command.py's odd range) fail.
"""

from __future__ import annotations

import asyncio
import errno
import os
import random
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import xxhash

from protocol.digest import DIGEST_SIZE, DigestAlgorithm, Digests, digest_length
from target import digest as digest_mod
from target.backend import FileBackend, MemoryBackend
from target.replication import verify as verify_mod
from target.replication.link import IN_SYNC

from .test_mirror import Bed, FakeReplica, run, until

pytestmark = pytest.mark.skipif(digest_mod._file_digests is None,
                                reason="the compiled data plane is not in use (BLOCKD_PURE=1 or not built)")

XXH3 = DigestAlgorithm.XXH3_128
WINDOW = 8 << 20  # target._digest.WINDOW: the cases below cross it
SIZE = 3 * WINDOW + 12_345


def _file(tmp_path: Path, size: int = SIZE) -> tuple[FileBackend, bytes]:
    data = random.Random(size).randbytes(size)
    (tmp_path / "a.img").write_bytes(data)
    return FileBackend(str(tmp_path / "a.img")), data


def _reference(data: bytes, offset: int, length: int, chunk: int) -> bytes:
    out = bytearray(-(-length // chunk) * DIGEST_SIZE)
    Digests(XXH3, length, chunk, out).feed(data[offset:offset + length])
    return bytes(out)


def test_the_module_s_window_is_the_one_these_cases_cross() -> None:
    from target import _digest
    assert _digest.WINDOW == WINDOW


@pytest.mark.parametrize("offset,length,chunk", [
    (0, 1, 1),  # one byte
    (0, SIZE, 65536),  # pieces end inside no chunk; the last chunk short (12 345 bytes)
    (4096, 2 * WINDOW, WINDOW),  # chunks exactly the pieces, from an offset
    (12_345, SIZE - 12_345 - 7, 4099),  # odd offset, length and chunk: chunks cross every piece's end
    (1, SIZE - 1, 3 * SIZE),  # one chunk longer than the range: one short digest
    (777, 0, 512),  # nothing: no digest
])
def test_compiled_digests_equal_the_reference(tmp_path: Path, offset: int, length: int, chunk: int) -> None:
    backend, data = _file(tmp_path)
    try:
        out = bytearray(-(-length // chunk) * DIGEST_SIZE)
        digest_mod._file_digests(backend.fast, offset, length, chunk, out)
        assert bytes(out) == _reference(data, offset, length, chunk)
        # and each is python-xxhash's digest of its chunk (the canonical byte order)
        assert bytes(out) == b"".join(xxhash.xxh3_128(data[at:min(at + chunk, offset + length)]).digest()
                                      for at in range(offset, offset + length, chunk))
    finally:
        backend.close()


def test_random_ranges_against_the_reference(tmp_path: Path) -> None:
    backend, data = _file(tmp_path)
    rng = random.Random(41)
    try:
        for _ in range(40):
            chunk = rng.choice([1, 511, 4096, 65536, WINDOW - 1, WINDOW + 1, rng.randrange(1, SIZE)])
            if chunk < 4096:  # the reference hashes each chunk in Python: a short range across a window's end
                offset = rng.randrange(1, 3) * WINDOW - rng.randrange(1, 1 << 16)
                length = rng.randrange(1 << 17)
            else:
                offset = rng.randrange(SIZE)
                length = rng.randrange(SIZE - offset + 1)
            out = bytearray(-(-length // chunk) * DIGEST_SIZE)
            digest_mod._file_digests(backend.fast, offset, length, chunk, out)
            assert bytes(out) == _reference(data, offset, length, chunk), (offset, length, chunk)
    finally:
        backend.close()


def test_a_range_past_the_end_of_a_truncated_file_fails_as_read_into(tmp_path: Path) -> None:
    """The file shrank under the backend: EIO, as ``FileBackend.read_into``'s short read."""
    backend, _ = _file(tmp_path)
    try:
        os.truncate(tmp_path / "a.img", WINDOW + 100)
        with pytest.raises(OSError) as reference:
            asyncio.run(backend.read_into(0, memoryview(bytearray(2 * WINDOW))))
        with pytest.raises(OSError) as compiled:
            digest_mod._file_digests(backend.fast, 0, 2 * WINDOW, 65536, bytearray(2 * WINDOW // 65536 * 16))
        assert compiled.value.errno == reference.value.errno == errno.EIO
        assert str(WINDOW + 100) in str(compiled.value)  # where the file ended
    finally:
        backend.close()


def test_a_closed_descriptor_fails_as_read_into(tmp_path: Path) -> None:
    """A descriptor that is no longer open (-1, as ``FileBackend.close`` leaves both copies;
    a closed number could be reused by the time the read runs): EBADF from both."""
    backend, _ = _file(tmp_path)
    fd = backend.fd
    backend.fd = backend.fast.fd = -1
    try:
        with pytest.raises(OSError) as compiled:
            digest_mod._file_digests(backend.fast, 0, 4096, 4096, bytearray(16))
        with pytest.raises(OSError) as reference:
            asyncio.run(backend.read_into(0, memoryview(bytearray(4096))))
        assert compiled.value.errno == reference.value.errno == errno.EBADF
    finally:
        os.close(fd)


BIG = 64 * WINDOW
"""A sparse file the call takes tens of milliseconds over (its holes read as zeros), long enough
to act on it from the test while the call runs."""


def _during_the_call(tmp_path: Path, act: Callable[[FileBackend, str], None]) -> tuple[bytearray, OSError | None]:
    """Hash all of a sparse :data:`BIG`-byte file in 8 MiB chunks in a thread, and call ``act``
    (the backend, the file's path) once the call holds its own descriptor of the file (a new one
    on that path in ``/proc/self/fd``): the digests and what the call raised. Fails when no call
    was seen holding one (three tries: a call could end between two looks)."""
    for _ in range(3):
        path = tmp_path / "big.img"
        with open(path, "wb") as f:
            f.truncate(BIG)
        backend = FileBackend(str(path))
        out = bytearray(BIG // WINDOW * DIGEST_SIZE)
        raised: list[OSError] = []

        def call() -> None:
            try:
                digest_mod._file_digests(backend.fast, 0, BIG, WINDOW, out)
            except OSError as exc:
                raised.append(exc)
        thread = threading.Thread(target=call)
        thread.start()
        seen = False
        try:
            while thread.is_alive() and not seen:
                for name in os.listdir("/proc/self/fd"):
                    if int(name) == backend.fd:
                        continue
                    try:
                        seen = seen or os.readlink(f"/proc/self/fd/{name}") == str(path)
                    except OSError:  # closed meanwhile (the listing's own descriptor, say)
                        pass
            if seen:
                act(backend, str(path))
        finally:
            thread.join()
            backend.close()
        if seen:
            return out, raised[0] if raised else None
    pytest.fail("the call never held a descriptor of its own: it reads the namespace's number")


def test_a_closed_namespace_s_number_reused_during_the_call_is_not_read(tmp_path: Path) -> None:
    """The namespace closed and its descriptor's number reused for another file while the call
    runs (here at once, by ``dup2`` onto it): the call still hashes the file it started on.
    Broken (the call mapping ``file.fd`` itself, no duplicate): no descriptor of its own is
    ever seen, and the windows after the swap hash the other file."""
    other = tmp_path / "other.img"
    other.write_bytes(b"\xff" * WINDOW)
    fd = os.open(other, os.O_RDONLY)
    try:
        out, raised = _during_the_call(tmp_path, lambda backend, _: os.dup2(fd, backend.fd))
    finally:
        os.close(fd)
    assert raised is None
    assert bytes(out) == xxhash.xxh3_128(bytes(WINDOW)).digest() * (BIG // WINDOW)


def test_a_file_cut_shorter_during_the_call_fails_as_a_short_read(tmp_path: Path) -> None:
    """The file truncated while it is hashed: its mapping's pages past the new end raise SIGBUS,
    which the call turns into EIO naming where the file now ends (as ``read_into``'s short read),
    and this process goes on. Broken (no SIGBUS handler): the test run dies of SIGBUS."""
    def cut(_: FileBackend, path: str) -> None:
        time.sleep(0.005)  # past the call's look at the file's size: into the hash of its windows
        os.truncate(path, 0)
    for _ in range(3):  # the cut timed wrong on a loaded machine (before the look, after the end): again
        _, raised = _during_the_call(tmp_path, cut)
        ends = re.search(r"short read: the file ends at (\d+)", str(raised))
        if raised is not None and ends and int(ends[1]) > 0:  # the page being hashed
            assert raised.errno == errno.EIO
            return
    pytest.fail(f"the cut never fell inside the hash: {raised!r}")


def test_a_too_small_output_or_an_empty_chunk_is_refused(tmp_path: Path) -> None:
    backend, _ = _file(tmp_path)
    try:
        with pytest.raises(ValueError):
            digest_mod._file_digests(backend.fast, 0, 4097, 4096, bytearray(16))  # two chunks, room for one
        with pytest.raises(ValueError):
            digest_mod._file_digests(backend.fast, 0, 4096, 0, bytearray(16))
    finally:
        backend.close()


def test_only_a_plain_file_goes_compiled() -> None:
    """A memory backend (as any replicated or filtered one: no ``fast``) keeps the Python loop."""
    assert digest_mod.compiled_file(MemoryBackend(4096), XXH3) is None


class Counting:
    """Wraps the compiled call: the ranges it hashed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[int, int, int]] = []
        real = digest_mod._file_digests

        def counted(file: Any, offset: int, length: int, chunk: int, out: Any) -> None:
            self.calls.append((offset, length, chunk))
            real(file, offset, length, chunk, out)
        monkeypatch.setattr(digest_mod, "_file_digests", counted)


def test_the_command_hashes_its_whole_range_in_one_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """target.digest.execute on a plain file: one compiled call for the command, the digests
    the reference gives (the loopback tests in test_digest_command.py check them on the wire)."""
    from types import SimpleNamespace

    from protocol.commands import digest_command

    backend, data = _file(tmp_path)
    counting = Counting(monkeypatch)
    blocks, chunk = (SIZE - 512) // 512, 128
    sqe = bytes(digest_command(1, 1, blocks - 1, chunk, XXH3))
    req = SimpleNamespace(ns=SimpleNamespace(backend=backend, lba_shift=9, nsid=1), sqe=sqe, buffer=None,
                          length=digest_length(blocks, chunk), status=0, reply=None)
    try:
        asyncio.run(digest_mod.execute(req))  # type: ignore[arg-type]
    finally:
        backend.close()
    assert counting.calls == [(512, blocks * 512, chunk * 512)]
    assert bytes(req.reply) == _reference(data, 512, blocks * 512, chunk * 512)


class DigestReplica(FakeReplica):
    """A replica that answers digests (as ``initiator.replica.RemoteNamespace`` does for a blockd
    replica), computed by the reference from its store."""

    serves_digests = True

    async def digests(self, offset: int, length: int, chunk: int, out: memoryview) -> None:
        self._check()
        data = bytearray(length)
        await self.store.read_into(offset, memoryview(data))
        Digests(XXH3, length, chunk, out).feed(data)


def test_verify_hashes_a_plain_file_copy_in_one_call_a_unit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The primary's verify over a plain file: each unit of this copy hashed by one compiled
    call, and a byte that differs in the replica found in its region."""
    device = 3 * verify_mod.UNIT + (1 << 20)
    (tmp_path / "local.img").write_bytes(os.urandom(device - (1 << 20)) + bytes(1 << 20))  # blank metadata
    local = FileBackend(str(tmp_path / "local.img"), device)
    store = MemoryBackend(device)
    bed = Bed(1, local=local, stores=[store])
    bed.opener = lambda i: (lambda: _open(store))  # type: ignore[method-assign]

    async def _open(store: MemoryBackend) -> DigestReplica:
        return DigestReplica(store, "r0")

    async def main() -> None:
        m = await bed.primary(rate=1 << 40)
        await until(lambda: m.links[0].state == IN_SYNC, timeout=30)
        flip = verify_mod.UNIT + 12_345
        store.data[flip] ^= 1
        counting = Counting(monkeypatch)
        result = await verify_mod.verify(m, m.links[0])
        assert result["method"] == "digest"
        assert [x["region"] for x in result["mismatched"]] == [flip // m.region_size]
        assert sum(n for _, n, _ in counting.calls) == m.data_size  # every byte of this copy, by the loop
        assert max(n for _, n, _ in counting.calls) == verify_mod.UNIT  # a call a unit
        await m.stop()
    try:
        run(main())
    finally:
        local.close()
