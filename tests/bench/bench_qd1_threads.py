"""Model: at QD1, does a blocking thread per queue (nbdfuse's way) cost the initiator less CPU
than the event loop's epoll round trips?

Three processes, as on the FUSE path: a "kernel" client sends an 80-byte request into a SEQPACKET
pair (the /dev/fuse stand-in) and waits for a 4 KiB reply; the server under test forwards a
72-byte capsule over TCP loopback to an echo "target", which answers with a C2HData-sized
message; the server then writes the reply. Only the server's way of waiting differs:

- ``epoll``: uvloop readers on both fds, non-blocking, as ``FuseSession`` and the transport do
  (the FUSE callback reads until nothing is queued, so each request costs one empty read);
- ``blocking``: one thread doing read, send, recv, write, blocking in each, the GIL released
  inside every syscall.

Both do the same Python work per request (a few calls), so the difference is the waiting
structure: epoll_wait calls, empty reads, wake-ups. Prints the server's user + system CPU per
request (getrusage) and the request rate. Not a test. Run (pinned to one CPU, as the FUSE
benchmark's single-job rows)::

    taskset -c 1 .venv/bin/python tests/bench/bench_qd1_threads.py epoll
    taskset -c 1 .venv/bin/python tests/bench/bench_qd1_threads.py blocking
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import signal
import socket
import threading
import time

import uvloop

REQUEST = b"r" * 80
CAPSULE = b"c" * 72
DATA = b"d" * (4096 + 24)
REPLY = b"x" * (4096 + 16)


def _target(listener: socket.socket) -> None:
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while conn.recv(65536):
        conn.sendall(DATA)


def _client(dev: socket.socket, requests: int) -> None:
    for _ in range(requests):
        dev.send(REQUEST)
        dev.recv(8192)


def _serve_blocking(dev: int, tcp: int, requests: int) -> None:
    def run() -> None:
        buf, rbuf = bytearray(1 << 20), bytearray(65536)
        for _ in range(requests):
            os.readv(dev, [buf])
            os.write(tcp, CAPSULE)
            got = 0
            while got < len(DATA):
                got += os.readv(tcp, [rbuf])
            os.write(dev, REPLY)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()


def _serve_epoll(dev: socket.socket, tcp: socket.socket, requests: int) -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        finished = loop.create_future()
        buf, rbuf = bytearray(1 << 20), bytearray(65536)
        dev_file = open(dev.fileno(), "rb", buffering=0, closefd=False)
        state = {"served": 0, "got": 0}

        def on_request() -> None:
            while dev_file.readinto(buf):  # None once nothing is queued
                os.write(tcp.fileno(), CAPSULE)

        def on_answer() -> None:
            while True:
                try:
                    state["got"] += tcp.recv_into(rbuf)
                except BlockingIOError:
                    return
                if state["got"] >= len(DATA):
                    state["got"] -= len(DATA)
                    os.write(dev.fileno(), REPLY)
                    state["served"] += 1
                    if state["served"] == requests:
                        finished.set_result(None)
                        return

        loop.add_reader(dev.fileno(), on_request)
        loop.add_reader(tcp.fileno(), on_answer)
        await finished
    dev.setblocking(False)
    tcp.setblocking(False)
    uvloop.run(run())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=["epoll", "blocking"])
    ap.add_argument("--requests", type=int, default=20000)
    args = ap.parse_args()
    listener = socket.create_server(("127.0.0.1", 0))
    target = os.fork()
    if target == 0:
        _target(listener)
        os._exit(0)
    kernel, ours = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client = os.fork()
    if client == 0:
        ours.close()
        _client(kernel, args.requests)
        os._exit(0)
    kernel.close()
    tcp = socket.create_connection(listener.getsockname())
    tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    if args.mode == "blocking":
        _serve_blocking(ours.fileno(), tcp.fileno(), args.requests)
    else:
        _serve_epoll(ours, tcp, args.requests)
    after, elapsed = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - start
    user = (after.ru_utime - before.ru_utime) / args.requests * 1e6
    system = (after.ru_stime - before.ru_stime) / args.requests * 1e6
    print(f"{args.mode:8}: {args.requests / elapsed:8,.0f} requests/s, server CPU {user + system:4.1f} µs "
          f"per request = {user:.1f} user + {system:.1f} system")
    os.waitpid(client, 0)
    os.kill(target, signal.SIGKILL)
    os.waitpid(target, 0)


if __name__ == "__main__":
    main()
