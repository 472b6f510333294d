"""The child side of polyrl's Python sandbox: confine this process, then run the model's code.

Run as a script by :mod:`polyrl.envs.sandbox` (``python -I -S -B sandbox_child.py CONFIG_JSON``, the
code on stdin); standard library only, so nothing outside the interpreter's own files is needed
once the process is confined. Every layer is set up before a line of the model's code runs, in
this order:

1. **Namespaces, when the kernel allows unprivileged user namespaces**: a new user, network and
   mount namespace. The network namespace has no interface but a down loopback; the working
   directory is replaced by a size-capped ``tmpfs`` (so the disk cannot be filled), private to
   this process.
2. **No capabilities.** Started as root, the process keeps uid 0 but loses every capability.
3. **Landlock** (Linux >= 5.13; required): reads only below the interpreter's standard library and
   the system's software directories (``/usr``, ``/lib*``, ``/bin``), reads and writes only below
   the working directory and a few ``/dev`` nodes. Rules apply to resolved paths, so symlinks do not
   lead out. ABI >= 4 also refuses TCP bind/connect; ABI >= 6 refuses signals to processes outside
   the sandbox and abstract unix sockets.
4. **Resource limits**: address space (memory), CPU seconds, file size, open files, process count,
   no core dumps.
5. **A seccomp filter** (``no_new_privs`` first): ``socket`` (every address family), ``fork``,
   ``vfork``, ``clone`` without ``CLONE_THREAD`` (new processes), ``clone3``, ``io_uring``, ``ptrace``,
   ``process_vm_readv/writev``, ``unshare``/``setns``/``mount`` and signals to any other process
   fail with an error; threads still work. With no new processes, the sandbox is exactly one
   process: killing it ends everything it started.

``{"probe": true}`` in the config sets everything up and prints which layers are active instead of
running code. The code's final expression, if any, is printed like an interactive session would.
"""

from __future__ import annotations

import ast
import ctypes
import errno
import json
import os
import platform
import resource
import struct
import sys
import traceback

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.syscall.restype = ctypes.c_long
LIBC.unshare.argtypes = [ctypes.c_int]
LIBC.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
LIBC.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def _syscall(number: int, *args) -> int:
    """``syscall(2)`` with every integer argument passed as a full-width ``long``."""
    return LIBC.syscall(ctypes.c_long(number), *(ctypes.c_long(a) if isinstance(a, int) else a for a in args))


class SandboxSetupError(RuntimeError):
    """A confinement layer that must be there could not be set up."""


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise SandboxSetupError(f"{what}: {os.strerror(err)} (errno {err})")
    return result


# ---------------------------------------------------------------------------------- 1. namespaces

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x4000, 0x40000


def enter_namespaces(workdir: str, disk_mb: int) -> str:
    """New user + network + mount namespaces and a tmpfs working directory; what was set up ("none"
    where the kernel refuses unprivileged user namespaces: the other layers still apply). The
    working directory is the current directory afterwards."""
    uid, gid = os.getuid(), os.getgid()
    if LIBC.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS) != 0:
        os.chdir(workdir)
        return "none"
    try:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                           ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        _check(LIBC.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
        options = f"size={disk_mb}m,mode=0700,uid={uid},gid={gid}".encode()
        _check(LIBC.mount(b"tmpfs", workdir.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options), "mount tmpfs")
    except (OSError, SandboxSetupError):
        # no mounts in this user namespace (e.g. AppArmor's restriction of unprivileged user
        # namespaces): still a network namespace; the working directory stays the parent's
        os.chdir(workdir)
        return "user, network"
    os.chdir(workdir)  # the tmpfs now mounted over it
    return "user, network, mount (tmpfs working directory)"


# -------------------------------------------------------------------------------- 2. capabilities

LINUX_CAPABILITY_VERSION_3 = 0x20080522


def drop_capabilities() -> None:
    """Empty effective, permitted and inheritable sets: a process started as root keeps uid 0 (its
    files stay readable by their owner) but none of root's powers; with ``no_new_privs`` set later,
    no ``execve`` gives them back."""
    header = ctypes.create_string_buffer(struct.pack("Ii", LINUX_CAPABILITY_VERSION_3, 0), 8)
    data = ctypes.create_string_buffer(bytes(24), 24)  # two (effective, permitted, inheritable) triples
    _check(LIBC.capset(header, data), "capset")


# ------------------------------------------------------------------------------------ 3. landlock

SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_TRUNCATE, FS_IOCTL_DEV = 1 << 14, 1 << 15
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1
PR_SET_NO_NEW_PRIVS = 38


def landlock_abi() -> int:
    return _syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, LANDLOCK_CREATE_RULESET_VERSION)


