"""Running a model's Python code without letting it touch the trainer: :func:`run_python`.

Each call starts a fresh interpreter (``python -I -S -B``, standard library only) in a new empty
temporary directory, with a minimal environment (no API keys) and the code on stdin. Before the code
runs, the child confines itself (:mod:`polyrl.envs.sandbox_child` has the details): no capabilities, user +
network + mount namespaces where the kernel allows them, Landlock (file-system access only to the
standard library, system software and its own directory; required), resource limits (memory, CPU,
file size, processes) and a seccomp filter (no sockets, no new processes, no signals or tracing
of other processes). Here, the parent enforces the wall time and the output cap and removes the
directory.

What it does not stop: reading world-readable system software under ``/usr`` and ``/lib``; using
the CPU and memory it is given for the time it is given; threads. Without user namespaces (some
hardened kernels), the working directory is not size-capped (files are, by ``disk_mb`` each) and the
network is refused by seccomp and Landlock rather than by an empty network namespace.

Everything that goes wrong comes back as a :class:`SandboxResult` (timeouts, kills, crashes, huge
output); nothing raises into the caller except :class:`SandboxUnavailable` when this machine cannot
confine code at all.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

CHILD = Path(__file__).with_name("sandbox_child.py")
SETUP_FAILED = 125  # the child's exit status when it could not confine itself
MAX_CODE_BYTES = 32_768  # below a pipe buffer, so writing the code never blocks
SYSTEM_READ_PATHS = ("/usr", "/lib", "/lib64", "/lib32")
DEVICE_PATHS = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")


class SandboxUnavailable(RuntimeError):
    """This machine cannot confine code (no Landlock, no seccomp); the reason is the message."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-call limits."""

    timeout_s: float = 5.0  # wall time, enforced by the parent
    memory_mb: int = 256  # address space (RLIMIT_AS)
    max_output_bytes: int = 4096  # stdout and stderr together; more ends the run
    disk_mb: int = 16  # the largest file, and the tmpfs working directory where namespaces allow
    max_processes: int = 8  # RLIMIT_NPROC; new processes are refused by seccomp anyway

    @property
    def cpu_s(self) -> int:
        """RLIMIT_CPU: a backstop a second past the wall time, so that a busy loop on an idle machine
        (CPU time = wall time) is ended by the wall-time limit, with its clearer message."""
        return max(1, int(self.timeout_s + 0.999) + 1)


@dataclass
class SandboxResult:
    output: str
    exit_code: int | None  # None when the parent killed it (timeout or output cap)
    timed_out: bool = False
    output_truncated: bool = False
    killed_by: str | None = None  # the signal that ended it, e.g. "SIGKILL" (memory, CPU limit)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.output_truncated

    def error(self, limits: SandboxLimits) -> str | None:
        """A one-line reason the run failed, or None when it succeeded."""
        if self.timed_out:
            return f"timed out after {limits.timeout_s:g} s"
        if self.output_truncated:
            return f"output exceeded {limits.max_output_bytes} bytes (truncated)"
        if self.killed_by:
            hint = {"SIGXCPU": " (CPU time limit)", "SIGKILL": " (a resource limit)"}.get(self.killed_by, "")
            return f"killed by {self.killed_by}{hint}"
        if self.exit_code == SETUP_FAILED:
            return "the sandbox could not start"
        if self.exit_code:
            return f"exit status {self.exit_code}"
        return None


def _child_config(workdir: str, limits: SandboxLimits, probe: bool, namespaces: bool) -> dict:
    stdlib = {sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")}
    return {
        "workdir": workdir, "probe": probe, "namespaces": namespaces, "memory_mb": limits.memory_mb,
        "cpu_s": limits.cpu_s,
        "disk_mb": limits.disk_mb, "max_processes": limits.max_processes,
        "read_paths": sorted(p for p in stdlib if p) + list(SYSTEM_READ_PATHS),
        "device_paths": list(DEVICE_PATHS),
    }


def _environment(workdir: str) -> dict[str, str]:
    """Nothing from the trainer's environment (API keys stay out)."""
    return {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "PYTHONHASHSEED": "0"}


def _signal_name(status: int) -> str | None:
    if status >= 0:
        return None
    try:
        return signal.Signals(-status).name
    except ValueError:
        return f"signal {-status}"


def _run(code: str, limits: SandboxLimits, probe: bool = False, namespaces: bool = True) -> SandboxResult:
    data = code.encode("utf-8", "replace")
    if len(data) > MAX_CODE_BYTES:
        return SandboxResult(f"code longer than {MAX_CODE_BYTES} bytes", exit_code=2)
    workdir = tempfile.mkdtemp(prefix="polyrl-python-")
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", str(CHILD),
             json.dumps(_child_config(workdir, limits, probe, namespaces))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=workdir,
            env=_environment(workdir), start_new_session=True, close_fds=True,
        )
        try:
            proc.stdin.write(data)
            proc.stdin.close()
        except BrokenPipeError:
            pass
        output, timed_out, truncated = _read_capped(proc, limits)
        if timed_out or truncated:
            proc.kill()
        status = proc.wait()
        text = output[: limits.max_output_bytes].decode("utf-8", "replace")
        if timed_out or truncated:
            return SandboxResult(text, None, timed_out=timed_out, output_truncated=truncated)
        return SandboxResult(text, status if status >= 0 else None, killed_by=_signal_name(status))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _read_capped(proc: subprocess.Popen, limits: SandboxLimits) -> tuple[bytes, bool, bool]:
    """Everything the child writes until it closes its output, the deadline passes (timed out) or
    it writes more than the cap (truncated)."""
    deadline = time.monotonic() + limits.timeout_s
    chunks, size = [], 0
    fd = proc.stdout.fileno()
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return b"".join(chunks), True, False
            if not selector.select(remaining):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > limits.max_output_bytes:
                return b"".join(chunks), False, True
    proc.stdout.close()
    return b"".join(chunks), False, False


def run_python(code: str, limits: SandboxLimits | None = None, namespaces: bool = True) -> SandboxResult:
    """Run ``code`` confined (see the module docstring); blocking and thread-safe. ``namespaces=False``
    leaves out the namespace layer (as on kernels without unprivileged user namespaces)."""
    sandbox_layers()
    return _run(code, limits or SandboxLimits(), namespaces=namespaces)


_PROBE_LOCK = threading.Lock()
_PROBE: dict | SandboxUnavailable | None = None


def sandbox_layers() -> dict:
    """Which confinement layers this machine gives (probed once per process by starting a confined
    child); raises :class:`SandboxUnavailable` with the reason when it cannot confine code."""
    global _PROBE
    with _PROBE_LOCK:
        if _PROBE is None:
            _PROBE = _probe()
    if isinstance(_PROBE, SandboxUnavailable):
        raise _PROBE
    return dict(_PROBE)


def _probe() -> dict | SandboxUnavailable:
    if sys.platform != "linux":
        return SandboxUnavailable(f"the Python sandbox needs Linux (Landlock, seccomp), not {sys.platform}")
    result = _run("", SandboxLimits(timeout_s=30), probe=True)
    if not result.ok:
        lines = result.output.strip().splitlines()
        reason = lines[-1] if lines else result.error(SandboxLimits())
        return SandboxUnavailable(f"the Python sandbox cannot confine code on this machine: {reason}")
    try:
        return json.loads(result.output)
    except ValueError:
        return SandboxUnavailable(f"the Python sandbox probe printed {result.output[:200]!r}")
