"""The ``[[subsystem.namespace.replica]]`` tables and the replicated namespace's keys: parsed,
defaulted, and every mistake one ConfigError naming the entry."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from blockd.config import ConfigError
from target.config import ReplicaConfig, parse


def config(ns_extra: str = "", replica: str | None = 'address = "10.0.0.6"\nnqn = "nqn.2026-11.io.blockd:copy"\n') -> dict[str, Any]:
    text = f"""
[[subsystem]]
nqn = "nqn.2026-11.io.blockd:vol1"

[[subsystem.namespace]]
path = "/tmp/x.img"
size = "64MiB"
{ns_extra}
"""
    if replica is not None:
        text += f"\n[[subsystem.namespace.replica]]\n{replica}"
    return tomllib.loads(text)


def test_a_replica_table_with_defaults() -> None:
    (ns,) = parse(config()).subsystems[0].namespaces
    assert ns.replicas == (ReplicaConfig("tcp", "10.0.0.6", 4420, "nqn.2026-11.io.blockd:copy", 1, None, 5.0),)
    assert (ns.region_size, ns.min_in_sync, ns.resync_rate) == (64 << 10, 1, 100 << 20)
    assert ns.replicas[0].name == "tcp://10.0.0.6:4420/nqn.2026-11.io.blockd:copy/1"


def test_every_key_given() -> None:
    (ns,) = parse(config('region_size = "1MiB"\nmin_in_sync = 2\nresync_rate = "10MiB"',
                         'transport = "rdma"\naddress = "10.0.0.7"\nport = 4421\nnqn = "nqn.2026-11.io.blockd:c"\n'
                         'nsid = 3\nhostnqn = "nqn.2014-08.org.nvmexpress:uuid:abc"\ntimeout = 0.5\n')
                  ).subsystems[0].namespaces
    assert ns.replicas == (ReplicaConfig("rdma", "10.0.0.7", 4421, "nqn.2026-11.io.blockd:c", 3,
                                         "nqn.2014-08.org.nvmexpress:uuid:abc", 0.5),)
    assert (ns.region_size, ns.min_in_sync, ns.resync_rate) == (1 << 20, 2, 10 << 20)


@pytest.mark.parametrize("ns_extra, replica, needle", [
    ('region_size = "96KiB"', None, "region_size must be a power of two"),
    ('region_size = "2KiB"', None, "region_size must be a power of two of at least 4KiB"),
    ("min_in_sync = 3", None, "min_in_sync must be 1 (this copy alone) to 2"),
    ("min_in_sync = 0", None, "min_in_sync must be 1"),
    ('resync_rate = "4KiB"', None, "resync_rate must be at least one region"),
    ("read_only = true", None, "cannot be read_only"),
    ("", 'address = "10.0.0.6"\n', "missing 'nqn'"),
    ("", 'address = "10.0.0.6"\nnqn = "copy"\n', "not a valid subsystem NQN"),
    ("", 'address = "10.0.0.6"\nnqn = "nqn.2026-11.io.blockd:c"\ntransport = "fc"\n', "transport must be"),
    ("", 'address = "10.0.0.6"\nnqn = "nqn.2026-11.io.blockd:c"\nport = 0\n', "port 0 is out of range"),
    ("", 'address = "10.0.0.6"\nnqn = "nqn.2026-11.io.blockd:c"\ntimeout = 0\n', "timeout must be more than 0"),
    ("", 'address = "10.0.0.6"\nnqn = "nqn.2026-11.io.blockd:c"\nspeed = 1\n', "unknown setting(s) speed"),
])
def test_mistakes_are_one_line_naming_the_entry(ns_extra: str, replica: str | None, needle: str) -> None:
    raw = config(ns_extra) if replica is None else config(ns_extra, replica)
    with pytest.raises(ConfigError) as err:
        parse(raw)
    assert needle in str(err.value) and "namespace #1" in str(err.value) and "\n" not in str(err.value)


def test_replication_keys_without_replicas_are_refused() -> None:
    with pytest.raises(ConfigError, match="apply only to a namespace with replicas"):
        parse(config("min_in_sync = 1", replica=None))


def test_the_same_replica_twice_is_refused() -> None:
    raw = config()
    ns = raw["subsystem"][0]["namespace"][0]
    ns["replica"].append(dict(ns["replica"][0]))
    with pytest.raises(ConfigError, match="a replica appears twice"):
        parse(raw)


@pytest.mark.parametrize("ns_extra, needle", [
    ('standby_nqn = "standby"', "standby_nqn 'standby' is not a valid subsystem NQN"),
    ('standby_hosts = ["nqn.2014-08.org.nvmexpress:uuid:abc"]', "standby_hosts applies only with standby_nqn"),
    ('standby_nqn = "nqn.2026-11.io.blockd:s"\nstandby_hosts = ["me"]', "standby_hosts: 'me' is not a valid host NQN"),
    ('standby_nqn = "nqn.2026-11.io.blockd:s"\nana_group = 128', "ANA group 128 holds the standby subsystems"),
])
def test_standby_key_mistakes(ns_extra: str, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse(config(ns_extra))
    assert needle in str(err.value) and "namespace #1" in str(err.value)


def test_a_standby_nqn_must_not_clash_and_group_128_is_not_configurable() -> None:
    raw = config('standby_nqn = "nqn.2026-11.io.blockd:vol1"')
    with pytest.raises(ConfigError, match="subsystem NQNs \\(standby_nqn included\\) must be unique"):
        parse(raw)
    raw = config('standby_nqn = "nqn.2026-11.io.blockd:s"')
    raw["ana"] = [{"group": 128, "state": "inaccessible"}]
    with pytest.raises(ConfigError, match="ANA group 128 holds the standby subsystems"):
        parse(raw)
    del raw["ana"]
    (ns,) = parse(raw).subsystems[0].namespaces
    assert (ns.standby_nqn, ns.standby_hosts) == ("nqn.2026-11.io.blockd:s", frozenset())


def test_the_pair_files_in_the_docs_parse_as_a_standby_and_a_primary() -> None:
    """docs/replication.md's two files of a replicated pair, as a user copies them."""
    docs = (Path(__file__).parents[2] / "docs" / "replication.md").read_text()
    section = docs[docs.index("### A replicated pair"):docs.index("### Failing over")]
    files = re.findall(r"```toml\n(.*?)```", section, re.S)
    assert len(files) == 2
    a, b = (parse(tomllib.loads(text)) for text in files)
    for cfg, peer in ((a, "192.0.2.2"), (b, "192.0.2.1")):
        (ns,) = cfg.subsystems[0].namespaces
        assert ns.standby_nqn == ns.replicas[0].nqn and ns.replicas[0].address == peer
    assert not a.ana and [x.state.name for x in b.ana] == ["INACCESSIBLE"]


def test_metadata_path_names_external_metadata_for_a_replicated_namespace_only() -> None:
    (ns,) = parse(config('metadata_path = "/tmp/x.md"')).subsystems[0].namespaces
    assert ns.metadata_path == "/tmp/x.md"
    assert parse(config()).subsystems[0].namespaces[0].metadata_path is None
    with pytest.raises(ConfigError, match="metadata_path apply only to a namespace with replicas"):
        parse(config('metadata_path = "/tmp/x.md"', replica=None))
    with pytest.raises(ConfigError, match="metadata_path must be another file than path"):
        parse(config('metadata_path = "/tmp/../tmp/x.img"'))
