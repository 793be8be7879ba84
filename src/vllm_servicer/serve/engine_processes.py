"""The launcher's engine processes: apart from its stop signals, gone with it.

systemd's default stop (KillMode=control-group) and Ctrl-C in a terminal signal
every process of the launcher's group. vLLM's EngineCore and worker processes
install SIGTERM/SIGINT handlers of their own (so a disposition inherited from
the launcher is undone) and stop at once, failing every stream the launcher is
draining. Started in a process group of their own, the engine's processes see
no signal sent to the launcher's group or terminal; the launcher drains and then
shuts the engine down itself. A parent-death signal ends them if the launcher
dies without doing so.

A group, not a session: Linux's autogroup scheduler shares the CPU fairly
between sessions, so an engine in a session of its own (busy stepping and
spinning on its workers) took nearly all of a loaded machine's CPU from the
launcher, whose streams then stalled for tens of seconds.

vLLM starts EngineCore with multiprocessing's spawn method (always on CPU; on
GPU hosts once CUDA is initialized), and the switch goes through the spawn
executable, as vLLM's own NUMA binding does. EngineCore's workers are its own
children and follow it (process group, and a death pipe to EngineCore). Linux only.
systemd's control-group stop signals by cgroup, not by process group: use
`KillMode=mixed` there (see docs/deployment.md).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.spawn
import os
import shlex
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger("vllm_servicer.serve")

# Runs in the new process before it becomes the engine process (same pid):
# new process group, SIGKILL when the launcher's thread that started it ends (it is
# the main thread), and a check that the launcher did not end before that.
_START = (
    "import ctypes, os, sys\n"
    "os.setpgid(0, 0)\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL\n"
    "if os.getppid() != {launcher}:\n"
    "    sys.exit(1)\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n"
)


@contextlib.contextmanager
def apart_from_stop_signals() -> Iterator[None]:
    """Engine processes spawned inside this block get a process group of their own."""
    if sys.platform != "linux":
        yield
        return
    python = os.fsdecode(multiprocessing.spawn.get_executable())
    start = _START.format(launcher=os.getpid())
    with tempfile.TemporaryDirectory(prefix="vllm-servicer-") as folder:
        shim = Path(folder) / "python"
        shim.write_text(f'#!/bin/sh\nexec {shlex.quote(python)} -S -c {shlex.quote(start)} "$@"\n')
        shim.chmod(0o700)
        multiprocessing.spawn.set_executable(str(shim))
        try:
            yield
        finally:
            multiprocessing.spawn.set_executable(python)
    for child in multiprocessing.active_children():
        if child.pid is not None and os.getpgid(child.pid) == os.getpgid(0):
            logger.warning(
                "engine process %s shares the launcher's process group (not spawned?): a stop "
                "signal to the whole process group will stop it before the drain ends",
                child.name,
            )


def exit_now() -> None:
    """End the process at once, killing the engine processes it started first."""
    for child in multiprocessing.active_children():
        if child.pid is not None:
            with contextlib.suppress(OSError):
                os.kill(child.pid, signal.SIGKILL)
    os._exit(1)
