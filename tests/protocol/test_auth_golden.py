"""Golden bytes for the in-band authentication structures, placed by hand at the offsets of NVMe
Base 2.0 section 8.13 / the kernel's ``struct nvmf_auth_*`` (include/linux/nvme.h); then each builder must produce them and each parser read them back."""

from __future__ import annotations

import pytest

from protocol import auth
from protocol.auth import AuthMessageError, FailureExplanation
from protocol.commands import auth_receive_command, auth_send_command
from tests.protocol.test_golden import put, put_bytes


def test_auth_send_and_receive_commands():
    for build, fctype, length in ((auth_send_command, 0x05, 0x48), (auth_receive_command, 0x06, 4096)):
        b = bytearray(64)
        b[0] = 0x7F                      # OPC: fabrics
        b[1] = 0x40                      # FLAGS: PSDT = 01b (SGL)
        b[4] = fctype                    # FCTYPE: 05h Send, 06h Receive
        b[41] = 0x01                     # SPSP0
        b[42] = 0x01                     # SPSP1
        b[43] = 0xE9                     # SECP: NVMe in-band authentication
        put(b, 44, length, 4)            # TL / AL
        assert build(length) == b


def test_negotiate():
    b = bytearray(72)
    b[0] = 0x00                          # AUTH_TYPE: common message
    b[1] = 0x00                          # AUTH_ID: AUTH_Negotiate
    put(b, 4, 0x1234, 2)                 # T_ID
    b[6] = 0x00                          # SC_C: no secure channel
    b[7] = 0x01                          # NAPD: one descriptor
    b[8] = 0x01                          # AUTHID: DH-HMAC-CHAP
    b[10] = 3                            # HALEN
    b[11] = 2                            # DHLEN
    put_bytes(b, 12, bytes([1, 2, 3]))   # hash IDs at descriptor byte 4
    put_bytes(b, 12 + 30, bytes([0, 1]))  # DH group IDs at descriptor byte 34
    golden = bytes(b)
    assert auth.build_negotiate(0x1234, [1, 2, 3], [0, 1]) == golden
    n = auth.parse_negotiate(golden)
    assert (n.t_id, n.sc_c, n.hash_ids, n.dh_groups) == (0x1234, 0, (1, 2, 3), (0, 1))


def test_challenge():
    c1 = bytes(range(0x20, 0x40))
    dhv = bytes(range(0x80, 0x90))
    b = bytearray(16)
    b[0] = 0x01                          # AUTH_TYPE: DH-HMAC-CHAP
    b[1] = 0x01                          # AUTH_ID: Challenge
    put(b, 4, 0x0007, 2)                 # T_ID
    b[6] = 32                            # HL
    b[8] = 0x01                          # HASHID: SHA-256
    b[9] = 0x01                          # DHGID: ffdhe2048
    put(b, 10, len(dhv), 2)              # DHVLEN
    put(b, 12, 0xA1B2C3D4, 4)            # SEQNUM
    golden = bytes(b) + c1 + dhv
    assert auth.build_challenge(7, 1, 1, 0xA1B2C3D4, c1, dhv) == golden
    ch = auth.parse_challenge(golden)
    assert (ch.t_id, ch.hash_id, ch.dh_group, ch.seqnum, ch.c1, ch.dh_value) == \
        (7, 1, 1, 0xA1B2C3D4, c1, dhv)


def test_reply_bidirectional_and_not():
    r1 = bytes(range(0x40, 0x60))
    c2 = bytes(range(0x60, 0x80))
    dhv = b"\x05" * 8
    b = bytearray(16)
    b[0] = 0x01
    b[1] = 0x02                          # AUTH_ID: Reply
    put(b, 4, 0x0102, 2)
    b[6] = 32                            # HL
    b[8] = 0x01                          # CVALID
    put(b, 10, 8, 2)                     # DHVLEN
    put(b, 12, 0x55667788, 4)            # SEQNUM (S2)
    golden = bytes(b) + r1 + c2 + dhv
    assert auth.build_reply(0x0102, r1, c2, 0x55667788, dhv) == golden
    rp = auth.parse_reply(golden)
    assert (rp.t_id, rp.seqnum, rp.response, rp.c2, rp.dh_value) == (0x0102, 0x55667788, r1, c2, dhv)

    b[8] = 0x00                          # CVALID clear: C2 field zero, S2 zero, no DH value
    put(b, 10, 0, 2)
    put(b, 12, 0, 4)
    golden = bytes(b) + r1 + bytes(32)
    assert auth.build_reply(0x0102, r1, None, 0, b"") == golden
    assert auth.parse_reply(golden).c2 is None


def test_success1_success2_failures():
    r2 = bytes(range(0, 48))
    b = bytearray(16)
    b[0] = 0x01
    b[1] = 0x03                          # AUTH_ID: Success1
    put(b, 4, 9, 2)
    b[6] = 48                            # HL
    b[8] = 0x01                          # RVALID
    golden = bytes(b) + r2
    assert auth.build_success1(9, 48, r2) == golden
    assert auth.parse_success1(golden).response == r2
    b[8] = 0x00
    assert auth.build_success1(9, 48, None) == bytes(b) + bytes(48)
    assert auth.parse_success1(bytes(b) + bytes(48)).response is None

    b = bytearray(16)
    b[0] = 0x01
    b[1] = 0x04                          # AUTH_ID: Success2
    put(b, 4, 9, 2)
    assert auth.build_success2(9) == bytes(b)

    f1 = bytes([0x00, 0xF1, 0, 0, 9, 0, 0x01, 0x06])  # common message; reason 1, expl. 6
    assert auth.build_failure(auth.AuthMessage.FAILURE1, 9, FailureExplanation.INCORRECT_PAYLOAD) == f1
    f2 = bytes([0x01, 0xF0, 0, 0, 9, 0, 0x01, 0x01])  # DH-HMAC-CHAP message; expl. failed
    assert auth.build_failure(auth.AuthMessage.FAILURE2, 9, FailureExplanation.FAILED) == f2
    assert auth.parse_failure(f1) == 6


@pytest.mark.parametrize("parse, data, explanation", [
    (auth.parse_negotiate, bytes(71), FailureExplanation.INCORRECT_PAYLOAD),
    (auth.parse_negotiate, bytes(7) + b"\x02" + bytes(64), FailureExplanation.HASH_UNUSABLE),
    (auth.parse_negotiate, bytes(7) + b"\x01\x02" + bytes(63), FailureExplanation.INCORRECT_PAYLOAD),
    (auth.parse_negotiate, bytes(7) + b"\x01\x01\x00\x1f" + bytes(61),
     FailureExplanation.INCORRECT_PAYLOAD),
    # a Reply whose HL and DHVLEN claim more than was sent
    (auth.parse_reply, bytes([1, 2, 0, 0, 0, 0, 32, 0, 0, 0, 0, 1, 0, 0, 0, 0]) + bytes(64),
     FailureExplanation.INCORRECT_PAYLOAD),
    (auth.parse_challenge, bytes([1, 1, 0, 0, 0, 0, 64, 0, 3, 0, 0, 0, 0, 0, 0, 0]) + bytes(32),
     FailureExplanation.INCORRECT_PAYLOAD),
])
def test_parsers_refuse_short_or_wrong_messages(parse, data, explanation):
    with pytest.raises(AuthMessageError) as err:
        parse(data)
    assert err.value.explanation == explanation
