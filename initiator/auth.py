"""The host's side of DH-HMAC-CHAP on one queue (NVMe Base 2.0 section 8.13), sans-I/O.

The controller's connect code sends :meth:`HostAuth.negotiate` with Authentication Send, passes
what Authentication Receive returned to :meth:`HostAuth.challenge` (whose result goes out with
the next Send), then the second Receive to :meth:`HostAuth.success1`, which returns Success2 to
send when the host authenticated the controller too. A wrong or failed message raises
:class:`AuthFailed`; when the host itself refuses (a bad challenge, a controller response that
does not match) the exception carries the Failure2 to send before giving up, as the kernel's
host does (drivers/nvme/host/auth.c).
"""

from __future__ import annotations

import os

from blockd.dhchap import (
    DhError, DhExchange, augment, controller_response, dh_value_length, hash_length,
    host_response, next_seqnum, same,
)
from blockd.dhchap_secret import HASHES, Secret
from protocol.auth import (
    SC_C_NONE, AuthMessage, AuthMessageError, AuthType, DhGroup, FailureExplanation,
    build_failure, build_negotiate, build_reply, build_success2, parse_challenge,
    parse_failure, parse_head, parse_success1,
)

OFFERED_HASHES = tuple(HASHES)
OFFERED_GROUPS = tuple(DhGroup)
"""Everything blockd can compute; the controller picks (the kernel's host offers the same)."""


class AuthFailed(Exception):
    """Authentication did not succeed; ``failure2`` is the message to send, if any."""

    def __init__(self, text: str, failure2: bytes | None = None) -> None:
        super().__init__(text)
        self.failure2 = failure2


class HostAuth:
    """One transaction: the host's secret, and the controller's when authenticating both ways."""

    def __init__(self, secret: Secret, ctrl_secret: Secret | None, hostnqn: str, subnqn: str,
                 t_id: int) -> None:
        self.secret = secret
        self.ctrl_secret = ctrl_secret
        self.hostnqn = hostnqn
        self.subnqn = subnqn
        self.t_id = t_id
        self._hash = 0
        self._session: bytes | None = None
        self._c2: bytes | None = None
        self._s2 = 0

    def negotiate(self) -> bytes:
        return build_negotiate(self.t_id, list(OFFERED_HASHES), list(OFFERED_GROUPS))

    def _expect(self, data: bytes, auth_id: AuthMessage) -> None:
        head = parse_head(data)
        if head.auth_id == AuthMessage.FAILURE1:
            raise AuthFailed(f"controller refused: {FailureExplanation(parse_failure(data)).name}")
        if head.auth_type != AuthType.DHCHAP or head.auth_id != auth_id:
            raise AuthMessageError(FailureExplanation.INCORRECT_MESSAGE,
                                   f"expected {auth_id.name}, got message {head.auth_id:#x}")
        if head.t_id != self.t_id:
            raise AuthMessageError(FailureExplanation.INCORRECT_PAYLOAD,
                                   f"transaction {head.t_id}, expected {self.t_id}")

    def _failure2(self, exc: AuthMessageError) -> AuthFailed:
        return AuthFailed(f"authentication refused: {exc}",
                          build_failure(AuthMessage.FAILURE2, self.t_id, exc.explanation))

    def challenge(self, data: bytes) -> bytes:
        """The Reply to the controller's Challenge."""
        try:
            self._expect(data, AuthMessage.CHALLENGE)
            ch = parse_challenge(data)
            if ch.hash_id not in OFFERED_HASHES:
                raise AuthMessageError(FailureExplanation.HASH_UNUSABLE, f"hash {ch.hash_id}")
            hl = hash_length(ch.hash_id)
            if len(ch.c1) != hl:
                raise AuthMessageError(FailureExplanation.INCORRECT_PAYLOAD, f"HL {len(ch.c1)}")
            if ch.dh_group not in OFFERED_GROUPS:
                raise AuthMessageError(FailureExplanation.DHGROUP_UNUSABLE, f"group {ch.dh_group}")
            public = b""
            if dh_value_length(ch.dh_group):
                dh = DhExchange(ch.dh_group)
                try:
                    self._session = dh.session_key(ch.dh_value)
                except DhError as exc:
                    raise AuthMessageError(FailureExplanation.DHGROUP_UNUSABLE, str(exc)) from None
                public = dh.public
            elif ch.dh_value:
                raise AuthMessageError(FailureExplanation.INCORRECT_PAYLOAD, "DH value, NULL group")
        except AuthMessageError as exc:
            raise self._failure2(exc) from None
        self._hash = ch.hash_id
        r1 = host_response(ch.hash_id, self.secret.transformed(self.hostnqn),
                           augment(ch.hash_id, self._session, ch.c1), ch.seqnum, self.t_id,
                           SC_C_NONE, self.hostnqn, self.subnqn)
        if self.ctrl_secret is not None:
            self._c2 = os.urandom(hl)
            self._s2 = next_seqnum()
        return build_reply(self.t_id, r1, self._c2, self._s2, public)

    def success1(self, data: bytes) -> bytes | None:
        """Check Success1; the Success2 to send when the controller was authenticated too."""
        try:
            self._expect(data, AuthMessage.SUCCESS1)
            s1 = parse_success1(data)
            if s1.hl != hash_length(self._hash):
                raise AuthMessageError(FailureExplanation.HASH_UNUSABLE, f"HL {s1.hl}")
            if self.ctrl_secret is None or self._c2 is None:
                return None
            expected = controller_response(
                self._hash, self.ctrl_secret.transformed(self.subnqn),
                augment(self._hash, self._session, self._c2), self._s2, self.t_id,
                self.hostnqn, self.subnqn)
            if s1.response is None or not same(s1.response, expected):
                raise AuthMessageError(FailureExplanation.FAILED, "controller response mismatch")
        except AuthMessageError as exc:
            raise self._failure2(exc) from None
        return build_success2(self.t_id)
