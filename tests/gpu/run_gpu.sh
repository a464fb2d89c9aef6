#!/usr/bin/env bash
# Everything that needs the GPU, in one go (used through the device tool; see docs/gpu.md).
#   bash tests/gpu/run_gpu.sh [OUTDIR]
# 1. the seed offload test, unchanged but for the import path, under torchrun;
# 2. the CUDA-only tests (tests/gpu/test_*_gpu.py) and the optimizer/offload test suite
#    (world size 1 on NCCL; larger ones fall back to gloo unless that many GPUs are present);
# 3. the benchmarks (BENCH picks them; docs/gpu.md lists which figure each gives): Muon,
#    offload, save/load throughput (CKPT_GIB, CKPT_DIR: size and local dir), the asynchronous
#    save (ASYNC_CASES; blocking and deferred snapshots), the deferred snapshot alone, a memory
#    snapshot every step, the memory tier's restore, and the resume against the physical path.
# OUTDIR gets gpu.log (everything), pytest.txt (the pytest step's failures, whole) and junit.xml.
set -uo pipefail
out=${1:-${OUT:-/tmp}}
mkdir -p "$out" && touch "$out/gpu.log"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The GPU machine reaches no package registry: wheels it lacks (crc32c) travel in the
# git-ignored .gpu-wheels/ (docs/gpu.md says how to fill and carry it).
if [ -d .gpu-wheels ]; then
  python3 -m pip install -q --no-index --find-links .gpu-wheels crc32c || echo "crc32c: not installed"
fi
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__)'
df -h "${CKPT_DIR:-/tmp}" /dev/shm 2>/dev/null || df -h /tmp /dev/shm  # the benchmarks size to these
rc=0
# STEP_TIMEOUT (seconds, default none): each step is stopped after it (exit 124), the next runs.
# Stopped with SIGINT, as Ctrl-C: pytest then still reports the failures so far and writes
# its XML; SIGKILL 30 s later if it is still there.
step() {
  echo; echo "=== $* ===" | tee -a "$out/gpu.log"
  timeout -s INT -k 30 "${STEP_TIMEOUT:-0}" "$@" 2>&1 | tee -a "$out/gpu.log"; local r=${PIPESTATUS[0]}
  echo "=== exit $r: $1 ===" | tee -a "$out/gpu.log"; [ "$r" = 0 ] || rc=1
  # What a failure may have run out of: disk (pytest keeps each failed test's tmp_path), host
  # and page-locked memory, file descriptors.
  { df -h /tmp /dev/shm | tail -n +2; free -g | sed -n 2p; echo "ulimit -n $(ulimit -n)"; } 2>&1 | tee -a "$out/gpu.log"
}
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # SKIP_SEED=1 leaves out the seed test (a minute; it has passed on every run so far).
  [ "${SKIP_SEED:-0}" = 1 ] || step torchrun --nproc-per-node="$ngpu" tests/gpu/test_cpu_offload.py
  suite="tests/gpu/test_optim_gpu.py tests/gpu/test_offload_gpu.py tests/gpu/test_checkpoint_gpu.py tests/gpu/test_itemread_gpu.py tests/gpu/test_async_gpu.py tests/gpu/test_deferred_gpu.py tests/gpu/test_resume_gpu.py tests/gpu/test_memory_tier_gpu.py tests/optim/test_optim_dist.py tests/optim/test_optim_reference.py tests/optim/test_optim_config.py tests/optim/test_optim_gram.py tests/offload/test_offload_dist.py tests/offload/test_offload_pipeline.py"
  # With several GPUs the checkpoint resume/reshard suites run on NCCL too (on one GPU their
  # multi-rank cases would be gloo on the CPU again, as in CI).
  [ "$ngpu" -gt 1 ] && suite="$suite tests/manager/test_manager_resume.py tests/manager/test_manager_fsdp.py tests/interop/test_import_dist.py tests/save/test_async_save.py"
  # PYTEST_ARGS may name tests/gpu whole: the seed test is torchrun's (its functions take
  # rank and world_size), never pytest's.
  # Every failure and error with its whole traceback, and the summary, in $out/pytest.txt (the
  # device call's output keeps only its last 12,000 characters); all of them in junit.xml.
  from=$(wc -l <"$out/gpu.log")
  step python3 -m pytest -q -p no:cacheprovider -rfEs --tb=long --durations=15 \
    --junitxml="$out/junit.xml" --ignore=tests/gpu/test_cpu_offload.py ${PYTEST_ARGS:-$suite}
  tail -n +"$((from + 1))" "$out/gpu.log" | awk '
    /^=+ (ERRORS|FAILURES) =+$/ || /^!+ KeyboardInterrupt !+$/ { keep = 1 }
    /^=+ warnings summary =+$/ { keep = 0 }
    /^=+ (slowest .*durations|short test summary info) =+$/ { keep = 1 }
    /^=== exit / { keep = 1 }
    keep' >"$out/pytest.txt"
