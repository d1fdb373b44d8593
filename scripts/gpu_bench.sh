#!/usr/bin/env bash
# GPU checks and benchmarks (issue 11). Run from the repository root on a CUDA machine:
#   bash scripts/gpu_bench.sh tests|tiny|random1|randomN|compile1 OUTDIR
# tests  : the gpu-marked tests, then the CPU lossless suite (the machine's own torch build)
# tiny   : the trained esp-tiny-llama (float32) at batch 1: hf generate, ar, pld, esp, hybrid
# random1: random-weight Llama 1B shape in bf16, batch 1: hf generate, ar, esp, hybrid + cost curve Q = 1..128
# randomN: the same at batch 16 and 64 (120 prompts) + cost curves at those batch sizes
# compile1: random1's model at batch 1 and 16 with engine.compile=true (ar, esp auto, hybrid auto; hf eager)
# profile1: random1's model at batch 1: hybrid auto and BC 30 once each under torch.profiler (bench.profile)
# MODEL_DIR (default gpu_data/esp-tiny-llama) and PROMPTS_DIR (default gpu_data) hold the model and prompt
# files (tiny_prompts_dev.jsonl, prompts8/16.jsonl = 4/8 code + 4/8 verse of it, prompts120.jsonl = it twice).
# A machine without omegaconf: install the omegaconf and antlr4-python3-runtime wheels first and put the
# repository on PYTHONPATH. EXTRA adds bench overrides (e.g. EXTRA=bench.cost_curve=false); T is the time limit.
set -uo pipefail
stage=$1; out=$2
mkdir -p "$out"
P=${PROMPTS_DIR:-gpu_data}; M=${MODEL_DIR:-gpu_data/esp-tiny-llama}
export PYTHONUNBUFFERED=1
common="generation.max_new_tokens=64 bench.num_masks=[1] bench.trees=[static] bench.repeats=3 bench.warmup=1"
case $stage in
tests)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_engine.py tests/test_host_sync.py 2>&1 | tail -80 | tee "$out/gpu_tests.log"
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_lossless.py -k sliding 2>&1 | tail -60 | tee "$out/sliding_cpu.log"
  ;;
tiny)
  timeout 250 python3 -m jobs.bench model.name_or_path=$M model.device=cuda model.dtype=float32 data.path=$P/prompts16.jsonl \
    $common 'bench.methods=[ar,pld,esp,hybrid]' 'bench.block_complexities=[10,30,60,auto]' \
    bench.cost_max_block=128 output.dir="$out/tiny-b1" 2>&1 | grep -v Warning | tail -60
  ;;
random1)
  timeout ${T:-400} python3 -m jobs.bench model.name_or_path=random:llama-1b model.device=cuda model.dtype=bfloat16 \
    data.path=$P/prompts8.jsonl generation.ignore_eos=true $common ${EXTRA:-} 'bench.methods=[ar,esp,hybrid]' \
    'bench.block_complexities=[30,auto]' bench.cost_max_block=128 output.dir="$out/llama1b-b1" 2>&1 | grep -v Warning | tail -40
  ;;
randomN)
  timeout ${T:-500} python3 -m jobs.bench model.name_or_path=random:llama-1b model.device=cuda model.dtype=bfloat16 \
    data.path=$P/prompts120.jsonl generation.ignore_eos=true $common ${EXTRA:-} 'bench.methods=[ar,esp,hybrid]' \
    'bench.block_complexities=[30,auto]' 'bench.batch_sizes=[16,64]' bench.cost_max_block=128 \
    output.dir="$out/llama1b-b16-b64" 2>&1 | grep -v Warning | tail -40
  ;;
compile1)
  timeout ${T:-400} python3 -m jobs.bench model.name_or_path=random:llama-1b model.device=cuda model.dtype=bfloat16 \
    data.path=$P/prompts16.jsonl generation.ignore_eos=true $common ${EXTRA:-} engine.compile=true 'bench.methods=[ar,esp,hybrid]' \
    'bench.block_complexities=[auto]' 'bench.batch_sizes=[1,16]' bench.cost_curve=false \
    output.dir="$out/llama1b-compile" 2>&1 | grep -v Warning | tail -40
  ;;
profile1)
  timeout ${T:-300} python3 -m jobs.bench model.name_or_path=random:llama-1b model.device=cuda model.dtype=bfloat16 \
    data.path=$P/prompts8.jsonl generation.ignore_eos=true generation.max_new_tokens=64 ${EXTRA:-} \
    'bench.settings=[hybrid:30,hybrid:auto]' bench.repeats=1 bench.warmup=1 bench.cost_curve=false \
    'bench.profile=[hybrid:30,hybrid:auto]' output.dir="$out/llama1b-profile" 2>&1 | grep -v Warning | tail -20
  ;;
esac
