"""The controller's side of DH-HMAC-CHAP on one queue (NVMe Base 2.0 section 8.13), sans-I/O.

The queue hands each Authentication Send's data to :meth:`QueueAuth.send` and answers each
Authentication Receive with :meth:`QueueAuth.receive`. The steps follow the kernel's nvmet
(drivers/nvme/target/fabrics-cmd-auth.c): Negotiate -> Challenge -> Reply -> Success1
[-> Success2 when the host challenged back]. Any message that is wrong for the step, for the
transaction or in itself moves the transaction to Failure1 with the spec's explanation; the next
Receive returns that Failure1 and :attr:`failed` tells the queue to refuse further service. A
Negotiate at any time restarts the transaction (re-authentication).
"""

from __future__ import annotations

import os

from blockd.dhchap import (
    DhError, DhExchange, augment, controller_response, dh_value_length, hash_length,
    host_response, next_seqnum, same,
)
from target.config import HostAuthConfig
from protocol.auth import (
    SC_C_NONE, AuthMessage, AuthMessageError, AuthType, FailureExplanation, build_challenge,
    build_failure, build_success1, parse_head, parse_negotiate, parse_reply,
)

_NEGOTIATE = AuthMessage.NEGOTIATE
_CHALLENGE = AuthMessage.CHALLENGE
_REPLY = AuthMessage.REPLY
_SUCCESS1 = AuthMessage.SUCCESS1
_SUCCESS2 = AuthMessage.SUCCESS2
_FAILURE1 = AuthMessage.FAILURE1
_FAILURE2 = AuthMessage.FAILURE2
_DONE = -1
"""No message expected: the transaction ended (authenticated, or failed and answered)."""


class QueueAuth:
    """One queue's authentication state: ``authenticated`` gates every other command."""

    def __init__(self, config: HostAuthConfig, hostnqn: str, subnqn: str) -> None:
        self.config = config
        self.hostnqn = hostnqn
        self.subnqn = subnqn
        self.authenticated = False
        self.failed = False
        self._step: int = _NEGOTIATE
        self._status = 0
        self._t_id = 0
        self._hash = 0
        self._group = 0
        self._c1 = b""
        self._s1 = 0
        self._dh: DhExchange | None = None
        self._session: bytes | None = None
        self._c2: bytes | None = None
        self._s2 = 0
        self._ctrl_key = b""

    def _fail(self, explanation: int) -> None:
        self._step = _FAILURE1
        self._status = explanation
        self.authenticated = False

    # -- Authentication Send --------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        """Take one message the host sent; a failure shows in the next :meth:`receive`."""
        try:
            head = parse_head(data)
            if head.auth_type == AuthType.COMMON and head.auth_id == _NEGOTIATE:
                self._negotiate(data)
                return
            if head.auth_type != AuthType.DHCHAP or head.auth_id != self._step:
                if head.auth_type == AuthType.DHCHAP and head.auth_id == _FAILURE2:
                    self.failed = True
                    self.authenticated = False
                    self._step = _DONE
                    return
                raise AuthMessageError(FailureExplanation.INCORRECT_MESSAGE,
                                       f"message {head.auth_id:#x} out of order")
            if head.t_id != self._t_id:
                raise AuthMessageError(FailureExplanation.INCORRECT_PAYLOAD,
                                       f"transaction {head.t_id}, expected {self._t_id}")
            if head.auth_id == _REPLY:
                self._reply(data)
            else:  # Success2: the host accepted our response
                self.authenticated = True
                self._step = _DONE
        except AuthMessageError as exc:
            self._fail(exc.explanation)

    def _negotiate(self, data: bytes) -> None:
        neg = parse_negotiate(data)
        self._t_id = neg.t_id
        if neg.sc_c != SC_C_NONE:
            raise AuthMessageError(FailureExplanation.CONCAT_MISMATCH, "secure channel asked")
        self._hash = next((h for h in self.config.hashes if h in neg.hash_ids), 0)
        if not self._hash:
            raise AuthMessageError(FailureExplanation.HASH_UNUSABLE, "no common hash")
        group = next((g for g in self.config.dh_groups if g in neg.dh_groups), None)
        if group is None:
            raise AuthMessageError(FailureExplanation.DHGROUP_UNUSABLE, "no common DH group")
        self._group = group
        self._step = _CHALLENGE

    def _reply(self, data: bytes) -> None:
        reply = parse_reply(data)
        hl = hash_length(self._hash)
        if len(reply.response) != hl:
            raise AuthMessageError(FailureExplanation.INCORRECT_PAYLOAD, f"HL {len(reply.response)}")
        session = None
        if self._dh is None:
            if reply.dh_value:
                raise AuthMessageError(FailureExplanation.INCORRECT_PAYLOAD, "DH value, NULL group")
        else:
            try:
                session = self._dh.session_key(reply.dh_value)
            except DhError as exc:
                raise AuthMessageError(FailureExplanation.DHGROUP_UNUSABLE, str(exc)) from None
        key = self.config.secret.transformed(self.hostnqn)
        expected = host_response(self._hash, key, augment(self._hash, session, self._c1),
                                 self._s1, self._t_id, SC_C_NONE, self.hostnqn, self.subnqn)
        if not same(reply.response, expected):
            raise AuthMessageError(FailureExplanation.FAILED, "host response mismatch")
        # SEQNUM 0 with a C2 only seeds a secure channel's PSK, which blockd does not speak
        if reply.c2 is not None and reply.seqnum:
            if self.config.ctrl_secret is None:
                raise AuthMessageError(FailureExplanation.FAILED, "no controller secret")
            self._c2, self._s2, self._session = reply.c2, reply.seqnum, session
            self._ctrl_key = self.config.ctrl_secret.transformed(self.subnqn)
        else:
            self._c2 = None
            self.authenticated = True
        self._step = _SUCCESS1

    # -- Authentication Receive -----------------------------------------------------------------

    def receive(self) -> bytes:
        """The message the host asked for with Authentication Receive."""
        step = self._step
        if step == _CHALLENGE:
            hl = hash_length(self._hash)
            self._c1 = os.urandom(hl)
            self._s1 = next_seqnum()
            self._dh = DhExchange(self._group) if dh_value_length(self._group) else None
            self._step = _REPLY
            return build_challenge(self._t_id, self._hash, self._group, self._s1, self._c1,
                                   self._dh.public if self._dh else b"")
        if step == _SUCCESS1:
            hl = hash_length(self._hash)
            if self._c2 is None:
                self._step = _DONE
                return build_success1(self._t_id, hl, None)
            r2 = controller_response(self._hash, self._ctrl_key, augment(self._hash, self._session, self._c2),
                                     self._s2, self._t_id, self.hostnqn, self.subnqn)
            self._step = _SUCCESS2
            return build_success1(self._t_id, hl, r2)
        if step != _FAILURE1:  # a Receive the transaction did not expect
            self._status = FailureExplanation.INCORRECT_MESSAGE
        self._step = _DONE
        self.failed = True
        self.authenticated = False
        return build_failure(_FAILURE1, self._t_id, self._status)
