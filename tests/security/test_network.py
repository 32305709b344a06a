"""No network: the sandbox has its own network namespace with only a loopback of its own, so a
listener on the host's 127.0.0.1 is unreachable, DNS fails and outside addresses are unroutable."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from sandbox_helpers import assert_pool_clean

CONNECT = """
import socket
s = socket.socket()
s.settimeout(2)
try:
    s.connect(("127.0.0.1", {port}))
    s.sendall(b"escaped")
    print("CONNECTED")
except OSError as e:
    print("refused", type(e).__name__, e.errno)
"""
DNS = """
import socket
try:
    print("RESOLVED", socket.getaddrinfo("example.com", 80))
except OSError as e:
    print("no dns", type(e).__name__)
"""
OUTSIDE = """
import socket
for addr in [("1.1.1.1", 53), ("8.8.8.8", 443), ("10.0.0.1", 80)]:
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect(addr)
        print("CONNECTED", addr)
    except OSError as e:
        print("unreachable", e.errno)
print([n for _, n in socket.if_nameindex()])
"""


@pytest.fixture
def listener():
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)
    yield srv
    srv.close()


def _accepted(srv) -> bool:
    try:
        conn, _ = srv.accept()
    except OSError:
        return False
    conn.close()
    return True


def test_tcp_to_host_listener_fails(sandbox, pool, listener):
    port = listener.getsockname()[1]
    code = CONNECT.format(port=port)
    for r in (sandbox.run_python(code), pool.run_python(code)):
        assert r.ok and r.stdout.startswith("refused"), r
    assert not _accepted(listener)
    # control: the same client code does reach the listener from the host
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=10)
    assert out.stdout.startswith("CONNECTED") and _accepted(listener)


def test_dns_lookup_fails(sandbox, pool):
    for r in (sandbox.run_python(DNS), pool.run_python(DNS)):
        assert r.ok and r.stdout.startswith("no dns"), r


def test_outside_addresses_unreachable_and_only_loopback(sandbox, pool):
    for r in (sandbox.run_python(OUTSIDE), pool.run_python(OUTSIDE)):
        lines = r.stdout.splitlines()
        assert r.ok and all(line.startswith("unreachable") for line in lines[:3]), r
        assert lines[3] == "['lo']"
    assert_pool_clean(pool)