def _fs_rights(abi: int) -> int:
    """Every file-system right this ABI knows (bits 0-12, REFER from 2, TRUNCATE from 3, IOCTL_DEV from 5)."""
    bits = 13 + (abi >= 2) + (abi >= 3) + (abi >= 5)
    return (1 << bits) - 1


def apply_landlock(read_paths: list[str], write_paths: list[str], device_paths: list[str]) -> int:
    abi = landlock_abi()
    if abi < 1:
        raise SandboxSetupError("Landlock is not available "
                                "(needs Linux >= 5.13 with landlock in its LSM list)")
    handled_fs = _fs_rights(abi)
    attr = struct.pack("Q", handled_fs)
    if abi >= 4:
        attr += struct.pack("Q", NET_BIND_TCP | NET_CONNECT_TCP)
    if abi >= 6:
        attr += struct.pack("Q", SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL)
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = _check(_syscall(SYS_LANDLOCK_CREATE_RULESET, buf, len(attr), 0),
                     "landlock_create_ruleset")
    file_rights = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | (FS_TRUNCATE if abi >= 3 else 0)
    read_only = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR

    def allow(path: str, rights: int) -> None:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return  # a path this system does not have
        try:
            if not os.path.isdir(path):
                rights &= file_rights
            rule = ctypes.create_string_buffer(struct.pack("=Qi", rights & handled_fs, fd), 12)
            _check(_syscall(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, rule, 0),
                   f"landlock_add_rule {path}")
        finally:
            os.close(fd)

    for path in read_paths:
        allow(path, read_only)
    for path in device_paths:
        allow(path, FS_READ_FILE | FS_WRITE_FILE)
    for path in write_paths:
        allow(path, handled_fs)
    _check(LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    _check(_syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")
    os.close(ruleset)
    return abi


# ------------------------------------------------------------------------------ 4. resource limits


def set_limits(memory_mb: int, cpu_s: int, file_mb: int, max_processes: int) -> None:
    mib = 1024 * 1024
    for limit, value in ((resource.RLIMIT_AS, memory_mb * mib), (resource.RLIMIT_FSIZE, file_mb * mib),
                         (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0),
                         (resource.RLIMIT_NPROC, max_processes)):
        resource.setrlimit(limit, (value, value))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))  # SIGXCPU, then SIGKILL a second later


