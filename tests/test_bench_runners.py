"""The benchmark runners' bookkeeping (not their figures): each rewrites only its own section of
docs/benchmarks.md, and the VM runner's table keeps the transports apart and reads the JSON of
runs from before it had a TCP table."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "bench"))

from docs_section import write_section  # noqa: E402

from tests.bench import run_rdma_bench  # noqa: E402


def test_a_runner_rewrites_only_its_own_section(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nhand-written\n\n<!-- B1 -->\nold one\n<!-- E1 -->\n\nmiddle\n\n"
                   "<!-- B2 -->\nold two\n<!-- E2 -->\n\ntail\n")
    write_section("<!-- B1 -->", "<!-- E1 -->", "## One", "new one", doc)
    assert doc.read_text() == ("# Benchmarks\n\nhand-written\n\n<!-- B1 -->\nnew one\n<!-- E1 -->\n\nmiddle\n\n"
                               "<!-- B2 -->\nold two\n<!-- E2 -->\n\ntail\n")


def test_a_runner_without_a_section_appends_one_under_its_heading(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n<!-- B1 -->\none\n<!-- E1 -->\n")
    write_section("<!-- B2 -->", "<!-- E2 -->", "## Two", "two\n", doc)
    write_section("<!-- B2 -->", "<!-- E2 -->", "## Two", "two again", doc)
    assert doc.read_text() == ("# Benchmarks\n\n<!-- B1 -->\none\n<!-- E1 -->\n\n## Two\n\n"
                               "<!-- B2 -->\ntwo again\n<!-- E2 -->\n")


def _fio(iops: int, mbs: float) -> dict:
    return {"iops": iops, "mbs": mbs, "lat_mean_us": 10.0, "lat_p99_us": 20.0}


def _rows(text: str, heading: str) -> dict[str, list[str]]:
    """The first table after ``heading``: first cell -> the other cells."""
    rows: dict[str, list[str]] = {}
    for line in text.split(heading, 1)[1].splitlines():
        if line.startswith("|---"):
            continue
        if line.startswith("| "):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
        elif rows:
            break
    return rows


def test_the_vm_table_has_one_table_per_transport_with_its_own_kernel_target() -> None:
    res = {"kernel": "6.1", "size_mib": 256, "runtime_s": 10, "transports": {
        "rdma": {"jobs": {"rr4k_qd1": {"nvmet": _fio(400, 1.6), "blockd": _fio(200, 0.8)}},
                 "blockd_dev": {"blk_mq_queues": 2}},
        "tcp": {"jobs": {"rr4k_qd1": {"nvmet": _fio(5000, 20.0), "blockd": _fio(4000, 16.0)},
                         "sr128k": {"nvmet": _fio(100, 100.0), "blockd": _fio(80, 90.0)}},
                "blockd_dev": {"blk_mq_queues": 2}}}}
    text = run_rdma_bench.table(res, "cmd")
    rdma, tcp = _rows(text, "### NVMe/RDMA"), _rows(text, "### NVMe/TCP")
    assert rdma["workload"][0] == "nvmet-rdma" and tcp["workload"][0] == "nvmet-tcp"
    assert rdma["4 KiB random read, QD1"][2] == "0.50"
    assert tcp["4 KiB random read, QD1"][2] == "0.80"
    assert tcp["128 KiB sequential read, QD16"][2] == "0.90"  # MB/s, not IOPS
    assert rdma["128 KiB sequential read, QD16"][2] == "–"


def test_the_vm_table_reads_a_json_from_before_the_tcp_table_as_rdma() -> None:
    res = {"kernel": "6.1", "size_mib": 256, "runtime_s": 10, "blockd_dev": {"blk_mq_queues": 2},
           "jobs": {"rr4k_qd1": {"nvmet": _fio(400, 1.6), "blockd": _fio(300, 1.2)}}}
    text = run_rdma_bench.table(res, "cmd")
    assert "### NVMe/TCP" not in text
    assert _rows(text, "### NVMe/RDMA")["4 KiB random read, QD1"][2] == "0.75"


def test_the_host_library_table_compares_each_blockd_plane_with_the_nbd_engine() -> None:
    from tests.bench import bench_initiator as hostlib

    def fig(iops: float, mbs: float) -> dict:
        return {"iops": iops, "mbs": mbs, "mean_us": 10.0, "p99_us": 20.0}

    results = {"randread-4k-qd1": {"blockd": fig(30_000, 1), "blockd-pure": fig(15_000, 1),
                                   "nbd-engine": fig(40_000, 1)},
               "seqread-128k-qd8": {"blockd": fig(1, 900), "blockd-pure": fig(1, 300), "nbd-engine": fig(2, 1000)}}
    cpu = {"randread-4k-qd1": {"host library": [4.0, 6.0], "nbdkit": [1.0, 12.0]}}
    jobs = [j for j in hostlib.JOBS if j[0] in results]
    meta = {"started": "now", "command": "cmd", "cpus": 2, "load": [1.0], "load_after": [2.0], "size_mib": 64,
            "workdir_fs": "tmpfs", "resident": "locked", "runtime": 1, "pin": [1]}
    text = hostlib.report(results, cpu, hostlib.SYSTEMS, jobs, meta)
    rows = _rows(text, "Each cell")
    assert rows["randread-4k-qd1"][3:] == ["**0.75×**", "**0.38×**"]  # IOPS
    assert rows["seqread-128k-qd8"][3:] == ["**0.90×**", "**0.30×**"]  # MB/s
    cpu_rows = _rows(text, "CPU time per I/O")
    assert cpu_rows["randread-4k-qd1"][0] == "10.0 = 4.0 + 6.0" and cpu_rows["randread-4k-qd1"][5] == "13.0 = 1.0 + 12.0"
