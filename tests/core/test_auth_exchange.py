"""DH-HMAC-CHAP between the host's and the controller's state machines (initiator/auth.py,
target/auth.py), message by message without a transport: every hash with the NULL and FFDHE
groups, one way and both ways; wrong secrets refused; hostile messages answered with the
spec's failure explanation while another queue's transaction goes on."""

from __future__ import annotations

import struct

import pytest

from blockd.dhchap_secret import generate_secret
from initiator.auth import AuthFailed, HostAuth
from protocol.auth import AuthMessage, FailureExplanation, build_negotiate, parse_failure, parse_head
from target.config import HostAuthConfig
from target.auth import QueueAuth

HOST = "nqn.2014-08.org.nvmexpress:uuid:0c0c0c0c-1111-2222-3333-444455556666"
SUB = "nqn.2024-01.io.blockd:vol-1"
HOST_SECRET = generate_secret(HOST, 1)
CTRL_SECRET = generate_secret(SUB, 0, 48)
OTHER = generate_secret(HOST, 1)


def pair(hashes=(1,), groups=(0,), ctrl=None, host_ctrl=None, host_secret=HOST_SECRET):
    config = HostAuthConfig(HOST_SECRET, ctrl, tuple(hashes), tuple(groups))
    return HostAuth(host_secret, host_ctrl, HOST, SUB, t_id=3), QueueAuth(config, HOST, SUB)


def run(host: HostAuth, target: QueueAuth) -> None:
    target.send(host.negotiate())
    reply = host.challenge(target.receive())
    target.send(reply)
    success2 = host.success1(target.receive())
    if success2 is not None:
        target.send(success2)


def failure1_explanation(target: QueueAuth) -> int:
    msg = target.receive()
    assert parse_head(msg).auth_id == AuthMessage.FAILURE1
    assert target.failed and not target.authenticated
    return parse_failure(msg)


@pytest.mark.parametrize("hash_id", [1, 2, 3])
@pytest.mark.parametrize("group", [0, 1, 2])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_matrix(hash_id, group, bidirectional):
    ctrl = CTRL_SECRET if bidirectional else None
    host, target = pair((hash_id,), (group,), ctrl, ctrl)
    run(host, target)
    assert target.authenticated and not target.failed


def test_wrong_host_secret_gets_failure1_failed():
    host, target = pair(host_secret=OTHER)
    target.send(host.negotiate())
    target.send(host.challenge(target.receive()))
    failure1 = target.receive()
    assert parse_failure(failure1) == FailureExplanation.FAILED
    assert target.failed and not target.authenticated
    with pytest.raises(AuthFailed, match="FAILED"):
        host.success1(failure1)


def test_wrong_controller_secret_refused_by_host_with_failure2():
    host, target = pair(ctrl=CTRL_SECRET, host_ctrl=generate_secret(SUB, 0, 48))
    target.send(host.negotiate())
    target.send(host.challenge(target.receive()))
    assert not target.authenticated          # waits for Success2 before trusting the queue
    with pytest.raises(AuthFailed) as err:
        host.success1(target.receive())
    assert err.value.failure2 is not None
    assert parse_failure(err.value.failure2) == FailureExplanation.FAILED
    target.send(err.value.failure2)
    assert target.failed and not target.authenticated


def test_host_asking_both_ways_without_a_controller_secret_is_refused():
    host, target = pair(host_ctrl=CTRL_SECRET)
    target.send(host.negotiate())
    target.send(host.challenge(target.receive()))
    assert failure1_explanation(target) == FailureExplanation.FAILED


def test_no_common_hash_or_group():
    host, target = pair(hashes=(1,))
    target.send(build_negotiate(3, [2, 3], [0]))
    assert failure1_explanation(target) == FailureExplanation.HASH_UNUSABLE
    host, target = pair(groups=(1,))
    target.send(build_negotiate(3, [1], [0]))
    assert failure1_explanation(target) == FailureExplanation.DHGROUP_UNUSABLE


def reply_after(mutate, groups=(0,)):
    """Run to the Reply, let ``mutate`` change it, and return the Failure1's explanation."""
    host, target = pair(groups=groups)
    target.send(host.negotiate())
    reply = bytearray(host.challenge(target.receive()))
    target.send(bytes(mutate(reply)))
    return failure1_explanation(target)


def test_hostile_replies_get_the_spec_reason_and_other_queues_go_on():
    host_b, target_b = pair()                      # a second queue, mid-transaction
    target_b.send(host_b.negotiate())
    challenge_b = target_b.receive()

    def wrong_tid(r):
        struct.pack_into("<H", r, 4, 99)
        return r
    assert reply_after(wrong_tid) == FailureExplanation.INCORRECT_PAYLOAD
    assert reply_after(lambda r: r[:40]) == FailureExplanation.INCORRECT_PAYLOAD   # cut short

    def long_dh(r):                                 # DHVLEN claims an 8 KiB value
        struct.pack_into("<H", r, 10, 8192)
        return r + bytes(8192 - (len(r) - 16 - 64))
    assert reply_after(long_dh, groups=(1,)) == FailureExplanation.DHGROUP_UNUSABLE

    def dh_in_null_group(r):
        struct.pack_into("<H", r, 10, 4)
        return r + b"\1\2\3\4"
    assert reply_after(dh_in_null_group) == FailureExplanation.INCORRECT_PAYLOAD

    def flip_response(r):
        r[16] ^= 1
        return r
    assert reply_after(flip_response) == FailureExplanation.FAILED

    target_b.send(host_b.challenge(challenge_b))    # the other queue is untouched
    assert host_b.success1(target_b.receive()) is None
    assert target_b.authenticated


def test_out_of_order_and_replayed_steps():
    host, target = pair()
    target.send(host.negotiate())
    target.send(bytes([1, AuthMessage.REPLY, 0, 0, 3, 0]) + bytes(74))  # Reply before Challenge
    assert failure1_explanation(target) == FailureExplanation.INCORRECT_MESSAGE

    host, target = pair()
    run(host, target)
    assert target.authenticated
    target.send(bytes([1, AuthMessage.SUCCESS2, 0, 0, 3, 0]) + bytes(10))  # replayed Success2
    assert failure1_explanation(target) == FailureExplanation.INCORRECT_MESSAGE


def test_negotiate_restarts_a_transaction():
    host, target = pair()
    run(host, target)
    again = HostAuth(HOST_SECRET, None, HOST, SUB, t_id=4)
    run(again, target)
    assert target.authenticated and not target.failed


def test_host_refuses_a_hostile_challenge_with_failure2():
    host, target = pair(groups=(1,))
    target.send(host.negotiate())
    challenge = bytearray(target.receive())
    challenge[16 + 32:] = (1).to_bytes(256, "big")    # DH value 1: no secret at all
    with pytest.raises(AuthFailed) as err:
        host.challenge(bytes(challenge))
    assert parse_failure(err.value.failure2) == FailureExplanation.DHGROUP_UNUSABLE
