#!/usr/bin/env bash
# The GPU tests and the benchmarks in parts, on any machine with a GPU:
#
#     bash scripts/gpu_suite.sh OUTDIR [PART ...]        (default: quick)
#
# quick       the gate of every change that runs on a GPU: every GPU test file once, at 2 ranks (shared-GPU
#             mode on one GPU; elastic EP's at 4), the sweeps at a reduced size, and the one-GPU benchmarks
#             at their headline sizes (EP 128 and 4096 tokens, the MoE layer at 128 tokens, the grouped GEMM's
#             two model shapes at their decode and prefill rows). On one H200 with a warm compile cache (see
#             below) the test lanes end at 290-335 s and the three benchmarks take 70-80 s: 400-460 s in all
#             (benchmarks/NOTES.md, "The gate runs of 2026-11-27, early" and "morning"); 379 s with the
#             multi-rank lanes at 12 % of the SMs a process (2026-11-28).
# multi       on a machine of 2+ GPUs, every GPU its own rank: every GPU test file at world = the GPUs (elastic
#             EP's at 4 ranks; the EP sweep at quick's reduced size, whole in tests_ep) and the tutorials, side
#             by side (the GPUs time-slice between the jobs), with DeepEP's build where .deepep/ holds its source
# multi_bench the benchmarks at every GPU, one at a time, alone: multi_bench_ep (DeepEP's, then EP with the put
#             path beside the pointer path, DeepEP merged in), then multi_bench_layers (EP in each payload format
#             at 128 and 4096 tokens, async TP, the TP layers in a decode step, the MoE layer). Run multi, then
#             multi_bench on the same machine (together they took over ten minutes on 4 x H200; each half takes
#             under ten)
# tests_ep    dispatch/combine and the NVSHMEM wrappers        tests_moe   MoE layer, grouped GEMM, tile loop, quant
# elastic     elastic EP alone: ranks killed at 4 ranks, the survivors go on; calls back to back
# tests_tp    async TP                                         tests_cpu   the tests not marked gpu (CI runs those)
# engines     the vLLM and SGLang GPU tests                    tutorials   tutorials 01-04 and 06
# sweep8      the dispatch/combine sweep at 8 ranks
# deepep      DeepEP's build (its V1 source in .deepep/, with .deepep/build.sh) and its benchmark beside ours
# bench_ep, bench_moe, bench_gemm, bench_tp, bench_tp_layers: each benchmark's default run (at most 2 minutes on
#             one H200; EP's with the put path beside the pointer path, which one GPU, a world of one, does not time);
# bench_full: their long sweeps (bench_all_to_all --sweep --breakdown, bench_gemm --full, ...).
#
# With one GPU the multi-rank tests run in shared-GPU mode (2 and 4 ranks unless MOE_EP_TEST_WORLDS says
# otherwise) under a CUDA MPS daemon that pytest and launch.sh start and stop themselves; the tutorials run
# with 2 ranks there, the benchmarks with one (they refuse shared GPUs). Every step runs under `timeout`
# with its log in OUTDIR; OUTDIR/summary.txt holds one verdict line per step (SKIP where every test of the
# step skipped) and a summary line. The exit status is non-zero if any step failed. A machine without a GPU
# is refused; stopping the suite (an outer timeout's TERM, ^C) stops every step it started.
#
# Triton's compile cache lives in .triton_cache/ (TRITON_CACHE_DIR, ignored by git) and is packed, pruned
# to what a later run loads, into OUTDIR/triton_cache.tar.gz at the end. Put that file in the next
# machine's checkout as .triton_cache.tar.gz and the suite starts from it (the paths inside are rewritten
# for the new checkout). nvshmem4py wheels in .whl/ are installed into /tmp/site when nvshmem4py is not
# importable. An engine's sources in .engines/ENGINE/ (ENGINE vllm or sglang: *.tar.gz with its top-level package
# folder, and *.whl of what its modules import that the machine lacks) are unpacked into /tmp/moe_ep_engines/ENGINE,
# which goes on the path of that engine's tests only: the two pin different versions of what they share (openai).
set -uo pipefail
usage="usage: bash scripts/gpu_suite.sh OUTDIR [PART ...], PART one of quick multi multi_bench multi_bench_ep
  multi_bench_layers tests_ep tests_moe tests_tp elastic tests_cpu engines tutorials sweep8 deepep bench_ep
  bench_moe bench_gemm bench_tp bench_tp_layers bench_full"
