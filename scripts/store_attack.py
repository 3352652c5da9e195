#!/usr/bin/env python3
"""An unauthenticated client that holds and reopens connections to a rendezvous store.

    scripts/store_attack.py --port P [--host 127.0.0.1] [--connections 1000] [--seconds 30]

What a hostile local user (or a host on the same network) can do without the job secret:
open connections, never send a byte, and open a new one for each that the store closes. For
the acceptance of issue 44 (docs/design.md, "Security model"): a job started beside it must
start at its normal pace, and a rank restarted under --max-restarts must rejoin. Bounded in
connections and time; sends nothing. Use it only against a store of your own, on loopback or
on emulated hosts (tests/netns/run.sh).

Prints one line every second (held, opened, answered with a CHALLENGE, closed by the store,
refused or reset) and a summary at the end.
"""
import argparse
import errno
import selectors
import socket
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--connections", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--rate", type=float, default=2000.0,
                    help="new connections per second at most (default 2000)")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args()
    if not 1 <= a.connections <= 20000 or not 0 < a.seconds <= 600 or not 0 < a.rate <= 1e5:
        ap.error("--connections must be in 1..20000, --seconds in (0, 600], --rate in "
                 "(0, 100000]")

    sel = selectors.DefaultSelector()
    opened = closed_by_store = refused = challenged = 0

    def open_one():
        nonlocal opened, refused
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        rc = s.connect_ex((a.host, a.port))
        if rc not in (0, errno.EINPROGRESS):
            refused += 1
            s.close()
            return False
        sel.register(s, selectors.EVENT_READ)
        opened += 1
        return True

    start = time.monotonic()
    end = start + a.seconds
    last_report = start
    while time.monotonic() < end:
        for key, _ in sel.select(timeout=0.05):
            s = key.fileobj
            try:
                data = s.recv(4096)  # the CHALLENGE; then EOF when the store drops it
            except OSError:  # refused (nobody listens yet) or reset
                sel.unregister(s)
                s.close()
                refused += 1
                continue
            if data:
                challenged += 1
            else:
                sel.unregister(s)
                s.close()
                closed_by_store += 1
        # Open (again) what is missing, at most --rate per second since the start.
        allowed = int((time.monotonic() - start) * a.rate) + a.connections - opened - refused
        while len(sel.get_map()) < a.connections and allowed > 0:
            allowed -= 1
            if not open_one():
                break
        now = time.monotonic()
        if not a.quiet and now - last_report >= 1:
            print(f"store_attack: {now - start:5.1f} s held {len(sel.get_map())} opened {opened} "
                  f"challenged {challenged} closed by the store {closed_by_store} "
                  f"refused or reset {refused}", flush=True)
            last_report = now
    for key in list(sel.get_map().values()):
        key.fileobj.close()
    print(f"store_attack: done after {time.monotonic() - start:.1f} s: opened {opened}, "
          f"challenged {challenged}, closed by the store {closed_by_store}, refused or reset "
          f"{refused}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
