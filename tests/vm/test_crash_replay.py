"""Real power loss of a replicated pair: dm-log-writes under both disks, every crash point
replayed (issue 35, deliverable 3).

The guest twin (tests/vm/guest_tests/test_crash_replay.py) records the logs of the primary's
and the replica's disks under a writer; this twin replays them here, on the host (the replay
needs no guest kernel, and runs far faster outside TCG), and checks every crash point:
tests/vm/crashpoints.py. ``BLOCKD_CRASH_SEED`` picks the writer's offsets and the random crash
points (default 35).
"""

import os

import pytest

from tests.vm import crashpoints

pytestmark = [pytest.mark.vm]

GUEST_TESTS = "tests/vm/guest_tests/test_crash_replay.py"
VM_TIMEOUT = 420


def test_power_loss_at_every_flush_fua_and_between(guest_case):
    """At every FLUSH/FUA entry of each log, the ticks and random points between: the metadata
    opens, each write acknowledged durable is there, and the pair restarted resyncs from the
    bitmaps to copies verify finds equal."""
    rec = crashpoints.Recording.load(guest_case.results)
    report = crashpoints.check(rec, seed=int(os.environ.get("BLOCKD_CRASH_SEED", "35")))
    print(report.summary())
    (guest_case.results / "crash-report.txt").write_text(report.summary() + "\n" + "\n".join(report.failures) + "\n")
    assert not report.failures, report.summary() + "\n" + "\n".join(report.failures)
    # the points reached what the checks are for: copies that differed and were mended
    assert report.pairs_differing_before_resync > 0, report.summary()
    assert report.durable_points > 0 and report.pairs > 100, report.summary()
