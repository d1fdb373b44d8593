"""When waiting requests join the batch (continuous batching): at once, or once the slots left idle have cost
what another prefill forward would.

A prefill forward has a fixed cost beside its tokens', and every row in flight waits through it. On a GPU the
eager forward is bound by its launches (a few milliseconds for a 1B model: about as long as one or two replayed
decode passes of 64 rows), so admitting each request the moment one slot frees pays that cost once per finished
row, each time stalling every row in flight. Leaving a slot idle costs too: a row's share of every pass. The
two are weighed as rent or buy: the idle slots' seconds since the last admission (rent) against the forward's fixed
cost times the rows it stalls (buy). Requests join once the rent reaches the buy: the break-even rule of ski
rental, which for one such wait costs at most twice the best choice known in hindsight. Where the fixed cost is
not measured (a CPU, where a forward costs about its tokens) requests join at once."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Admission:
    fixed_s: float = 0.0  # a prefill forward's fixed cost, seconds (0: requests join at once)
    idle_s: float = 0.0  # slot-seconds left idle since requests last joined

    def passed(self, free: int, seconds: float) -> None:
        """A decode pass of `seconds` ran with `free` slots idle."""
        self.idle_s += max(free, 0) * seconds

    def due(self, rows: int) -> bool:
        """Whether waiting requests join now, beside `rows` rows in flight (none: at once)."""
        return rows == 0 or self.idle_s >= self.fixed_s * rows

    def joined(self) -> None:
        """Requests joined: the idle slots' rent starts again."""
        self.idle_s = 0.0
