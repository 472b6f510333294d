"""Private streams of the process-global RNGs, for third-party environments that use them.

GEM and textarena draw from (and re-seed) the global ``random`` and ``numpy.random`` state. Called
as is, concurrent episodes would interleave on one stream (so a task would depend on scheduling)
and every call would disturb whatever else in the process relies on the global state.
:class:`PrivateGlobalRng` gives each episode its own saved copy of both states: inside
``with rng.active():`` the globals hold the episode's stream, and on exit the episode's stream is
saved and the caller's state restored. Calls must not ``await`` inside the block.
"""

from __future__ import annotations

import math
import numbers
import random
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np


class PrivateGlobalRng:
    """The global ``random``/``numpy.random`` states of one episode (seeded with ``seed``)."""

    def __init__(self, seed: int | None = None):
        self._py: Any = None
        self._np: Any = None
        if seed is not None:
            self.seed(seed)

    def seed(self, seed: int) -> None:
        self._py = random.Random(seed).getstate()
        self._np = np.random.RandomState(seed % 2**32).get_state()

    @contextmanager
    def active(self) -> Iterator[None]:
        outer_py, outer_np = random.getstate(), np.random.get_state()
        if self._py is not None:
            random.setstate(self._py)
        if self._np is not None:
            np.random.set_state(self._np)
        try:
            yield
        finally:
            self._py, self._np = random.getstate(), np.random.get_state()
            random.setstate(outer_py)
            np.random.set_state(outer_np)


def as_reward(value: Any) -> float | None:
    """``value`` as a finite float if it is a real number (``bool``, ``int``, ``float``, numpy
    scalars), else ``None``; strings are not numbers, even numeric-looking ones."""
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value.item()
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None
    return None
