"""A seccomp filter (classic BPF, as `bwrap --seccomp FD` takes it) that refuses syscalls
sandboxed code has no use for and that widen the kernel attack surface or break isolation.

Refused with EPERM: ptrace and process_vm_* (without this, code can ptrace bwrap's pid-1 reaper,
which has the same uid, and stop it), keyrings (kernel keyrings are not namespaced by path and
would carry state between pool requests), mount/namespace/module/kexec/reboot/swap/clock calls,
bpf, perf_event_open, userfaultfd, io_uring (a long record of kernel bugs), the new mount API,
open_by_handle_at. A syscall from a foreign ABI (i386 via int 0x80 or x32 on x86-64) is refused
with ENOSYS, so the numbers below cannot be bypassed by switching ABI.

Only x86-64 and aarch64 have tables here; on another architecture `program()` returns None and
the sandbox runs without this filter (bwrap's namespaces and dropped capabilities still hold).
Numbers are from the kernel's unistd headers (asm/unistd_64.h, asm-generic/unistd.h).
"""

from __future__ import annotations

import errno
import functools
import platform
import struct

# (x86-64, aarch64); None where the syscall does not exist on that architecture
DENIED = {
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "perf_event_open": (298, 241), "bpf": (321, 280), "userfaultfd": (323, 282),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218),
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51),
    "setns": (308, 268), "unshare": (272, 97),
    "init_module": (175, 105), "finit_module": (313, 273), "delete_module": (176, 106),
    "kexec_load": (246, 104), "kexec_file_load": (320, 294), "reboot": (169, 142),
    "swapon": (167, 224), "swapoff": (168, 225), "acct": (163, 89),
    "open_by_handle_at": (304, 265), "name_to_handle_at": (303, 264),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "syslog": (103, 116), "uselib": (134, None), "vhangup": (153, 58), "quotactl": (179, 60),
    "lookup_dcookie": (212, 18), "open_tree": (428, 428), "move_mount": (429, 429),
    "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433),
    "mount_setattr": (442, 442), "kcmp": (312, 272), "settimeofday": (164, 170),
    "clock_settime": (227, 112), "adjtimex": (159, 171), "clock_adjtime": (305, 266),
    "ioperm": (173, None), "iopl": (172, None), "fanotify_init": (300, 262),
}

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_BIT = 0x40000000

# BPF opcodes
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


@functools.lru_cache(maxsize=None)
def program(machine: str | None = None) -> bytes | None:
    """The filter as raw `struct sock_filter` records, or None on an architecture without a table."""
    machine = machine or platform.machine()
    if machine in ("amd64",):
        machine = "x86_64"
    if machine in ("arm64",):
        machine = "aarch64"
    if machine not in _AUDIT_ARCH:
        return None
    col = 0 if machine == "x86_64" else 1
    nrs = sorted({v[col] for v in DENIED.values() if v[col] is not None})
    deny_enosys = _RET_ERRNO | errno.ENOSYS
    deny_eperm = _RET_ERRNO | errno.EPERM
    prog = [
        _insn(_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        _insn(_JEQ_K, 1, 0, _AUDIT_ARCH[machine]),
        _insn(_RET_K, 0, 0, deny_enosys),  # another ABI: refuse everything
        _insn(_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
    ]
    if machine == "x86_64":
        prog += [_insn(_JGE_K, 0, 1, _X32_BIT), _insn(_RET_K, 0, 0, deny_enosys)]
    # one compare per number; a match jumps to the shared EPERM return after the ALLOW
    n = len(nrs)
    for i, nr in enumerate(nrs):
        prog.append(_insn(_JEQ_K, n - i, 0, nr))
    prog += [_insn(_RET_K, 0, 0, _RET_ALLOW), _insn(_RET_K, 0, 0, deny_eperm)]
    return b"".join(prog)