# ------------------------------------------------------------------------------------- 5. seccomp

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
# syscall numbers per architecture (asm/unistd_64.h, asm-generic/unistd.h)
SYSCALLS = {
    "x86_64": {"socket": 41, "fork": 57, "vfork": 58, "clone": 56, "clone3": 435, "io_uring_setup": 425,
               "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "unshare": 272,
               "setns": 308, "mount": 165, "pidfd_open": 434, "pidfd_send_signal": 424, "tkill": 200,
               "kill": 62, "tgkill": 234, "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297},
    "aarch64": {"socket": 198, "clone": 220, "clone3": 435, "io_uring_setup": 425, "ptrace": 117,
                "process_vm_readv": 270, "process_vm_writev": 271, "unshare": 97, "setns": 268, "mount": 40,
                "pidfd_open": 434, "pidfd_send_signal": 424, "tkill": 130, "kill": 129, "tgkill": 131,
                "rt_sigqueueinfo": 138, "rt_tgsigqueueinfo": 240},
}
DENIED = ("socket", "fork", "vfork", "io_uring_setup", "ptrace", "process_vm_readv", "process_vm_writev",
          "unshare", "setns", "mount", "pidfd_open", "pidfd_send_signal", "tkill")
OWN_PID_ONLY = ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")  # first argument: the target
CLONE_THREAD = 0x00010000
RET_ALLOW, RET_KILL_PROCESS, RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
LD_W_ABS, JEQ_K, JGE_K, JSET_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2


def seccomp_program(machine: str, own_pid: int) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions over ``struct seccomp_data`` (nr at offset 0,
    arch at 4, the low half of args[0] at 16)."""
    numbers = SYSCALLS[machine]
    eperm, enosys = RET_ERRNO | errno.EPERM, RET_ERRNO | errno.ENOSYS
    prog = [(LD_W_ABS, 0, 0, 4), (JEQ_K, 1, 0, AUDIT_ARCH[machine]), (RET_K, 0, 0, RET_KILL_PROCESS),
            (LD_W_ABS, 0, 0, 0)]
    if machine == "x86_64":  # the x32 ABI would bypass every number below
        prog += [(JGE_K, 0, 1, 0x40000000), (RET_K, 0, 0, eperm)]
    for name in DENIED:
        if name in numbers:
            prog += [(JEQ_K, 0, 1, numbers[name]), (RET_K, 0, 0, eperm)]
    prog += [(JEQ_K, 0, 1, numbers["clone3"]), (RET_K, 0, 0, enosys)]  # libc falls back to clone
    # clone: threads (CLONE_THREAD set) pass, new processes do not
    prog += [(JEQ_K, 0, 4, numbers["clone"]), (LD_W_ABS, 0, 0, 16), (JSET_K, 1, 0, CLONE_THREAD),
             (RET_K, 0, 0, eperm), (RET_K, 0, 0, RET_ALLOW)]
    # signals: only to this process itself
    for name in OWN_PID_ONLY:
        prog += [(JEQ_K, 0, 4, numbers[name]), (LD_W_ABS, 0, 0, 16), (JEQ_K, 1, 0, own_pid),
                 (RET_K, 0, 0, eperm), (RET_K, 0, 0, RET_ALLOW)]
    return prog + [(RET_K, 0, 0, RET_ALLOW)]


def apply_seccomp() -> None:
    machine = platform.machine()
    if machine not in SYSCALLS:
        raise SandboxSetupError(f"no seccomp filter for architecture {machine!r}")
    prog = seccomp_program(machine, os.getpid())
    filters = b"".join(struct.pack("HBBI", *insn) for insn in prog)
    buf = ctypes.create_string_buffer(filters, len(filters))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(prog), ctypes.addressof(buf))
    _check(LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    _check(LIBC.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0), "seccomp filter")


# ------------------------------------------------------------------------------------- the code


def confine(config: dict) -> dict:
    layers = {"uid": os.getuid()}
    workdir = config["workdir"]
    if config["namespaces"]:
        layers["namespaces"] = enter_namespaces(workdir, config["disk_mb"])
    else:
        os.chdir(workdir)
        layers["namespaces"] = "none"
    drop_capabilities()
    layers["capabilities"] = "none"
    layers["landlock_abi"] = apply_landlock(config["read_paths"], [workdir], config["device_paths"])
    set_limits(config["memory_mb"], config["cpu_s"], config["disk_mb"], config["max_processes"])
    apply_seccomp()
    layers["seccomp"] = "on"
    return layers


def run(code: str) -> int:
    """Execute ``code`` as ``__main__``; print the value of a final expression; on an exception,
    print its traceback (only the code's own frames) and return 1."""
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        tree = ast.parse(code, "<python>", "exec")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, "<python>", "exec"), namespace)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<python>", "eval"), namespace)
            if value is not None:
                print(repr(value))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the model
        sys.stdout.flush()
        tb = traceback.TracebackException.from_exception(exc)
        tb.stack = traceback.StackSummary.from_list([f for f in tb.stack if f.filename == "<python>"])
        tb.__cause__ = tb.__context__ = None  # library frames of chained exceptions say little
        sys.stderr.write("".join(tb.format()))
        return 1
    return 0


def main() -> int:
    config = json.loads(sys.argv[1])
    code = sys.stdin.buffer.read().decode("utf-8", "replace")
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    try:
        layers = confine(config)
    except (SandboxSetupError, OSError) as exc:
        sys.stderr.write(f"sandbox setup failed: {exc}\n")
        return 125
    if config.get("probe"):
        import fractions  # noqa: F401 - the standard library is still importable once confined

        print(json.dumps(layers))
        return 0
    status = run(code)
    sys.stdout.flush()
    sys.stderr.flush()
    return status


if __name__ == "__main__":
    sys.exit(main())
