#!/usr/bin/env bash
# One GPU session's checks in one command, ordered by value, each stage bounded by a shared deadline so the
# whole run ends (and packs its results) before the device call's limit:
#   bash scripts/gpu_session.sh OUTDIR [SECONDS]
# Stages: env (versions), the gpu-marked tests and the sliding-window test, the 1B shape at batch 1 (hf, ar,
# esp auto, hybrid auto: the default re-measured after its policy fix), engine.compile=true at batch 1, the
# 1B shape at batch 16 and 64, then bench.profile of hybrid BC 30 and auto if time is left. Everything lands in OUTDIR/results.tgz
# (re-packed after each stage; WORK names the folder the runs write in) and OUTDIR/session.log.
# Before the call: `python scripts/gpu_data.py` writes the prompt files into gpu_data/ (carry it, and the wheels of
# what the machine lacks in .whl/; see docs/benchmarks.md, "On a GPU").
# STAGES picks stages (default all; env always runs), B1_PROMPTS the batch-1 prompt file (default prompts8).
# Dry run on a CPU: DEV=cpu SHAPE=tiny-random-llama DTYPE=float32 NEW=8 bash scripts/gpu_session.sh /tmp/gs 300
set -uo pipefail
out=$1; budget=${2:-540}
work=${WORK:-$(mktemp -d)}  # outside OUTDIR: a device call brings back only a few files
mkdir -p "$out" "$work"
end=$(( $(date +%s) + budget ))
P=${PROMPTS_DIR:-gpu_data}; DEV=${DEV:-cuda}; SHAPE=${SHAPE:-random:llama-1b}; DTYPE=${DTYPE:-bfloat16}; NEW=${NEW:-64}
export PYTHONUNBUFFERED=1 P DEV SHAPE DTYPE NEW work
log="$out/session.log"
left() { echo $(( end - $(date +%s) )); }
pack() { tar czf "$out/results.tgz" -C "$work" . 2>/dev/null; }
stage() {  # stage NAME MAX_SECONDS CMD...: runs CMD with min(MAX, time left - 15 s) as its limit
  local name=$1 max=$2; shift 2
  if [[ $name != env && " ${STAGES:-env gpu_tests sliding b1 b16_b64 compile profile} " != *" $name "* ]]; then return; fi
  local t; t=$(left); t=$(( t - 15 < max ? t - 15 : max ))
  if (( t < 30 )); then echo "== $name: skipped, $(left) s left" | tee -a "$log"; return; fi
  echo "== $name (limit $t s, $(left) s left) $(date +%T)" | tee -a "$log"
  local t0; t0=$(date +%s)
  timeout "$t" bash -c "$(declare -f bench pytest_q); \"\$@\"" _ "$@" 2>&1 | grep -v -e Warning -e warnings.warn | tee -a "$log" | tail -40
  echo "== $name: rc ${PIPESTATUS[0]} in $(( $(date +%s) - t0 )) s" | tee -a "$log"
  pack
}
bench() {  # bench LABEL overrides...: jobs.bench on the session's model and device
  local label=$1; shift
  python3 -m jobs.bench model.name_or_path=$SHAPE model.device=$DEV model.dtype=$DTYPE generation.ignore_eos=true \
    generation.max_new_tokens=$NEW bench.num_masks=[1] bench.trees=[static] bench.repeats=3 bench.warmup=1 \
    bench.warmup_rounds=${WARMUP_ROUNDS:-1} \
    output.dir="$work/$label" "$@"
}
pytest_q() { python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE "$@"; }

stage env 60 bash -c "nvidia-smi -L 2>/dev/null; python3 -c 'import torch, transformers, omegaconf, pyarrow; \
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name(0), \
\"transformers\", transformers.__version__, \"omegaconf\", omegaconf.__version__)'"
if [[ $DEV == cuda ]]; then
  stage gpu_tests 150 pytest_q -m gpu tests/test_engine.py tests/test_host_sync.py
  stage sliding 60 pytest_q tests/test_lossless.py -k sliding
fi
stage b1 ${B1_T:-130} bench b1 data.path=$P/${B1_PROMPTS:-prompts8}.jsonl 'bench.settings=[esp:auto,hybrid:auto]' bench.cost_curve=false
stage compile ${COMPILE_T:-170} bench compile data.path=$P/${B1_PROMPTS:-prompts8}.jsonl engine.compile=true 'bench.settings=[esp:30,hybrid:auto]' \
  bench.hf_baseline=false bench.cost_curve=false
stage b16_b64 ${B16_T:-120} bench b16-b64 data.path=$P/prompts64.jsonl 'bench.settings=[esp:auto,hybrid:auto]' \
  'bench.batch_sizes=[16,64]' bench.cost_curve=false
stage profile 90 bench profile data.path=$P/prompts8.jsonl 'bench.settings=[hybrid:30,hybrid:auto]' bench.repeats=1 \
  bench.hf_baseline=false bench.cost_curve=false 'bench.profile=[hybrid:30,hybrid:auto]'
echo "== done, $(left) s left" | tee -a "$log"
pack
