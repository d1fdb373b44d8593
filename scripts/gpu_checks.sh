#!/usr/bin/env bash
# Issue 40's checks on a GPU in one command under one deadline, each step's result in OUTDIR as soon as it is done.
#
#   bash scripts/gpu_checks.sh --prepare                   # here, once: gpu_data/ (prompts, esp-tiny-llama), .whl/
#   bash scripts/gpu_checks.sh OUTDIR [SECONDS]            # the device machine, repository root (default 570 s)
#   bash scripts/gpu_checks.sh --dry-run OUTDIR [SECONDS]  # a CPU: every step on tiny-random-llama, float32, 8 tokens
#
# The device call: run(command="bash scripts/gpu_checks.sh $OUT 570", carry=["gpu_data", ".whl"], timeout_s=600).
# What the machine needs: python3 with CUDA torch, transformers, pyarrow, pytest, matplotlib (its image has them) and
# omegaconf (it has not: --prepare downloads the omegaconf and antlr4-python3-runtime wheels into .whl/, which the
# env step installs into /tmp/site when omegaconf does not import). No network there; nothing else is fetched.
# A device call brings back at most 8 files: env.txt, gpu_tests.txt, ar.txt (ar64 and ar), methods.txt, tiny.txt,
# dmtd.txt, log.txt and results.tgz (every bench directory, re-packed after each step).
#
# Steps, in order of value; each gets min(its own limit, time left - 15 s) and is skipped with under 30 s left
# (own limits: env 60, gpu_tests 150, ar_best 280, ar 270, ar64 230, attn 60, ar_flex 200, ar_flex64 200, ar_tune 240, ar_attn 200,
# gpu_compiled 200, profile 120,
# profile64 120, tiny 145, methods64 150, methods 150, dmtd 120, admit 100, samples 150 s; at 570 s the later ones do not fit: pick
# with STEPS).
# The bench's engines at one batch size share one CUDA-graph runner, so captures are paid once
# per batch size, as in a job; each step still builds its model and warms every setting up once.
#   env        versions and what imports (torch with CUDA, transformers, omegaconf, pyarrow, pytest, matplotlib)
#   gpu_tests  pytest -m gpu tests/gpu tests/engine/test_host_sync.py (graph-vs-eager float32 equality on a
#              two-layer 1B-shape model, no synchronisation inside a replayed pass for every method, ...)
#              (-k "not compiled": the compiled tests, whose compiles take minutes, are step gpu_compiled)
#   ar         Llama-3.2-1B shape, random weights, bfloat16, 64 new tokens, ignore_eos, 1 warm-up round, 3
#              round-robin repeats, medians, batch 1 (prompts4): ar (replayed passes, run ahead: the next pass
#              launched before the last one's read) vs ar eager vs ar reading each pass at once
#              (engine.cuda_graphs_run_ahead=false) vs compiled graphs (engine.cuda_graphs_compile: Inductor's
#              kernels captured; compiled in the warm-up round), run ahead and not (the two compiled settings share
#              one runner: one compile) vs hf generate vs hf generate compiled
#   ar64       the same ar settings and hf generate at batch 64 (prompts128: 64 per category, as the bench runs
#              categories one at a time)
#   gpu_compiled  pytest -m gpu tests/gpu -k compiled: engine.cuda_graphs_compile gives the eager engine's tokens
#              in float32 on the two-layer 1B shape, with SDPA's and with FlexAttention's kernel (into gpu_tests.txt)
#   attn       scripts/attn_backends.py: the decode attention kernels (cudnn, efficient, math) at batch 1, 16, 64,
#              Q = 1, 8, 32 and 128 .. 2048 key slots, microseconds per call in a replayed graph
#   ar_best    the ar step's model at batch 1, the batch-1 target in one step: every lever at once (compiled graphs,
#              FlexAttention's decode kernel, autotuned products, run ahead) beside ar (replayed eager kernels) and ar
#              eager. Its rows fall in two capacity buckets (1024 and 2048 key slots): under flex each compiles apart,
#              with autotuning, in the warm-up round (compiled graphs alone: the ar step)
#   ar_flex    the ar step's model at batch 1: compiled graphs with engine.attention_backend=flex (FlexAttention over
#              a block mask of the rows' lengths, its decode kernel splitting the keys; each class compiles apart)
#              beside compiled graphs with torch's SDPA choice and ar eager
#   ar_flex64  the same at batch 64 (prompts128)
#   ar_tune    the ar step's model at batch 1: compiled graphs with engine.compile_mode=max-autotune-no-cudagraphs
#              (Inductor times its own matrix-product kernels against cuBLAS's at each shape; at batch 1 the
#              projections' products ran at about half the memory bandwidth) beside compiled graphs and ar eager
#   ar_attn    the ar step's model at batch 1 with engine.attention_backend=efficient and math beside torch's
#              choice (cuDNN's kernel on an H100/H200), eager kernels replayed and compiled
#   profile    op tables of one replayed ar prompt, eager kernels and compiled ones (kernels per pass, where a
#              pass's time goes), batch 1
#   profile64  op tables of replayed ar passes (eager kernels) at batch 64 over 64 prompts: where a full batch's
#              pass goes (weights, attention over the rows' keys, the rest)
#   tiny       esp-tiny-llama, float32, batch 1 (prompts16): ar, hf generate, pld BC 10, esp k1 BC 30, esp auto,
#              hybrid auto, hybrid BC 30, with tau (esp k1 BC 30 and hybrid auto also with the probe on the host:
#              host_probe, beside the default's probe in the replayed pass; pld BC 10, esp k1 BC 30, hybrid BC 30 and
#              hybrid auto also reading each pass before the next: no_run_ahead, beside drafting passes run ahead);
#              then op tables of ar, pld and hybrid under torch.profiler (where a drafting
#              pass's time goes once the forward is replayed)
#   methods    the 1B shape: esp k1 BC 30 and hybrid auto beside ar at batch 1 (prompts4; both also reading each pass:
#              no_run_ahead), 16 and 64,
#              each run with the cost curve of replayed passes (Q = 1..128; batch 1, then 16 and 64; prompts128)
#   dmtd       issue 41 on a GPU: the 1B shape split with D = 4 untrained (PLT against speed at tau 2, 3, 4, beside ar
#              eager: DMTD passes run eagerly), then the committed esp-tiny-llama DMTD model and its verified copy at
#              batch 1 and 8
#   methods64  esp k1 BC 30 and hybrid auto beside ar at batch 64 alone (no cost curve)
#   admit      esp-tiny-llama, float32, batch 16 over 64 prompts, each with its own max_new_tokens in 16-128
#              (bench.mixed_max_new_tokens: rows finish at different passes and waiting ones join):
#              engine.admission=auto (requests join once the idle slots have cost a prefill forward's fixed cost;
#              until then rows that ended stay in the batch while passes run ahead) beside eager_admission (at once:
#              each row that ends is read and retired at once), for ar and hybrid auto
#   samples    the 1B shape at batch 64: generation.n=8 at temperature 0.8 over prompts16 (64 requests per category),
#              ar and hybrid auto with the prefix store and without it (no_prefix_cache: each sample's prompt
#              prefilled whole), beside hf generate over the same copies
# STEPS picks steps (default all; env always runs); T_<STEP> overrides a step's own limit; GPU_TESTS_K the gpu_tests'
# pytest -k expression.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"

