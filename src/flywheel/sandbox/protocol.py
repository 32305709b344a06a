"""The pool's wire format between the host and the in-sandbox server (stdlib only: it is also
placed inside the sandbox next to server.py).

A frame is a 4-byte big-endian length, a JSON header of that length, then the blobs whose
lengths the header lists under "blobs" (stdin for a request; stdout and stderr for an answer).
The host treats answers as untrusted: JSON only (never pickle), a header size cap, a blob size
cap, and a deadline on every read.
"""

import json
import os
import select
import struct
import time

MAX_HEADER = 1 << 24


def write_all(fd, data):
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def write_frame(fd, header, blobs=()):
    header = dict(header, blobs=[len(b) for b in blobs])
    h = json.dumps(header).encode()
    write_all(fd, struct.pack(">I", len(h)) + h + b"".join(blobs))


def read_exact(fd, n, deadline=None):
    """n bytes from fd; EOFError on end of stream, TimeoutError past `deadline` (monotonic)."""
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError("no answer from the sandbox server")
        b = os.read(fd, min(n - got, 1 << 20))
        if not b:
            raise EOFError("sandbox server closed its pipe")
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def read_frame(fd, deadline=None, max_blob=None):
    (n,) = struct.unpack(">I", read_exact(fd, 4, deadline))
    if n > MAX_HEADER:
        raise ValueError(f"frame header of {n} bytes")
    header = json.loads(read_exact(fd, n, deadline))
    if not isinstance(header, dict):
        raise ValueError("frame header is not an object")
    sizes = header.get("blobs", [])
    if not isinstance(sizes, list) or not all(isinstance(s, int) and 0 <= s for s in sizes):
        raise ValueError("bad blob sizes")
    if max_blob is not None and any(s > max_blob for s in sizes):
        raise ValueError("blob over the size limit")
    return header, [read_exact(fd, s, deadline) for s in sizes]
