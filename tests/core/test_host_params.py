"""The connect parameters are declared once (initiator.params); blockctl's flags, the daemon's
connect request and the initiator config's [[connection]] tables all derive from them."""

from __future__ import annotations

import math
import uuid

import pytest

from blockd.cli.blockctl import _parser
from blockd.config import ConfigError
from initiator.config import BOOT_CTRL_LOSS_TMO, parse
from initiator.params import CONNECT_OPTIONS, ConnectParams, connect_params


def _connect_request(argv: list[str]) -> dict:
    args = _parser().parse_args(["connect", *argv])
    return {opt.key: getattr(args, opt.key) for opt in CONNECT_OPTIONS}


def test_blockctl_defaults_are_the_params_defaults() -> None:
    request = _connect_request(["-a", "192.0.2.1", "-n", "nqn.x"])
    params = connect_params(request)
    plain = ConnectParams(traddr="192.0.2.1", subnqn="nqn.x")
    assert params == plain
    assert params.trsvcid == 4420 and params.ctrl_loss_tmo == 60.0


def test_blockctl_flags_follow_nvme_cli() -> None:
    request = _connect_request(["-t", "rdma", "-a", "a", "-s", "4421", "-n", "nqn.x", "-q", "nqn.h", "-i", "2",
                                "-Q", "64", "-k", "7", "-l", "-1", "-g", "-G"])
    p = connect_params(request)
    assert (p.transport, p.traddr, p.trsvcid, p.subnqn, p.hostnqn) == ("rdma", "a", 4421, "nqn.x", "nqn.h")
    assert (p.nr_io_queues, p.queue_size, p.keep_alive_tmo) == (2, 64, 7.0)
    assert p.ctrl_loss_tmo == math.inf and p.hdr_digest and p.data_digest
    assert p.hostid == uuid.uuid5(uuid.NAMESPACE_OID, "nqn.h")  # follows the host NQN given


def test_request_mistakes_are_one_line() -> None:
    with pytest.raises(ValueError, match="missing 'nqn'"):
        connect_params({"traddr": "a"})
    with pytest.raises(ValueError, match="unknown setting 'nr_queues'"):
        connect_params({"traddr": "a", "nqn": "n", "nr_queues": 2})
    with pytest.raises(ValueError, match="'queue_size' must be int"):
        connect_params({"traddr": "a", "nqn": "n", "queue_size": True})
    with pytest.raises(ValueError, match="'transport' must be tcp or rdma"):
        connect_params({"traddr": "a", "nqn": "n", "transport": "fc"})
    with pytest.raises(ValueError, match="trsvcid 0 is out of range"):
        connect_params({"traddr": "a", "nqn": "n", "trsvcid": 0})


def test_config_connection_uses_the_same_options() -> None:
    cfg = parse({"connection": [{"name": "v", "traddr": "a", "nqn": "n", "trsvcid": 4421, "keep_alive_tmo": 2}]})
    [conn] = cfg.connections
    args = conn.connect_args()
    assert args == {"name": "v", "traddr": "a", "nqn": "n", "trsvcid": 4421, "keep_alive_tmo": 2,
                    "ctrl_loss_tmo": BOOT_CTRL_LOSS_TMO}
    name = args.pop("name")
    params = connect_params(args)
    assert name == "v" and params.ctrl_loss_tmo == math.inf and params.keep_alive_tmo == 2
    explicit = parse({"connection": [{"traddr": "a", "nqn": "n", "ctrl_loss_tmo": 30}]}).connections[0]
    assert explicit.connect_args()["ctrl_loss_tmo"] == 30 and explicit.key == "n"


@pytest.mark.parametrize("table, message", [
    ({"traddr": "a"}, "missing 'nqn'"),
    ({"traddr": "a", "nqn": "n", "bogus": 1}, "unknown setting(s) bogus"),
    ({"traddr": "a", "nqn": "n", "hdr_digest": 1}, "'hdr_digest' must be bool"),
    ({"traddr": "a", "nqn": "n", "name": 3}, "'name' must be str"),
])
def test_config_mistakes(table: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse({"connection": [table]})
