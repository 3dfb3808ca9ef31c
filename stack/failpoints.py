"""Named fail points: let a test kill the process at an exact step of a long operation.

Kill tests (SIGKILL at "while shards are written", "right before the bundle is swapped in")
must hit the same instant every time; sleeping and hoping does not. As in etcd's gofail and
FreeBSD's fail(9), the code marks the points where a crash matters with `fail_point(name)`,
and a test sets `STACK_FAIL_POINT=<name>` (optionally `<name>:<n>` for the n-th time the
point is reached, counting from 1) in the environment of the process it starts. Unset, a
fail point is one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "STACK_FAIL_POINT"
_hits: dict[str, int] = {}


def fail_point(name: str) -> None:
    """SIGKILL this process here when `STACK_FAIL_POINT` names this point (and this is the chosen hit)."""
    wanted = os.environ.get(ENV)
    if not wanted:
        return
    point, _, nth = wanted.partition(":")
    if point != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