out="${1:?$usage}"
shift
parts="${*:-quick}"
parts=$(for part in $parts; do
  [[ $part == multi_bench ]] && part="multi_bench_ep multi_bench_layers"
  printf '%s ' "$part"
done)
parts=${parts% }
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if ! gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null) || (( gpus == 0 )); then
  echo "gpu_suite: no GPU visible here (torch.cuda.device_count() is ${gpus:-unknown}); run it on a GPU machine" >&2
  exit 2
fi
descendants() { local child; for child in $(pgrep -P "$1"); do descendants "$child"; echo "$child"; done; }
trap 'trap - TERM INT; kill -TERM $(descendants $$) 2>/dev/null; exit 143' TERM INT
mkdir -p "$out"
out=$(cd "$out" && pwd)
started=$SECONDS

if ! python3 -c "import nvshmem.core" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$PWD/.triton_cache}"
mkdir -p "$TRITON_CACHE_DIR"
if [[ -f .triton_cache.tar.gz ]]; then
  tar -xzf .triton_cache.tar.gz -C "$TRITON_CACHE_DIR"
fi
# Triton names a kernel's files in its cache by absolute path: point them at this checkout's cache.
python3 scripts/triton_cache.py relocate "$TRITON_CACHE_DIR"

engine_names="vllm sglang"    # each with its GPU tests in tests/test_<name>.py
engine_steps=$(printf 'engine_%s ' $engine_names)     # their steps' names (engine_tests), for lanes_passed
engines=""
for engine in $engine_names; do
  compgen -G ".engines/$engine/*.tar.gz" >/dev/null || continue
  engines+="$engine "
  mkdir -p "/tmp/moe_ep_engines/$engine"
  for archive in ".engines/$engine"/*.tar.gz; do tar -xzf "$archive" -C "/tmp/moe_ep_engines/$engine"; done
  if compgen -G ".engines/$engine/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "/tmp/moe_ep_engines/$engine" \
      ".engines/$engine"/*.whl
  fi
done
engines=${engines% }

ranks=$(( gpus > 1 ? gpus : 2 ))         # the tutorials' ranks: a GPU each, or 2 sharing the one GPU

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m
  echo "GPUs: $gpus; MPS control: $(command -v nvidia-cuda-mps-control || echo missing)"
  python3 -c "import torch, triton, nvshmem
print('torch', torch.__version__, 'triton', triton.__version__, 'nvshmem4py', nvshmem.__version__)"
  echo "engine sources: ${engines:-none}; Triton cache: $(find "$TRITON_CACHE_DIR" -name '*.json' | wc -l) files"
  env | grep -E '^(NVSHMEM|NCCL|TORCH_SYMM)' | sort; } > "$out/machine.txt" 2>&1
cat "$out/machine.txt"
: > "$out/summary.txt"

failed=0
step() {   # step NAME SECONDS command...: run under timeout, log to OUTDIR/NAME.log, one verdict line
  local name=$1 limit=$2 begin=$SECONDS
  shift 2
  echo "== $name: $*"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1 &     # waited for, so that a TERM to the suite is taken at once
  wait $!
  local rc=$?
  local last
  last=$(grep -E '[0-9]+ (passed|failed|errors?|skipped|deselected)\b.* in [0-9.]+s' "$out/$name.log" | tail -n 1)
  tail -n 25 "$out/$name.log"
  local verdict=PASS skipped_all=""
  [[ $last == *skipped* && ! $last =~ passed|failed|error ]] && skipped_all=1
  # pytest exits 5 where it collected nothing to run: a module skipped whole (its reason in the log) is a SKIP
  if (( rc == 124 || rc == 137 )); then verdict=TIMEOUT; elif [[ -n $skipped_all ]] && (( rc == 0 || rc == 5 )); then
    verdict=SKIP; elif (( rc != 0 )); then verdict=FAIL; fi
  printf '%-7s %-22s %4ds  exit %-3s %s\n' "$verdict" "$name" $(( SECONDS - begin )) "$rc" "$last" \
    | tee -a "$out/summary.txt"
  [[ $verdict == PASS || $verdict == SKIP ]] || failed=1
}
skip() {   # skip NAME WHY: a step that cannot run here, one SKIP line
  printf '%-7s %-22s %4ds  %s\n' SKIP "$1" 0 "$2" | tee -a "$out/summary.txt"
}
lanes_passed() {   # lanes_passed NAME...: every step of the lanes has its verdict line, PASS or SKIP
  local name
  for name in "$@"; do grep -qE "^(PASS|SKIP) +$name " "$out/summary.txt" || failed=1; done
}
mps_running() { python3 -c "import sys; sys.path.insert(0, 'moe_ep'); import mps; sys.exit(not mps.running())"; }
shared_gpu() {   # one CUDA MPS daemon for steps that run side by side on one GPU (pytest reuses it)
  (( gpus == 1 )) || return 0
  mps_running && return 0
  export CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
  nvidia-cuda-mps-control -d
  mps_started=1
  for _ in $(seq 150); do mps_running && return 0; sleep 0.1; done
}
own_gpu() {   # stop the daemon shared_gpu started: benchmarks time the GPU as a plain process
  [[ -n ${mps_started:-} ]] || return 0
  echo quit | nvidia-cuda-mps-control
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY mps_started
}
trap own_gpu EXIT
lane() {   # lane NAME SECONDS command... [--and-then NAME SECONDS command...]: steps one after the other, in
           # the background (`wait` collects them); engine_tests SECONDS may stand for a step
  local first=$1
  ( while (( $# )); do
      local steps=()
      while (( $# )) && [[ $1 != --and-then ]]; do steps+=("$1"); shift; done
      (( $# )) && shift
      if [[ ${steps[0]} == engine_tests ]]; then engine_tests "${steps[1]}"; else step "${steps[@]}"; fi
    done ) > "$out/$first.lane" 2>&1 &
}
engine_tests() {   # engine_tests SECONDS: each engine's GPU tests on its sources from .engines/ (a SKIP without them)
  local engine
  for engine in $engine_names; do
    if [[ " $engines " != *" $engine "* ]]; then
      skip "engine_$engine" "no $engine sources in .engines/$engine/"
      continue
    fi
    step "engine_$engine" "$1" env PYTHONPATH="/tmp/moe_ep_engines/$engine:$PYTHONPATH" \
      python3 -m pytest -q -rs -m gpu "tests/test_$engine.py"
  done
}

deepep_build() {   # deepep_build step|lane: build DeepEP in .deepep/ where its source is and no build is yet
  if [[ -f .deepep/setup.py ]] && ! compgen -G ".deepep/deep_ep_cpp*.so" >/dev/null; then
    "$1" deepep_build 300 bash .deepep/build.sh "$out"
  fi
}
deepep_bench() {   # DeepEP's benchmark in a job of its own, where its build is in .deepep/ (bench_all_to_all merges it)
  if ! compgen -G ".deepep/deep_ep_cpp*.so" >/dev/null; then
    skip bench_deepep "no DeepEP build in .deepep/"
    return
  fi
  step bench_deepep 150 env PYTHONPATH="$PWD/.deepep:$PYTHONPATH" bash launch.sh benchmarks/bench_deepep.py --out "$out"
}

for part in $parts; do
  case "$part" in
    quick)
      # Four lanes side by side under one MPS daemon, balanced for a warm compile cache: the one-process
      # kernel tests (no waits on a peer); NVSHMEM's wrappers, then elastic EP at 4 ranks; EP at 2 ranks,
      # then the engines; async TP, the MoE layer and quant at 2 ranks (in the EP lane until the night of
      # 2026-11-26, when that lane ended last, at 354 s, and the TP lane at 180 s). Each kernel that waits on
      # a peer is bounded, and each rank holds its share of the SMs.
      # Each limit is 1.5-2x its step's cold time on one H200 (benchmarks/NOTES.md, "The quick GPU suite").
      # The three lanes whose kernels wait on peers hold at most 12 % of the SMs a process, their 8 processes
      # together 96 %: under MPS a share caps a process, it reserves nothing, and at 1 / (ranks per GPU) each
      # a lane's spinning waits held the SMs another lane's ranks needed for seconds (a live rank of elastic
      # EP counted dead, an async TP wait timed out: benchmarks/NOTES.md, 2026-11-28).
      shared_gpu
      lane pytest_kernels 420 python3 -m pytest -q -rs --durations=8 tests/test_grouped_gemm.py \
        tests/test_matmul.py tests/test_quant.py tests/test_moe_layer.py -m "not gpu"
      export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=12
      lane pytest_shmem 300 env MOE_EP_TEST_WORLDS=2 python3 -m pytest -q -rs --durations=8 -m gpu \
        tests/test_shmem_gpu.py --and-then pytest_elastic 300 python3 -m pytest -q -rs -s -m gpu \
        tests/test_ep_elastic.py
      lane pytest_ep 480 env MOE_EP_TEST_WORLDS=2 MOE_EP_TEST_QUICK=1 python3 -m pytest -q -rs --durations=8 \
        -m gpu tests/test_ep_gpu.py tests/test_ep_puts_gpu.py --and-then engine_tests 240
      lane pytest_tp 420 env MOE_EP_TEST_WORLDS=2 python3 -m pytest -q -rs --durations=8 -m gpu tests/test_tp_gpu.py \
        tests/test_moe_layer.py tests/test_quant.py
      unset CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
      wait
      cat "$out"/*.lane
      lanes_passed pytest_kernels pytest_shmem pytest_ep $engine_steps pytest_tp pytest_elastic
      own_gpu
      step bench_ep 150 bash launch.sh --nproc 1 benchmarks/bench_all_to_all.py --out "$out" --tokens 128,4096
      step bench_moe 150 bash launch.sh --nproc 1 benchmarks/bench_moe_layer.py --out "$out" --tokens 128
      step bench_grouped 150 bash launch.sh --nproc 1 benchmarks/bench_gemm.py --grouped --out "$out" ;;
    multi)
      # Six lanes of jobs side by side, a rank on every GPU (the GPUs time-slice between the jobs; their
      # compiles share the CPUs): the EP file in two (its sweep and back-to-back calls; the rest); the put path
      # and NVSHMEM's wrappers, then the engines; async TP, the MoE layer and quant; the tutorials; elastic EP;
      # DeepEP's build on the CPUs beside them. The lanes ran 360 s on 4 x H200 from a one-GPU cache, the TP
      # lane longest (benchmarks/NOTES.md, "The gate runs of 2026-11-26, afternoon" and "evening"); in the
      # night's run the two EP-call lanes passed 300 s there before their last test (147 and 135 s alone with
      # the cache that run left), so their limits are 420 s; with the put path's faster compiles the next run
      # ended in 381 s, DeepEP's build and benchmark included. The benchmarks are multi_bench, run after it.
      if (( gpus < 2 )); then skip multi "one GPU: multi needs a GPU a rank (quick runs shared-GPU mode)"; continue; fi
      deepep_build lane
      lane multi_ep 300 env MOE_EP_TEST_WORLDS=$gpus MOE_EP_TEST_QUICK=1 python3 -m pytest -q -rs --durations=8 -m gpu \
        tests/test_ep_gpu.py -k "sweep or back_to_back"
      lane multi_ep_calls 420 env MOE_EP_TEST_WORLDS=$gpus MOE_EP_TEST_QUICK=1 python3 -m pytest -q -rs --durations=8 \
        -m gpu tests/test_ep_gpu.py -k "not sweep and not back_to_back"
      lane multi_puts 420 env MOE_EP_TEST_WORLDS=$gpus MOE_EP_TEST_QUICK=1 python3 -m pytest -q -rs --durations=8 \
        -m gpu tests/test_ep_puts_gpu.py tests/test_shmem_gpu.py --and-then engine_tests 240
      lane multi_tp 480 env MOE_EP_TEST_WORLDS=$gpus python3 -m pytest -q -rs --durations=8 -m gpu \
        tests/test_tp_gpu.py tests/test_moe_layer.py tests/test_quant.py
      lane tutorial01 90 bash launch.sh tutorials/01-ring-exchange.py \
        --and-then tutorial02 120 bash launch.sh tutorials/02-ep-all-to-all.py \
        --and-then tutorial03 150 bash launch.sh tutorials/03-swap-moe-into-a-model.py \
        --and-then tutorial04 150 bash launch.sh tutorials/04-async-tp.py \
        --and-then tutorial06 180 bash launch.sh --nproc 4 tutorials/06-elastic-ep.py
      lane multi_elastic 300 python3 -m pytest -q -rs -s -m gpu tests/test_ep_elastic.py
      wait
      cat "$out"/*.lane
      lanes_passed multi_ep multi_ep_calls multi_puts multi_elastic multi_tp $engine_steps tutorial01 tutorial02 \
        tutorial03 tutorial04 tutorial06 ;;
    multi_bench_ep)
      # DeepEP's benchmark at every GPU (built first where multi has not), then ours with the put path beside the
      # pointer path (50 repetitions a decode setting, 12 at prefill) and on 24 SMs at prefill, which merges
      # DeepEP's into its table, each alone on the machine. On 2 x H200 from a cache without the put path's
      # kernels: DeepEP's 87 s; ours 93, 59 and 119 s at 16, 128 and 512 tokens (mostly the put path's compiles),
      # 4096 not reached in 300 s.
      if (( gpus < 2 )); then skip "$part" "one GPU: the multi-GPU benchmarks need a GPU a rank"; continue; fi
      deepep_build step
      deepep_bench
      step bench_all_to_all 420 bash launch.sh benchmarks/bench_all_to_all.py --out "$out" --puts --iters 50 \
        --num-sms 24 ;;
    multi_bench_layers)
      # The payload formats' EP benchmark (128 and 4096 tokens: 277 s on 2 x H200), async TP's (33-35 s), the TP
      # layers' in a decode step (26 s on 2 x H200) and the MoE layer's (30-115 s), each alone on the machine; the
      # formats' run writes into OUTDIR/formats.
      if (( gpus < 2 )); then skip "$part" "one GPU: the multi-GPU benchmarks need a GPU a rank"; continue; fi
      mkdir -p "$out/formats"
      step bench_formats 360 bash launch.sh benchmarks/bench_all_to_all.py --out "$out/formats" --tokens 128,4096 \
        --formats --iters 50
      step bench_tp 120 bash launch.sh benchmarks/bench_tp.py --out "$out"
      step bench_tp_layers 120 bash launch.sh benchmarks/bench_tp_layers.py --out "$out"
      step bench_moe_layer 120 bash launch.sh benchmarks/bench_moe_layer.py --out "$out" ;;
    deepep) deepep_build step
            deepep_bench ;;
    tests_ep) step pytest_ep 540 python3 -m pytest -q -rs -m gpu tests/test_ep_gpu.py tests/test_ep_puts_gpu.py \
                tests/test_shmem_gpu.py ;;
    tests_moe) step pytest_moe 540 python3 -m pytest -q -rs tests/test_moe_layer.py tests/test_grouped_gemm.py \
                 tests/test_quant.py tests/test_matmul.py ;;
    tests_tp) step pytest_tp 540 python3 -m pytest -q -rs -m gpu tests/test_tp_gpu.py ;;
    elastic) step pytest_elastic 300 python3 -m pytest -q -rs -s -m gpu tests/test_ep_elastic.py ;;
    tests_cpu) step pytest_cpu 540 python3 -m pytest -q -rs -m "not gpu" tests ;;
    engines) engine_tests 300 ;;
    tutorials) step tutorial01 60 bash launch.sh --nproc "$ranks" tutorials/01-ring-exchange.py
               step tutorial02 90 bash launch.sh --nproc "$ranks" tutorials/02-ep-all-to-all.py
               step tutorial03 120 bash launch.sh --nproc "$ranks" tutorials/03-swap-moe-into-a-model.py
               step tutorial04 120 bash launch.sh --nproc "$ranks" tutorials/04-async-tp.py
               step tutorial06 180 bash launch.sh --nproc 4 tutorials/06-elastic-ep.py ;;
    sweep8) step pytest_sweep8 540 env MOE_EP_TEST_WORLDS=8 python3 -m pytest -q -rs -m gpu tests/test_ep_gpu.py \
              -k sweep ;;
    bench_ep) step bench_all_to_all 180 bash launch.sh benchmarks/bench_all_to_all.py --out "$out" --puts ;;
    bench_moe) step bench_moe_layer 150 bash launch.sh benchmarks/bench_moe_layer.py --out "$out" ;;
    bench_gemm) step bench_gemm 150 bash launch.sh --nproc 1 benchmarks/bench_gemm.py --out "$out" ;;
    bench_tp) step bench_tp 150 bash launch.sh benchmarks/bench_tp.py --out "$out" ;;
    bench_tp_layers) step bench_tp_layers 150 bash launch.sh benchmarks/bench_tp_layers.py --out "$out" ;;
    bench_full) step bench_all_to_all_full 540 bash launch.sh benchmarks/bench_all_to_all.py --out "$out" --sweep \
                  --breakdown
                step bench_gemm_full 540 bash launch.sh --nproc 1 benchmarks/bench_gemm.py --full --out "$out" ;;
    *) echo "unknown part: $part"; echo "$usage"; failed=1 ;;
  esac
done

python3 scripts/triton_cache.py pack "$TRITON_CACHE_DIR" "$out/triton_cache.tar.gz"
steps=$(wc -l < "$out/summary.txt")
passed=$(grep -c '^PASS' "$out/summary.txt")
skipped=$(grep -c '^SKIP' "$out/summary.txt")
printf 'gpu_suite %s: %s of %s steps passed, %s skipped, in %ds on %sx %s\n' "$parts" "$passed" "$steps" "$skipped" \
  $(( SECONDS - started )) "$gpus" "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)" \
  | tee -a "$out/summary.txt"
exit $failed
