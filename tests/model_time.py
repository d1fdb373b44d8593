"""A fake clock for the engine's timings (tests of block_complexity=auto's decisions on the engine).

`auto` measures each pass (its wall seconds and the model's) and decides from those measurements; under the real
clock its decisions then depend on how busy the machine is, and a test asserting on them would too. Inside
`model_time` the engine's clocks read a clock that only the model's calls advance, by a cost the test chooses
per forward: the decisions are the same on any machine."""
from __future__ import annotations

import contextlib
import types
from typing import Callable, Iterator

import pytest

# seconds of one forward: (batch rows, tokens per row, whether it is a prefill forward) -> seconds
ForwardCost = Callable[[int, int, bool], float]


@contextlib.contextmanager
def model_time(cost: ForwardCost) -> Iterator[None]:
    from esp_worker import stats
    from esp_worker.model import runner as runner_module
    from esp_worker.model.runner import ModelClock, ModelRunner

    clock = [0.0]
    cost_now = [0.0]
    fake_time = types.SimpleNamespace(perf_counter=lambda: clock[0])
    forward, stop = ModelRunner.forward, ModelClock.stop

    def timed_forward(self, inputs_embeds, *a, **kw):
        # the prefill passes `keep` (the positions whose logits it wants); a decode forward does not
        cost_now[0] = cost(inputs_embeds.shape[0], inputs_embeds.shape[1], kw.get("keep") is not None)
        return forward(self, inputs_embeds, *a, **kw)

    def timed_stop(self, mark):  # the end of a model call's timed region: the model's time passes
        clock[0] += cost_now[0]
        cost_now[0] = 0.0
        return stop(self, mark)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner_module, "time", fake_time)
        mp.setattr(stats, "time", fake_time)
        mp.setattr(ModelRunner, "forward", timed_forward)
        mp.setattr(ModelClock, "stop", timed_stop)
        yield
