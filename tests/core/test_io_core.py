"""The compiled core's one rule (``target/_io_core.pyx`` ``eligible``, which both compiled transports
ask before they serve a command themselves) against the Python core it stands in for
(``TargetQueue.submit`` and ``Controller._check_rw``): every Read or Write the rule accepts, the
Python queue completes with success on the same controller, queue and namespace. The rule may
leave a command the queue would complete to the queue (that costs speed, not behaviour); it may
never take one the queue would refuse, as the compiled paths answer success without asking it.

The commands are random around the edges the rule decides on: PSDT, opcode, FUA, namespace
(missing, read-only, NSID 0 and all), range (the last blocks and past them), the length against
the blocks and against MDTS, and the queue's readiness."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

import target.tcp
from protocol.constants import IoOpcode, SglId
from protocol.nvme import RW_CONTROL_FUA, build_sgl_data_block, build_sqe
from target.io_fast import FastNamespace

from .conftest import RawConn, config, fill_file, free_port, ns, raw_admin, run, serving, sub

if FastNamespace is None:  # namespaces carry no C copy then: the rule has nothing to serve
    pytest.skip("the compiled data plane is not in use (BLOCKD_PURE=1 or not built)", allow_module_level=True)
_io_core = pytest.importorskip("target._io_core")

RW_SIZE, RW_BLOCK = 256 << 10, 512
RO_SIZE, RO_BLOCK = 64 << 10, 4096
SIZES = {1: (RW_SIZE, RW_BLOCK), 2: (RO_SIZE, RO_BLOCK)}
MAX_TRANSFER = 8192
"""The MDTS given to the rule here (smaller than the target's, so that the rule's own MDTS check
is exercised by lengths the Python queue still accepts)."""


def _command(rng: random.Random, cid: int) -> tuple[bytes, bytes, int, bool]:
    """(SQE, in-capsule data, the SGL's length, fua_ok) of one random command."""
    nsid = rng.choice([1] * 6 + [2] * 3 + [3, 0, 0xFFFFFFFF])
    size, block = SIZES.get(nsid, (RW_SIZE, RW_BLOCK))
    blocks = size // block
    nlb = rng.randrange(1, max(2, (3 * MAX_TRANSFER // 2) // block + 1))
    slba = rng.choice([rng.randrange(0, max(1, blocks - nlb + 1))] * 5 + [blocks - nlb + 1, blocks, (1 << 64) - 1])
    length = nlb * block
    if rng.random() < 0.1:
        length += rng.choice([-block, block, 1, -1])
    length = max(0, min(length, 16384))
    flags = 0x40 if rng.random() > 0.08 else rng.choice([0x00, 0x41, 0x80])
    control = RW_CONTROL_FUA if rng.random() < 0.15 else 0
    roll = rng.random()
    data = b""
    if roll < 0.45:
        opcode, sgl_id = IoOpcode.READ, SglId.TRANSPORT_DATA_BLOCK
    elif roll < 0.9:
        opcode, sgl_id = IoOpcode.WRITE, SglId.DATA_BLOCK_OFFSET
        data = rng.randbytes(length)
    else:
        opcode, sgl_id = rng.choice([IoOpcode.WRITE_ZEROES, IoOpcode.FLUSH, 0x7E]), SglId.TRANSPORT_DATA_BLOCK
    sqe = build_sqe(int(opcode), cid, flags=flags, nsid=nsid, dptr=build_sgl_data_block(sgl_id, 0, length),
                    cdw10=slba & 0xFFFFFFFF, cdw11=slba >> 32, cdw12=(nlb - 1) | control << 16)
    return sqe, data, length, rng.random() < 0.5


@pytest.mark.parametrize("seed", [1, 2])
def test_every_command_the_rule_takes_the_python_queue_completes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 seed: int) -> None:
    monkeypatch.setattr(target.tcp, "TcpFastPath", None)  # the Python queue answers every command
    rng = random.Random(seed)

    async def main() -> tuple[int, int]:
        rw, ro = tmp_path / "rw.img", tmp_path / "ro.img"
        fill_file(rw, RW_SIZE)
        fill_file(ro, RO_SIZE)
        port = free_port()
        namespaces = [ns(rw, 1, size=RW_SIZE, block_size=RW_BLOCK),
                      ns(ro, 2, size=RO_SIZE, block_size=RO_BLOCK, read_only=True)]
        async with serving(config([port], [sub(namespaces=namespaces)])) as service:
            admin, cntlid = await raw_admin(port)
            io = await RawConn.open(port)
            await io.initialize()
            try:
                await io.connect_io(cntlid)
                queue = service.target.controllers[cntlid].queues[1]
                ctrl = queue.controller
                taken = refused = 0
                for i in range(400):
                    sqe, data, length, fua_ok = _command(rng, i & 0xFFFF)
                    serves = _io_core.serves(sqe, length, fua_ok, ctrl, queue, MAX_TRANSFER)
                    status, *_ = await io.command(sqe, data)
                    if serves:
                        taken += 1
                        assert status == 0, (i, sqe.hex(), length, fua_ok)
                    else:
                        refused += 1
                # a ready queue; the rule reads its state: locked by authentication, it refuses
                good = build_sqe(int(IoOpcode.READ), 1, flags=0x40, nsid=1,
                                 dptr=build_sgl_data_block(SglId.TRANSPORT_DATA_BLOCK, 0, 512))
                assert _io_core.serves(good, 512, False, ctrl, queue, MAX_TRANSFER)
                monkeypatch.setattr(queue, "locked", True)
                assert not _io_core.serves(good, 512, False, ctrl, queue, MAX_TRANSFER)
                return taken, refused
            finally:
                await io.close()
                await admin.close()

    taken, refused = run(main(), timeout=60)
    assert taken >= 50 and refused >= 50, (taken, refused)  # both sides of the rule were exercised
