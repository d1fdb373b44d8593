"""RequestFeed: a thread-safe queue that keeps one `Engine.generate_iter` loop running while producers
add requests, so the engine's batch stays full across the producers' boundaries (shards, turns).

The engine takes what is queued without waiting while it has rows to decode, and waits only when its
batch is empty. `close()` ends the loop once every request taken has finished.

    feed = RequestFeed()
    threading.Thread(target=lambda: [handle(o) for o in engine.generate_iter(feed)]).start()
    feed.put([Request(...), ...])   # from any thread, any time
    feed.close()                    # no more requests: the loop ends when the batch drains
"""
from __future__ import annotations

import collections
import itertools
import threading
from typing import Iterable

from .types import Request


class RequestFeed:
    def __init__(self) -> None:
        self._queue: collections.deque[Request] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False

    def put(self, requests: Iterable[Request]) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("RequestFeed.put after close()")
            self._queue.extend(requests)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def take(self, n: int, wait: bool) -> tuple[list[Request], bool]:
        """(up to n queued requests, whether the feed is closed and empty). With `wait`, blocks until
        there is a request or the feed is closed."""
        with self._cond:
            if wait:
                self._cond.wait_for(lambda: self._queue or self._closed)
            taken = [self._queue.popleft() for _ in range(min(n, len(self._queue)))]
            return taken, self._closed and not self._queue

    def peek(self, n: int) -> list[Request]:
        """The next n queued requests (or fewer), left in the queue."""
        with self._cond:
            return list(itertools.islice(self._queue, max(n, 0)))

    def __len__(self) -> int:
        with self._cond:
            return len(self._queue)
