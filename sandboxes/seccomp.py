"""A seccomp filter for bubblewrap sandboxes: the system calls a sandboxed program has no use for, and
that widen the kernel's attack surface, answer EPERM.

Docker applies its default seccomp profile to every container; bwrap applies none unless given one
(`--seccomp FD`: a compiled classic-BPF program, loaded just before the sandbox's command runs). This
builds that program: the architecture is checked first (a call through another ABI, x32 included, is
refused), then each denied call number returns EPERM, and everything else is allowed. The list follows
what Docker's profile refuses to a container without extra capabilities: mounts and namespaces, kernel
modules and kexec, keyrings, BPF and perf, ptrace and cross-process memory access, clocks, swap,
reboot, io_uring, and the old calls nothing uses.
"""

from __future__ import annotations

import errno
import platform
import struct

# classic BPF (linux/filter.h, linux/seccomp.h)
BPF_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
BPF_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
BPF_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
BPF_RET_K = 0x06  # BPF_RET | BPF_K
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_KILL_PROCESS = 0x80000000
ARCH_OFFSET, NR_OFFSET = 4, 0  # struct seccomp_data: int nr; __u32 arch; ...
X32_SYSCALL_BIT = 0x40000000

# x86_64 call numbers (arch/x86/entry/syscalls/syscall_64.tbl)
X86_64_DENIED = {
    "acct": 163, "add_key": 248, "adjtimex": 159, "bpf": 321, "clock_adjtime": 305, "clock_settime": 227,
    "create_module": 174, "delete_module": 176, "finit_module": 313, "fsconfig": 431, "fsmount": 432,
    "fsopen": 430, "fspick": 433, "get_kernel_syms": 177, "init_module": 175, "io_uring_enter": 426,
    "io_uring_register": 427, "io_uring_setup": 425, "ioperm": 173, "iopl": 172, "kcmp": 312,
    "kexec_file_load": 320, "kexec_load": 246, "keyctl": 250, "lookup_dcookie": 212, "mount": 165,
    "mount_setattr": 442, "move_mount": 429, "name_to_handle_at": 303, "nfsservctl": 180,
    "open_by_handle_at": 304, "open_tree": 428, "perf_event_open": 298, "pivot_root": 155,
    "process_vm_readv": 310, "process_vm_writev": 311, "ptrace": 101, "query_module": 178, "quotactl": 179,
    "reboot": 169, "request_key": 249, "setns": 308, "settimeofday": 164, "swapoff": 168, "swapon": 167,
    "_sysctl": 156, "sysfs": 139, "syslog": 103, "umount2": 166, "unshare": 272, "uselib": 134,
    "userfaultfd": 323, "ustat": 136, "vhangup": 153,
}  # fmt: skip
AUDIT_ARCH = {"x86_64": 0xC000003E}  # AUDIT_ARCH_X86_64
DENIED = {"x86_64": X86_64_DENIED}


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)  # struct sock_filter, native byte order


def filter_program(machine: str | None = None) -> bytes | None:
    """The compiled filter for this machine's architecture (`platform.machine()`), None where no call
    table is known here (the sandbox then runs without one, and says so)."""
    machine = machine or platform.machine()
    if machine not in DENIED:
        return None
    deny = _insn(BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.EPERM)
    prog = [
        _insn(BPF_LD_W_ABS, 0, 0, ARCH_OFFSET),
        _insn(BPF_JEQ_K, 1, 0, AUDIT_ARCH[machine]),  # the expected ABI: skip the kill
        _insn(BPF_RET_K, 0, 0, SECCOMP_RET_KILL_PROCESS),
        _insn(BPF_LD_W_ABS, 0, 0, NR_OFFSET),
    ]
    if machine == "x86_64":  # x32 calls carry this bit: refuse the whole ABI
        prog += [_insn(BPF_JGE_K, 0, 1, X32_SYSCALL_BIT), deny]
    for nr in sorted(DENIED[machine].values()):
        prog += [_insn(BPF_JEQ_K, 0, 1, nr), deny]  # equal: the next instruction (EPERM); else skip it
    prog.append(_insn(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW))
    return b"".join(prog)
