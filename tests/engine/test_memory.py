"""A KV cache sized past the device's memory is refused as one line before it is allocated (on a CPU such an
allocation got the process killed by the kernel with no message)."""
import pytest
import torch

from engine_helpers import ARCHS, run, tiny
from esp_worker import EngineConfig, GenerationParams
from esp_worker import kv_cache
from esp_worker.memory import MemoryShortError, free_bytes, kv_bytes_per_slot

# rows no machine holds at any context: 10^7 rows of the tiny models' hundreds of positions are terabytes
ABSURD = 10 ** 7


@pytest.mark.parametrize("arch", ARCHS)
def test_bytes_per_slot_are_the_pinned_slabs(arch):
    lm = tiny(arch)
    text = lm.model.config.get_text_config()
    attn = lm.model.model.layers[0].self_attn
    cache = kv_cache.new_cache(text.num_hidden_layers)
    cache.pin(3, 5, text.num_key_value_heads, attn.head_dim, torch.float32, torch.device("cpu"))
    assert kv_bytes_per_slot(text, torch.float32) * 3 * 5 == cache.slab.numel() * cache.slab.element_size()
    assert kv_bytes_per_slot(text, torch.bfloat16) * 2 == kv_bytes_per_slot(text, torch.float32)


def test_a_cpu_reports_what_it_has_free():
    free = free_bytes(torch.device("cpu"))
    assert free is not None and 0 < free


@pytest.mark.parametrize("cfg, allocation", [
    (EngineConfig(method="hybrid", max_batch_size=ABSURD), "the auto policy's calibration"),
    (EngineConfig(method="ar", cuda_graphs=True, max_batch_size=ABSURD), "the KV slab pinned for engine.cuda_graphs"),
])
def test_a_batch_past_the_devices_memory_is_one_line_before_it_is_allocated(cfg, allocation):
    with pytest.raises(MemoryShortError) as err:
        run(tiny("llama"), cfg, GenerationParams(max_new_tokens=4))
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"engine.max_batch_size={ABSURD}: {allocation} ({ABSURD} rows of ")
    assert "GiB free; lower engine.max_batch_size" in line
    assert isinstance(err.value, ValueError)  # a configuration's error: the job's one-line exit
