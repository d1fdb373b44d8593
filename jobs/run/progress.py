"""Progress: rows done / total, tokens/s, running tau, time so far and, once rows finish, the time left at this run's
pace. One updating line on a terminal, plain periodic log lines otherwise (CI, `ray job submit` logs, files)."""
from __future__ import annotations

import logging
import sys
import time
from typing import Callable, Optional, TextIO

from .stats import Totals

log = logging.getLogger("esp_batch")


class Progress:
    def __init__(self, total_rows: Optional[int], interval_s: float, stream: TextIO = sys.stderr,
                 clock: Callable[[], float] = time.monotonic):
        self.total = total_rows
        self.done_before = 0  # rows of the parts an earlier run wrote that this run keeps (see `kept`)
        self.run = Totals()  # rows finished by this run
        self.clock = clock
        self.start = clock()
        self.stream = stream
        self.tty = stream.isatty()
        self.interval = 0.5 if self.tty else interval_s
        self.last = self.start

    def kept(self, rows: int) -> None:
        """A shard's part from an earlier run is kept (its input is unchanged): its rows count as done.
        Counted as the shards are read, so a part about to be regenerated or removed is never counted."""
        self.done_before += rows

    def restart(self) -> None:
        """Count time from now (the engines are ready): tokens/s excludes start-up."""
        self.start = self.last = self.clock()

    def line(self) -> str:
        done = self.done_before + self.run.rows
        total = "?" if self.total is None else str(self.total)
        pct = f" ({100 * done / self.total:.0f}%)" if self.total else ""
        elapsed = max(self.clock() - self.start, 1e-9)
        tau = "-" if self.run.tau is None else f"{self.run.tau:.2f}"
        text = (f"rows {done}/{total}{pct}, errors {self.run.errors}, "
                f"{self.run.generated_tokens / elapsed:.1f} tok/s, tau {tau}, {duration(elapsed)}")
        if self.total is not None and self.run.rows and done < self.total:
            # the rows this run finished set the pace (kept parts cost it nothing); a shard's rows arrive together
            text += f", ~{duration((self.total - done) * elapsed / self.run.rows)} left"
        return text

    def update(self, force: bool = False) -> None:
        now = self.clock()
        if not force and now - self.last < self.interval:
            return
        self.last = now
        if self.tty:
            self.stream.write("\r" + self.line() + "\033[K")
            self.stream.flush()
        else:
            log.info("progress: %s", self.line())

    def close(self) -> None:
        if self.tty:
            self.stream.write("\r" + self.line() + "\033[K\n")
            self.stream.flush()


def duration(seconds: float) -> str:
    """A duration as the progress line shows it: 42s, 12m05s, 3h07m."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
