"""Named fail points: let a test kill the process at an exact step of a long operation.

Kill tests (SIGKILL at "while shards are written", "right before the bundle is swapped in")
must hit the same instant every time; sleeping and hoping does not. As in etcd's gofail and
FreeBSD's fail(9), the code marks the points where a crash matters with `fail_point(name)`,
and a test sets `STACK_FAIL_POINT=<name>` (optionally `<name>:<n>` for the n-th time the
point is reached, counting from 1) in the environment of the process it starts. Unset, a
fail point is one dictionary lookup.

Several terms joined by `&` (`train-step:7&checkpoint-committed:1`) kill at whichever of them
is reached last, in whichever thread reaches it: "at step 7, and not before the background
writer has committed its first checkpoint". A kill that must follow an event of another
thread is then as exact as one that does not; the bare `train-step:7` would race the writer.
"""

from __future__ import annotations

import os
import signal
import threading

ENV = "STACK_FAIL_POINT"
_hits: dict[str, int] = {}
_lock = threading.Lock()


def _terms(wanted: str) -> dict[str, int]:
    """`a:2&b` -> {"a": 2, "b": 1}: each named point and the hit it waits for."""
    terms = {}
    for term in wanted.split("&"):
        point, _, nth = term.strip().partition(":")
        terms[point] = int(nth or 1)
    return terms


def fail_point(name: str) -> None:
    """SIGKILL this process here when `STACK_FAIL_POINT` names this point and every term is now met."""
    wanted = os.environ.get(ENV)
    if not wanted:
        return
    terms = _terms(wanted)
    if name not in terms:
        return
    with _lock:
        _hits[name] = _hits.get(name, 0) + 1
        met = _hits[name] == terms[name] and all(_hits.get(p, 0) >= n for p, n in terms.items())
    if met:
        os.kill(os.getpid(), signal.SIGKILL)
