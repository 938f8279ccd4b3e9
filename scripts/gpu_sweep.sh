#!/usr/bin/env bash
# One device call = one stage of the H200 measurement sweep (the numbers in docs/status.md came from
# these).  Usage on the device machine, from the repo root, with the carried wheels in .whl/:
#     VC_COMMIT=<sha> bash scripts/gpu_sweep.sh <stage> [<stage> ...]
# Stages: e2e (demo table + end-to-end at 32K), e2e75 (end-to-end at 75K), soak (GPU memory over many
# generations), cp (two GPUs: Ulysses benchmark), tune (issue 8 start-up times and tuned-vs-shipped),
# ladder (issue 5: MC-Sparse Table-5 ablation ladder at 16K, s = 0.15 and 0.25, 50 steps),
# sparseab / sparseab75 (issue 5: the gather kernel's switch x config A/B at S = 32760 / 75600),
# pkg (issue 24: NVML fields and the tuning key on the GPU, then the enable()/package tests).
# Each stage has its own time limit so that one slow stage still leaves the others' results in $OUT.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
touch /tmp/gpu_sweep.start
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
stage() {  # stage <name> <seconds> <command...>: log to $OUT/<name>.log, keep going on failure
  local name=$1 secs=$2; shift 2
  echo "=== $name ($(date -u +%T), limit ${secs}s): $*"
  local t0=$SECONDS
  timeout --signal=INT --kill-after=20 "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0)) s"; tail -n 40 "$OUT/$name.log"
}
for s in "$@"; do
  case $s in
    e2e)
      stage demo 260 python3 -m vc_compile.demo --regional --out "$OUT/demo"
      stage e2e32k 270 python3 -m benchmarks.bench_e2e --sizes 32k --regional --csv "$OUT/bench_e2e.csv" ;;
    e2e75)
      stage e2e75k 400 python3 -m benchmarks.bench_e2e --sizes 75k --regional --csv "$OUT/bench_e2e.csv" ;;
    c128)  # issue 5: MC-Sparse with C = 128 query groups against the C = 64 default, plus V-Smooth, at 16K
      stage c128 300 python3 -m benchmarks.bench_e2e --sizes 16k --regional --no-floor \
        --methods vsmooth,vsmooth+expcast,mcsparse@0.15,mcsparse-c128@0.15,mcsparse@0.25,mcsparse-c128@0.25 \
        --csv "$OUT/bench_e2e.csv" ;;
    ladder)
      stage ladder16k 170 python3 -m benchmarks.bench_e2e --sizes 16k --ladder --regional \
        --csv "$OUT/bench_e2e.csv" ;;
    sparseab)
      stage sparseab 260 python3 -m benchmarks.bench_sparse_attn --ab --budget 200 \
        --csv "$OUT/bench_sparse_attn.csv" ;;
    sparseab75)
      stage sparseab75 200 python3 -m benchmarks.bench_sparse_attn --ab --sizes 75600 --budget 150 \
        --group-sizes 128 --ab-switches base,kvoff \
        --csv "$OUT/bench_sparse_attn.csv" ;;
    soak)
      stage soak 170 python3 -m benchmarks.bench_soak --generations 60 --steps 6 --seq 4096 --alt-seq 3072 \
        --heads 8 --dim 1024 --cfg --plot "$OUT/soak_cuda.png" ;;
    cp)
      stage cp 380 torchrun --nproc-per-node 2 -m benchmarks.bench_context_parallel --diffusers \
        --csv "$OUT/bench_context_parallel.csv" ;;
    gputests)
      stage gputests 210 python3 -m pytest -q -n 8 --timeout 170 -p no:cacheprovider -rfE \
        tests/test_vsmooth_attn.py tests/test_preprocess.py tests/test_sparse_attn.py tests/test_hostile.py \
        tests/test_tune_lookup.py tests/test_kmeans.py tests/test_pddp.py tests/test_select.py \
        tests/test_mcsparse_ladder.py tests/test_ops.py tests/test_steps.py $(ls tests/test_rope_fuse.py 2>/dev/null) ;;
    gpukey)  # the GPU-only tests and the hostile suite's kernel cases (gputests in full does not fit a call)
      stage gpukey 140 python3 -m pytest -q -n 8 --timeout 130 -p no:cacheprovider -rfE \
        tests/test_tune_lookup.py tests/test_vsmooth_attn.py tests/test_sparse_attn.py tests/test_preprocess.py \
        tests/test_rope_fuse.py tests/test_kmeans.py tests/test_pddp.py tests/test_select.py \
        tests/test_mcsparse_ladder.py tests/test_hostile.py -k "gpu or cuda or kernels" ;;
    vsmooth)
      stage vsmooth 170 python3 -m benchmarks.bench_vsmooth_attn --quick --ab --ab-plan ws ;;
    preprocess)
      stage preprocess 80 python3 -m benchmarks.bench_preprocess --budget 70 --csv "$OUT/bench_preprocess.csv" ;;
    tune)
      stage tune 140 python3 -m benchmarks.bench_tune --methods vsmooth --budget 130 --csv "$OUT/bench_tune.csv" ;;
    pkg)
      stage pkg 240 bash -c 'python3 -c "from vc_compile import nvml; print(nvml.limits(0)); print(nvml.state(0))"
        python3 -c "from vc_compile.tune.cache import current_arch as a, cache_dir as d; print(a().dirname, d())"
        python3 -m pytest -q -p no:cacheprovider tests/test_pipeline.py tests/test_pipeline_calls.py \
          tests/test_package.py' ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
done
# rows appended in the device's repo copy: bring back the result files this call touched (the device
# returns a limited number of files, so not all of them; COPY_RESULTS=0 when every stage has --csv)
if [ "${COPY_RESULTS:-1}" = 1 ]; then mkdir -p "$OUT/results" && find benchmarks/results -name '*.csv' -newer /tmp/gpu_sweep.start -exec cp {} "$OUT/results/" \; ; fi