if [[ ${1:-} == --prepare ]]; then
  python3 scripts/gpu_data.py --out gpu_data
  src=${TINY_MODEL:-../shared/models/esp-tiny-llama}
  mkdir -p gpu_data/esp-tiny-llama && cp "$src"/*.json "$src"/*.safetensors gpu_data/esp-tiny-llama/
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl omegaconf==2.4.0 antlr4-python3-runtime==4.13.2
  du -sh gpu_data .whl
  exit 0
fi

dry=0
if [[ ${1:-} == --dry-run ]]; then dry=1; shift; fi
out=${1:?usage: gpu_checks.sh [--prepare | [--dry-run] OUTDIR [SECONDS]]}; budget=${2:-570}
mkdir -p "$out"; out=$(cd "$out" && pwd)
work=$(mktemp -d)  # bench output directories: packed into one file (a device call brings back few files)
end=$(( $(date +%s) + budget ))
if (( dry )); then  # the same steps and commands on a CPU, small and fast, the static-buffer path on (graphs: auto)
  DEV=cpu SHAPE=tiny-random-llama DTYPE=float32 NEW=8 TINY_NEW=8 TINY_PROMPTS=prompts4 GRAPHS=true DMTD_D=1 MIX=4,16
else
  DEV=cuda SHAPE=random:llama-1b DTYPE=bfloat16 NEW=64 TINY_NEW=64 TINY_PROMPTS=prompts16 GRAPHS=auto DMTD_D=4 MIX=16,128
fi
P=gpu_data
export PYTHONUNBUFFERED=1 PYTHONPATH="$here:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
log="$out/log.txt"
left() { echo $(( end - $(date +%s) )); }
pack() { tar czf "$out/results.tgz" -C "$work" . 2>/dev/null; }
step() {  # step NAME FILE MAX_SECONDS CMD...: CMD's output to OUTDIR/FILE, under min(MAX, time left - 15 s)
  local name=$1 file=$2 max=${3}; shift 3
  local var="T_${name}"; max=${!var:-$max}
  if [[ $name != env && " ${STEPS:-gpu_tests ar_best ar ar64 attn ar_flex ar_flex64 ar_tune ar_attn gpu_compiled profile profile64 tiny methods64 methods dmtd admit samples} " != *" $name "* ]]; then return; fi
  local t; t=$(left); t=$(( t - 15 < max ? t - 15 : max ))
  if (( t < 30 )); then echo "== $name: skipped, $(left) s left" | tee -a "$log" "$out/$file"; return; fi
  echo "== $name (limit $t s, $(left) s left) $(date +%T)" | tee -a "$log"
  local t0; t0=$(date +%s)
  timeout -k 10 "$t" "$@" >>"$out/$file" 2>&1
  local rc=$?
  echo "== $name: rc $rc in $(( $(date +%s) - t0 )) s" | tee -a "$log" "$out/$file"
  pack
}
bench() {  # bench DIR overrides...: jobs.bench on the step's model and device (its log beside its directory, in
  # results.tgz even when the step is cut short), then its summary
  local dir=$work/$1; shift
  python3 -m jobs.bench model.device=$DEV engine.cuda_graphs=$GRAPHS generation.ignore_eos=true bench.num_masks=[1] \
    bench.trees=[static] bench.repeats=3 bench.warmup=1 bench.warmup_rounds=1 output.dir="$dir" "$@" >"$dir.log" 2>&1
  local rc=$?
  grep -v -e Warning -e warnings.warn -e "Loading weights" "$dir.log" | grep -e Error -e error -e "results in" | tail -5
  python3 scripts/bench_summary.py "$dir"
  return $rc
}
big() { bench "$@" model.name_or_path=$SHAPE model.dtype=$DTYPE generation.max_new_tokens=$NEW; }

env_check() {
  nvidia-smi -L 2>/dev/null
  python3 -c 'import omegaconf' 2>/dev/null || {
    ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/site .whl/*.whl && echo "installed .whl/ into /tmp/site"; }
  python3 - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
missing = []
for name in ("torch", "transformers", "omegaconf", "pyarrow", "pytest", "matplotlib", "safetensors", "tokenizers"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "?"))
    except Exception as e:  # noqa: BLE001
        missing.append(name)
        print(name, "MISSING", type(e).__name__, e)
import torch
print("cuda", torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name(0))
print("cuda_available", torch.cuda.is_available())
if not missing:  # which RMSNorm form the direct decoder runs here (model/decoder.py: the fewest kernels that are
    # bitwise the module's), with a weight that is not all ones (a real model's)
    from torch.utils._python_dispatch import TorchDispatchMode
    from esp_worker import ModelConfig, load_model
    from esp_worker.model.runner import ModelRunner
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for dtype in ("float32", "bfloat16"):
        lm = load_model(ModelConfig(name_or_path="tiny-random-llama", device=dev, dtype=dtype))
        norm = lm.model.get_decoder().layers[0].input_layernorm
        with torch.no_grad():
            norm.weight.normal_()
        fn, ops = ModelRunner(lm).direct.norms[0][0], []
        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                ops.append(func.overloadpacket.__name__)
                return func(*args, **(kwargs or {}))
        x = torch.randn(2, 3, norm.weight.shape[0], device=dev).to(norm.weight.dtype)
        with torch.inference_mode(), Ops():
            fn(x)
        print("rms_norm", dtype, "module" if fn == norm.forward else "fused", " ".join(ops))
sys.exit(1 if missing else 0)
EOF
  [[ -f $P/prompts4.jsonl && -f $P/prompts128.jsonl ]] || { echo "no $P/prompts*.jsonl: run --prepare and carry gpu_data"; return 1; }
}

step env env.txt 60 bash -c "$(declare -f env_check); $(declare -p P); env_check"
if ! grep -q "^cuda_available True" "$out/env.txt" && (( ! dry )); then
  echo "no CUDA device: stopping (the dry run is --dry-run)" | tee -a "$log"; pack; exit 1
fi
xdist=$(python3 -c 'import xdist' 2>/dev/null && echo "-n 4")  # the tests share the GPU from 4 processes
step gpu_tests gpu_tests.txt 150 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE $xdist -m gpu tests/gpu \
  tests/engine/test_host_sync.py -k "${GPU_TESTS_K:-not compiled}"
AR='bench.settings=[ar:1:eager,ar:1:no_run_ahead,ar:1:compiled_graphs,ar:1:compiled_graphs+no_run_ahead]'
step ar ar.txt 270 bash -c "$(declare -f bench big); $(declare -p work DEV SHAPE DTYPE NEW P GRAPHS); \
  big ar-b1 data.path=$P/prompts4.jsonl '$AR' bench.hf_compiled=true bench.cost_curve=false"
step ar64 ar.txt 230 bash -c "$(declare -f bench big); $(declare -p work DEV SHAPE DTYPE NEW P GRAPHS); \
  big ar-b64 data.path=$P/prompts128.jsonl '$AR' bench.hf_compiled=false bench.cost_curve=false 'bench.batch_sizes=[64]'"
step attn ar.txt 60 python3 scripts/attn_backends.py
step ar_best ar.txt 280 bash -c "$(declare -f bench big); $(declare -p work DEV SHAPE DTYPE NEW P GRAPHS); \
  big ar-b1-best data.path=$P/prompts4.jsonl 'bench.settings=[ar:1:eager,ar:1:compiled_graphs+attention_flex+autotune]' \
    bench.hf_baseline=false bench.hf_compiled=false bench.cost_curve=false"
FLEX='bench.settings=[ar:1:eager,ar:1:compiled_graphs,ar:1:compiled_graphs+attention_flex]'
step ar_flex ar.txt 200 bash -c "$(declare -f bench big); $(declare -p work DEV SHAPE DTYPE NEW P GRAPHS); \
  big ar-b1-flex data.path=$P/prompts4.jsonl '$FLEX' bench.hf_baseline=false bench.hf_compiled=false \
    bench.cost_curve=false"
step ar_flex64 ar.txt 200 bash -c "$(declare -f bench big); $(declare -p work DEV SHAPE DTYPE NEW P GRAPHS); \
  big ar-b64-flex data.path=$P/prompts128.jsonl '$FLEX' bench.hf_baseline=false bench.hf_compiled=false \
    bench.cost_curve=false 'bench.batch_sizes=[64]'"
step ar_tune ar.txt 240 bash -c "$(declare -f bench big); $(declare -p work DEV SHAPE DTYPE NEW P GRAPHS); \
  big ar-b1-autotune data.path=$P/prompts4.jsonl 'bench.settings=[ar:1:eager,ar:1:compiled_graphs,\
ar:1:compiled_graphs+autotune]' bench.hf_baseline=false bench.hf_compiled=false bench.cost_curve=false"
step ar_attn ar.txt 200 bash -c "$(declare -f bench big); $(declare -p work DEV SHAPE DTYPE NEW P GRAPHS); \
  big ar-b1-attention data.path=$P/prompts4.jsonl 'bench.settings=[ar:1:eager,\
ar:1:attention_efficient,ar:1:attention_math,ar:1:compiled_graphs,ar:1:compiled_graphs+attention_math]' \
    bench.hf_baseline=false bench.hf_compiled=false bench.cost_curve=false"
step gpu_compiled gpu_tests.txt 200 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE $xdist -m gpu tests/gpu \
  -k compiled
step profile ar.txt 120 bash -c "$(declare -f bench big); $(declare -p work DEV SHAPE DTYPE NEW P GRAPHS); \
  big ar-profile data.path=$P/prompts4.jsonl 'bench.settings=[ar:1:compiled_graphs]' bench.repeats=1 \
    bench.hf_baseline=false bench.hf_compiled=false bench.cost_curve=false 'bench.profile=[ar]'"
step profile64 ar.txt 120 bash -c "$(declare -f bench big); $(declare -p work DEV SHAPE DTYPE NEW P GRAPHS); \
  big ar-profile-b64 data.path=$P/prompts128.jsonl 'bench.methods=[ar]' 'bench.batch_sizes=[64]' bench.repeats=1 \
    bench.warmup_rounds=0 bench.hf_baseline=false bench.hf_compiled=false bench.cost_curve=false 'bench.profile=[ar]'"
step tiny tiny.txt 145 bash -c "$(declare -f bench); $(declare -p work DEV P GRAPHS); \
  bench tiny-b1 model.name_or_path=$P/esp-tiny-llama model.dtype=float32 data.path=$P/$TINY_PROMPTS.jsonl \
    generation.max_new_tokens=$TINY_NEW generation.ignore_eos=false \
    'bench.settings=[pld:10,pld:10:no_run_ahead,esp:30,esp:30:host_probe,esp:30:no_run_ahead,esp:auto,hybrid:auto,hybrid:auto:host_probe,hybrid:auto:no_run_ahead,hybrid:30,hybrid:30:no_run_ahead]' \
    bench.hf_compiled=false bench.cost_curve=false 'bench.profile=[ar,pld:10,hybrid:auto]'"
step methods64 methods.txt 150 bash -c "$(declare -f bench big); $(declare -p work DEV SHAPE DTYPE NEW P GRAPHS); \
  big methods-b64 data.path=$P/prompts128.jsonl 'bench.settings=[esp:30,hybrid:auto]' bench.hf_baseline=false \
    bench.hf_compiled=false bench.cost_curve=false 'bench.batch_sizes=[64]'"
step methods methods.txt 150 bash -c "$(declare -f bench big); $(declare -p work DEV SHAPE DTYPE NEW P GRAPHS); \
  big methods-b1 data.path=$P/prompts4.jsonl 'bench.settings=[esp:30,esp:30:no_run_ahead,hybrid:auto,hybrid:auto:no_run_ahead]' bench.hf_baseline=false \
    bench.hf_compiled=false bench.cost_max_block=128 'bench.cost_cache_lens=[64,512]'; \
  big methods-b16-b64 data.path=$P/prompts128.jsonl 'bench.settings=[esp:30,hybrid:auto]' bench.hf_baseline=false \
    bench.hf_compiled=false 'bench.batch_sizes=[16,64]' bench.cost_max_block=128 'bench.cost_cache_lens=[64,512]'"
step admit tiny.txt 100 bash -c "$(declare -f bench); $(declare -p work DEV P GRAPHS MIX); \
  bench tiny-b16-admission model.name_or_path=$P/esp-tiny-llama model.dtype=float32 data.path=$P/prompts64.jsonl \
    generation.ignore_eos=false 'bench.mixed_max_new_tokens=[$MIX]' 'bench.batch_sizes=[16]' \
    'bench.settings=[ar:1:eager_admission,hybrid:auto,hybrid:auto:eager_admission]' bench.hf_baseline=false \
    bench.hf_compiled=false bench.cost_curve=false"
step dmtd dmtd.txt 120 bash -c "$(declare -f bench big); $(declare -p work DEV SHAPE DTYPE NEW P GRAPHS DMTD_D TINY_NEW TINY_PROMPTS); \
  big dmtd-1b data.path=$P/prompts4.jsonl 'bench.settings=[ar:1:eager,dmtd:2,dmtd:3,dmtd:4]' \
    engine.dmtd_decoding_layers=$DMTD_D engine.cuda_graphs=auto bench.hf_baseline=false bench.hf_compiled=false bench.cost_curve=false; \
  bench dmtd-tiny model.name_or_path=$P/esp-tiny-llama model.dtype=float32 data.path=$P/$TINY_PROMPTS.jsonl \
    generation.max_new_tokens=$TINY_NEW generation.ignore_eos=false 'bench.batch_sizes=[1,8]' \
    'bench.dmtd_paths=[dmtd/esp-tiny-llama-tau3-d2,dmtd/esp-tiny-llama-tau3-d2-verified]' \
    'bench.settings=[ar:1:eager,dmtd:3,dmtd_verified:3,esp:auto]' bench.hf_compiled=false bench.cost_curve=false \
    engine.cuda_graphs=auto"
step samples samples.txt 150 bash -c "$(declare -f bench big); $(declare -p work DEV SHAPE DTYPE NEW P GRAPHS); \
  big samples-b64 data.path=$P/prompts16.jsonl generation.n=8 generation.temperature=0.8 'bench.batch_sizes=[64]' \
    'bench.settings=[ar:1:no_prefix_cache,hybrid:auto,hybrid:auto:no_prefix_cache]' bench.hf_compiled=false \
    bench.cost_curve=false"
echo "== done, $(left) s left" | tee -a "$log"
pack
