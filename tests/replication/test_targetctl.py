"""``blockctl target replicas`` and ``verify``: the human text made of the control socket's
replies (the JSON is the reply itself)."""

from __future__ import annotations

from blockd.cli.targetctl import _replicas_text, _verify_text


def test_replicas_text_shows_states_progress_and_reasons() -> None:
    reply = [{"subsystem": "nqn.2026-11.io.blockd:vol1", "nsid": 1, "role": "primary", "inconsistent": False,
              "data_size": 10 << 30, "region_size": 64 << 10,
              "min_in_sync": 2, "copies_in_sync": 2, "generation": "00ff", "node_id": "01",
              "replicas": [
                  {"replica": "tcp://a:4420/n/1", "slot": 0, "state": "in_sync", "reason": "", "missing_regions": 0,
                   "dirty_regions": 3, "resynced_bytes": 0},
                  {"replica": "tcp://b:4420/n/1", "slot": 1, "state": "resyncing", "reason": "", "missing_regions": 40,
                   "dirty_regions": 41, "resynced_bytes": 1 << 20,
                   "resync": {"percent": 41.25, "copied_bytes": 1, "total_bytes": 2, "mb_per_s": 95.31, "eta_s": 75.0}},
                  {"replica": "tcp://c:4420/n/1", "slot": None, "state": "split_brain", "reason": "split brain: both",
                   "missing_regions": 0, "dirty_regions": None, "resynced_bytes": 0}]}]
    lines = _replicas_text(reply).splitlines()
    assert lines[0] == ("nqn.2026-11.io.blockd:vol1 namespace 1: primary, 2 of 4 copies in sync (min_in_sync 2), "
                        "data 10GiB, region 64KiB, generation 00ff")
    assert lines[2].split() == ["0", "tcp://a:4420/n/1", "in_sync", "0", "-"]
    assert "resyncing 41.2% 95.3MB/s eta 1m15s" in lines[3] and lines[3].split()[-2:] == ["40", "-"]
    assert lines[4].split()[:3] == ["-", "tcp://c:4420/n/1", "split_brain"] and lines[4].endswith("split brain: both")
    assert _replicas_text([]) == "no replicated namespaces"
    standby = {**reply[0], "role": "secondary", "inconsistent": True}
    assert _replicas_text([standby]) == (
        "nqn.2026-11.io.blockd:vol1 namespace 1: secondary (standby, written by its primary), data 10GiB, "
        "region 64KiB, generation 00ff, inconsistent (a resync into it is unfinished)")


def test_verify_text_lists_each_differing_region_with_its_bytes() -> None:
    text = _verify_text({"replicas": [
        {"replica": "r0", "regions": 100, "region_size": 65536, "method": "digest", "mismatched": []},
        {"replica": "r1", "regions": 100, "region_size": 65536, "method": "read",
         "mismatched": [{"region": 37, "offset": 37 * 65536, "length": 65536}]}]})
    assert text.splitlines() == ["r0: 100 regions compared by digests, 0 differ",
                                 "r1: 100 regions compared by reading its data, 1 differ (marked for resync)",
                                 f"  region 37: bytes {37 * 65536}..{38 * 65536 - 1}"]
