"""Loading in the background: an engine process that starts beside busy ones (a second model
loaded on demand on the same cores) runs its start at Linux's SCHED_IDLE priority, which gets a
core only when no normal thread wants it, so the streams of the engines already serving keep
their pace while it imports torch, maps and packs its weights and warms up. Once ready it
returns every one of its threads (OpenMP's included, which inherited the policy) to the normal
policy, unless its model is configured to serve in the background (a models file's `priority:
background`, EngineConfig.serve_in_background): then it stays at SCHED_IDLE and answers in the
gaps the other engines leave. Leaving SCHED_IDLE needs CAP_SYS_NICE or an RLIMIT_NICE of 20
(systemd's LimitNICE=); without either the engine stays at idle priority, served only when the
cores are free, and says so once."""
from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def start_in_background() -> bool:
    """This process, and the threads it starts from now on, at idle priority; False where the
    OS has no SCHED_IDLE (then it starts as any process)."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError as exc:
        logger.info("the engine starts at normal priority (no SCHED_IDLE: %s)", exc)
        return False
    return True


def serve_in_foreground() -> None:
    """Every thread of this process back to the normal policy."""
    refused = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
        except ProcessLookupError:
            pass  # the thread has ended
        except PermissionError:
            refused += 1
    if refused:
        logger.warning("the engine stays at idle CPU priority, served only when the cores are free: leaving "
                       "SCHED_IDLE needs CAP_SYS_NICE or RLIMIT_NICE >= 20 (systemd: LimitNICE=20)")
