"""RequestFeed: requests added from another thread while the loop runs; the batch stays full."""
from __future__ import annotations

import threading
import time

from esp_worker import Engine, EngineConfig, GenerationParams, Request
from esp_worker.feed import RequestFeed

from engine_helpers import PROMPTS, reference, tiny


def test_feed_from_another_thread_matches_generate_and_fills_the_batch():
    lm = tiny("llama")
    eng = Engine(lm, EngineConfig(method="esp", block_complexity=10, max_batch_size=4))
    params = GenerationParams(max_new_tokens=64)
    feed = RequestFeed()
    outs = {}

    def loop() -> None:
        for out in eng.generate_iter(feed):
            outs[out.id] = out.token_ids

    thread = threading.Thread(target=loop)
    thread.start()
    time.sleep(0.2)  # the loop waits on an empty feed without spinning or ending
    assert thread.is_alive() and not outs
    # two producers, two prompts each, arriving at different times
    feed.put([Request(id=f"a{i}", prompt=p, params=params) for i, p in enumerate(PROMPTS[:2])])
    feed.put([Request(id=f"b{i}", prompt=p, params=params) for i, p in enumerate(PROMPTS[2:], 2)])
    feed.close()
    thread.join(timeout=600)
    assert not thread.is_alive()
    ref = reference("llama", "sdpa")
    got = {int(k[1:]): tuple(v) for k, v in outs.items()}
    assert got == dict(enumerate(ref))
    assert max(eng.stats.batch_histogram) == 4  # all four rows decoded together


def test_iterable_input_reads_lazily_and_counts_batch_sizes():
    lm = tiny("llama")
    eng = Engine(lm, EngineConfig(method="ar", max_batch_size=2))
    params = GenerationParams(max_new_tokens=8)
    pulled = []

    def reqs():
        for i, p in enumerate(PROMPTS):
            pulled.append(i)
            yield Request(id=str(i), prompt=p, params=params)

    it = eng.generate_iter(reqs())
    next(it)
    assert len(pulled) == 2  # only as many as the batch holds
    rest = list(it)
    assert len(rest) == 3
    assert set(eng.stats.batch_histogram) <= {1, 2} and eng.stats.batch_histogram[2] > 0
