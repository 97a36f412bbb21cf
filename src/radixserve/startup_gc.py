"""The garbage collector around a process's start and exit.

A radixserve process starts by importing torch, transformers and the server stack and building
a model: hundreds of thousands of long-lived objects, none of them garbage. The collector's
full passes over that growing heap cost about a fifth of each process's start-up CPU (about
0.6 s of 3 on two cores), and at exit the interpreter's final collections walk it again
(seconds). So:

- ``pause``: no collection while a process starts (the entry module calls it first thing);
- ``freeze_and_resume``: once ready, move everything alive into the permanent generation and
  collect again as usual. Later passes skip the frozen start-up heap, so serving pays only for
  its own short-lived objects (SGLang freezes its processes' heaps after warm-up for the same
  reason); the interpreter's exit skips it too.

Nothing here is required for correctness: a process that never calls ``pause`` just collects.
"""

from __future__ import annotations

import gc


def pause() -> None:
    """Stop collecting until ``freeze_and_resume`` (called by the process's entry module)."""
    gc.disable()


def freeze_and_resume() -> None:
    """Freeze what is alive now and collect again from here on."""
    gc.freeze()
    gc.enable()