fi
# BENCH picks benchmarks (default: muon offload checkpoint async resume memory); the figures
# of docs/benchmarks.md one command each: muon offload deferred every-step tier-restore resume.
# MUON_ARGS, ASYNC_ARGS, RESUME_ARGS, MEMORY_ARGS: more options for bench_muon,
# bench_async_save, bench_resume and bench_memory_tier (e.g. RESUME_ARGS="--rounds 1"), last
# on the line, so that they win.
want() { [[ " ${BENCH:-muon offload checkpoint async resume memory} " == *" $1 "* ]]; }
ckpt=${CKPT_DIR:-/tmp/muon-ckpt-bench}
gpt=${GPT_CASE:-12x2048x4096}  # LAYERSxDIMxBATCH: forward and backward most of a step
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  if want muon; then  # ours / torch.optim.Muon, Gram / standard NS, compiled NS, a profile
    step python3 benchmarks/bench_muon.py --device cuda --profile ${MUON_ARGS:-}
    if [ "$ngpu" -gt 1 ]; then  # Muon scaling over 1, 2, 4, 8 GPUs (as many as there are)
      for n in 1 2 4 8; do
        [ "$n" -le "$ngpu" ] && step torchrun --nproc-per-node="$n" benchmarks/bench_muon_scaling.py --csv "$out/scaling.csv" --offload --ckpt-dir "$ckpt-ranks$n"
      done
      # Newton-Schulz work per rank and step time: one GPU, FSDP, HSDP 2 x N/2, TP 2 x FSDP N/2.
      step torchrun --nproc-per-node="$ngpu" -m benchmarks.bench_muon_mesh --device cuda
    fi
  fi
  # Offload on / off on the uniform and GPT-like sets, peak step memory, which stream waited.
  want offload && step python3 -m benchmarks.bench_offload --device cuda --profile
  want checkpoint && step python3 benchmarks/bench_checkpoint.py --device cuda --size-gib "${CKPT_GIB:-4}" --url "$ckpt"
  cases=""; for c in ${ASYNC_CASES:-16x4096 16x8192}; do cases="$cases --case $c"; done
  want async && step python3 benchmarks/bench_async_save.py --device cuda $cases --gpt "$gpt" --snapshot blocking deferred --url "$ckpt" ${ASYNC_ARGS:-}
  # The deferred snapshot: save() blocked ms/GiB, offload on and off; next step / no-save step.
  want deferred && step python3 -m benchmarks.bench_async_save --device cuda --case "${DEFERRED_CASE:-16x4096}" --snapshot deferred --rounds 3 --url "$ckpt" ${ASYNC_ARGS:-}
  # load() into CUDA tensors / the physical path, hot and cold, fresh process.
  want resume && step python3 -m benchmarks.bench_resume --device cuda --size-gib "${CKPT_GIB:-4}" --dir "$ckpt" --layouts many --methods physical load --processes fresh --rounds 3 ${RESUME_ARGS:-}
  # A memory snapshot every step for 200 steps: median and p99 step / no saves, saves dropped.
  want every-step && step python3 -m benchmarks.bench_memory_tier overhead --device cuda --case 16x4096 --offload on off --snapshot deferred --every 1 --steps 200 ${MEMORY_ARGS:-}
  # Memory-tier restore / cold and hot local disk, 4 and 8 GiB (shrunk to what fits, saying so).
  want tier-restore && step python3 -m benchmarks.bench_memory_tier restore --world 1 --node-size 1 --device cuda --size-gib 4 8 ${MEMORY_ARGS:-}
  if want memory; then
    step python3 -m benchmarks.bench_memory_tier restore --world 1 --node-size 1 --device cuda --size-gib "${CKPT_GIB:-4}"
    step python3 -m benchmarks.bench_memory_tier overhead --device cuda --case 16x4096 --gpt "$gpt" --offload on --every 1 2 4 8 --steps 30 ${MEMORY_ARGS:-}
  fi
fi
exit $rc
