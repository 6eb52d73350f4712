"""`freeze_startup_heap`: start-up garbage is collected before the freeze, live objects are frozen
and still freed by reference counting. Run in a subprocess: a freeze is for the whole process."""

import subprocess
import sys

PROBE = """
import gc, weakref
from torch_runner.gc_heap import freeze_startup_heap

class Node:
    pass

cycle = Node(); cycle.self = cycle; dead = weakref.ref(cycle); del cycle  # garbage, in a cycle
kept = Node(); alive = weakref.ref(kept)
before = len(gc.get_objects())
frozen = freeze_startup_heap()
assert dead() is None, "the garbage cycle was frozen instead of collected"
assert gc.get_freeze_count() == frozen > before * 0.9, (frozen, before)  # minus the garbage
assert len(gc.get_objects()) < 50  # the collector no longer walks them
del kept
assert alive() is None  # frozen, yet freed by reference counting
print("ok", frozen)
"""


def test_freeze_collects_garbage_first_and_freezes_the_rest():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok ")
