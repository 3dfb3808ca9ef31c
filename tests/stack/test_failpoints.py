"""stack.failpoints: a kill lands on the named hit, and with `&` on whichever term is met last."""

import os
import subprocess
import sys

import pytest

# a main loop at "step" and a background "commit" that is reached at the step given in argv[1]
SCRIPT = """
import sys, threading
from stack.failpoints import fail_point
commit_at = int(sys.argv[1])
for step in range(1, 6):
    print("step", step, flush=True)
    fail_point("step")
    if step == commit_at:
        worker = threading.Thread(target=lambda: (print("commit", flush=True), fail_point("commit")))
        worker.start()
        worker.join()
print("done", flush=True)
"""


def run(wanted: str | None, commit_at: int) -> tuple[int, list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "STACK_FAIL_POINT"}
    if wanted:
        env["STACK_FAIL_POINT"] = wanted
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(commit_at)], env=env, capture_output=True, text=True,
                          timeout=60)
    return done.returncode, done.stdout.split("\n")[:-1]


def test_unset_or_another_name_never_kills():
    assert run(None, 2) == (0, ["step 1", "step 2", "commit", "step 3", "step 4", "step 5", "done"])
    assert run("elsewhere:1", 2)[0] == 0


def test_the_nth_hit_kills():
    assert run("step:3", 1) == (-9, ["step 1", "commit", "step 2", "step 3"])


@pytest.mark.parametrize("commit_at, last_line", [
    (1, "step 3"),   # the commit came first: killed at the third step, as if it were not named
    (4, "commit"),   # the third step came first: killed at the commit, in the thread that reached it
])
def test_joined_terms_kill_at_whichever_is_met_last(commit_at, last_line):
    rc, lines = run("step:3&commit:1", commit_at)
    assert rc == -9
    assert lines[-1] == last_line
