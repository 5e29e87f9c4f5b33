#!/usr/bin/env bash
# The whole GPU suite and the benchmarks in one command, on any machine with a GPU:
#
#     bash scripts/gpu_suite.sh OUTDIR [tests_ep] [tests_moe] [tests_tp] [tests_cpu] [tutorials] [sweep8]
#                                      [bench_ep] [bench_moe] [bench_gemm] [bench_tp]
#
# (default: all but sweep8). `tests_ep` runs the GPU tests of dispatch/combine and the NVSHMEM wrappers,
# `tests_moe` those of the MoE layer, grouped GEMM, tile loop and quantization (their CPU tests too), `tests_tp` the async-TP ones,
# `tests_cpu` the tests not marked gpu (CI runs those too), `sweep8` the dispatch/combine sweep at 8 ranks.
# With one GPU the multi-rank tests run in shared-GPU mode: 2 and 4 ranks (MOE_EP_TEST_WORLDS overrides)
# share the GPU under a CUDA MPS daemon that pytest and launch.sh start and stop themselves; the tutorials
# run with 2 ranks there, and the benchmarks with one (they refuse shared GPUs: no NVLink to time).
# A device call lasts at most 10 minutes: group parts so that each call fits, e.g. `tests_ep bench_ep`,
# then `tests_moe tests_tp`, then `tutorials bench_moe bench_tp`.
# Every step runs under `timeout`; logs, JSON and plots land in OUTDIR. If nvshmem4py is not
# importable and wheels lie in .whl/, they are installed into /tmp/site first.
# The exit status is non-zero if any step failed.
set -uo pipefail
out="${1:?usage: bash scripts/gpu_suite.sh OUTDIR [tests_ep] [tests_moe] [tests_tp] [tests_cpu] [tutorials] [sweep8] [bench_ep] [bench_moe] [bench_gemm] [bench_tp]}"
shift
parts="${*:-tests_ep tests_moe tests_tp tests_cpu tutorials bench_ep bench_moe bench_gemm bench_tp}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p "$out"

if ! python3 -c "import nvshmem.core" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
ranks=$(( gpus > 1 ? gpus : 2 ))         # the tutorials' ranks: a GPU each, or 2 sharing the one GPU

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m
  echo "GPUs: $gpus; MPS control: $(command -v nvidia-cuda-mps-control || echo missing)"
  python3 -c "import torch, triton, nvshmem; print('torch', torch.__version__, 'triton', triton.__version__, 'nvshmem4py', nvshmem.__version__)"
  env | grep -E '^(NVSHMEM|NCCL|TORCH_SYMM)' | sort; } > "$out/machine.txt" 2>&1
cat "$out/machine.txt"

failed=0
step() {   # step NAME SECONDS command...
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.log"
  echo "== $name: exit $rc"
  [[ $rc == 0 ]] || failed=1
}
for part in $parts; do
  case "$part" in
    tests_ep) step pytest_ep 420 python3 -m pytest -q -rs -m gpu tests/test_ep_gpu.py tests/test_shmem_gpu.py ;;
    tests_moe) step pytest_moe 420 python3 -m pytest -q -rs tests/test_moe_layer.py tests/test_grouped_gemm.py \
                 tests/test_quant.py tests/test_matmul.py ;;
    tests_tp) step pytest_tp 540 python3 -m pytest -q -rs -m gpu tests/test_tp_gpu.py ;;
    tests_cpu) step pytest_cpu 540 python3 -m pytest -q -rs -m "not gpu" tests ;;
    tutorials) step tutorial01 60 bash launch.sh --nproc "$ranks" tutorials/01-ring-exchange.py
               step tutorial02 90 bash launch.sh --nproc "$ranks" tutorials/02-ep-all-to-all.py
               step tutorial03 120 bash launch.sh --nproc "$ranks" tutorials/03-swap-moe-into-a-model.py
               step tutorial04 120 bash launch.sh --nproc "$ranks" tutorials/04-async-tp.py ;;
    sweep8) step pytest_sweep8 540 env MOE_EP_TEST_WORLDS=8 python3 -m pytest -q -rs -m gpu tests/test_ep_gpu.py -k sweep ;;
    bench_ep) step bench_all_to_all 420 bash launch.sh benchmarks/bench_all_to_all.py --out "$out" --sweep --breakdown ;;
    bench_moe) step bench_moe_layer 240 bash launch.sh benchmarks/bench_moe_layer.py --out "$out" ;;
    bench_gemm) step bench_gemm_tile_loop 120 bash launch.sh --nproc 1 benchmarks/bench_gemm.py --tile_loop --out "$out/tile_loop"
                step bench_gemm_grouped 180 bash launch.sh --nproc 1 benchmarks/bench_gemm.py --grouped --out "$out/grouped" ;;
    bench_tp) step bench_tp 420 bash launch.sh benchmarks/bench_tp.py --out "$out" ;;
    *) echo "unknown part: $part"; failed=1 ;;
  esac
done
exit $failed
