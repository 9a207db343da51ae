#!/usr/bin/env python3
"""Bulk TCP transfer for measuring shaped links: run `recv` on one node, then `send` on another.

    python tcp_bulk.py recv --port 5201 [--bind 0.0.0.0]
    python tcp_bulk.py send --host IP --port 5201 --mbytes 50

The receiver prints one JSON line: bytes received, seconds from the first to the last byte,
and goodput in Mbit/s (payload bits per second, as iperf reports it).
"""

import argparse
import json
import socket
import sys
import time

CHUNK = 1 << 20


def receive(bind: str, port: int) -> dict:
    """Accept one connection, drain it, and time it from the first byte to EOF."""
    with socket.create_server((bind, port)) as server:
        print("listening", flush=True)
        conn, _ = server.accept()
        with conn:
            buf = bytearray(CHUNK)
            total = conn.recv_into(buf)
            start = time.perf_counter()
            first = total
            while True:
                n = conn.recv_into(buf)
                if n == 0:
                    break
                total += n
            secs = time.perf_counter() - start
    timed = total - first
    goodput = timed * 8 / secs / 1e6 if secs else None
    return {"bytes": total, "seconds": secs, "goodput_mbit": goodput}


def send(host: str, port: int, mbytes: float) -> None:
    """Connect (retrying while the receiver starts) and send `mbytes` MiB of zeros."""
    deadline = time.monotonic() + 10
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with conn:
        conn.settimeout(None)
        left = int(mbytes * (1 << 20))
        data = bytes(CHUNK)
        while left > 0:
            n = min(left, CHUNK)
            conn.sendall(memoryview(data)[:n])
            left -= n


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=["send", "recv"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--bind", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=5201)
    parser.add_argument("--mbytes", type=float, default=50.0)
    args = parser.parse_args(argv)
    if args.role == "recv":
        print(json.dumps(receive(args.bind, args.port)), flush=True)
    else:
        send(args.host, args.port, args.mbytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
