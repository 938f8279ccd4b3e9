#!/usr/bin/env bash
# The GPU benchmark and test stages, one or a few per invocation, each under its own time limit:
#     bash tools/gpu_sweep.sh STAGE [STAGE ...]
# Stages (each under its own time limit, logged to $OUT/<stage>.log; a failing stage does not stop the next):
#   fa4part DIR   copy the FA4 parts and wheels carried in DIR (ignored, e.g. .fa4a) to /tmp/fa4 on the machine
#   tritonpart DIR  copy the parts of a carried Triton (an xz tarball of its package, split: DIR/t*.part*) to
#                 /tmp/tritonparts; tritoninstall joins and extracts them into /tmp/triton_site, which every later
#                 stage of this invocation and of later calls with ALT_TRITON=1 imports before the image's Triton
#   toolchain     the toolchain tests (a real Gluon build failure, the fallback) and the kernel GPU tests
#   install       pip install the carried wheels (.whl/*.whl, /tmp/fa4 joined) into /tmp/site (--no-deps)
#   tests         the GPU tests (pytest -n 8 over the kernel test files)
#   kernels       the kernel benchmarks with their FA4 / cuDNN / sageattention baselines (SPARSE_BENCH=0: the
#                 8-bit ones only)
#   pipeline | generation | cold   the whole-generation benchmarks
#   keypad        HunyuanVideo's key-padded joint attention beside stock SDPA with the mask (bench_key_padding)
#   other stages: e2e, e2e75 (bench_e2e at 32K/75K), c128, ladder, sparseab, sparseab75, sparse90 (the Gluon
#   gather kernel vs the Triton one, cuDNN and FA3 bf16; SPARSE90_ARGS e.g. --configs default,128/2), soak,
#   cp (two GPUs), gputests, gpukey, vsmooth (A/B), sm90 (the Gluon kernel vs FA3 FP8), overhead,
#   pkg (NVML, enable(), package tests)
# Results: benchmarks/results/*.csv are copied to $OUT/results after every stage.
# Environment: VC_COMMIT names the commit in the rows (where the checkout's .git is absent or stale).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/vc_out}
mkdir -p "$OUT/results" /tmp/fa4 /tmp/site
touch /tmp/gpu_sweep.start
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
[ "${ALT_TRITON:-0}" = 1 ] && export PYTHONPATH=/tmp/triton_site:$PYTHONPATH
export PYTHONUNBUFFERED=1
export VC_COMMIT=${VC_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
PY=${PYTHON:-python3}
export PY  # stages run through bash -c read it

run_stage() {  # name limit_s command...
  local name=$1 lim=$2; shift 2
  local t0=$SECONDS
  echo "=== $name: start $(date -u +%T), limit ${lim} s"
  if [ "$(type -t "$1")" = function ]; then  # timeout runs programs: a function goes through bash -c
    export -f "$1"; export PY OUT
    set -- bash -c "$*"
  fi
  timeout "$lim" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc after $((SECONDS - t0)) s"
  grep -v -E "Warning|warn\(|^\s*$|PASSED|SKIPPED" "$OUT/$name.log" | tail -n "${TAIL:-25}"
  grep -E "FAILED|ERROR" "$OUT/$name.log" | sort -u | head -n 30
  # only the result files this stage touched, so that $OUT holds what changed
  find benchmarks/results -name '*.csv' -newer /tmp/gpu_sweep.start -exec cp {} "$OUT/results/" \;
  return 0
}

install_wheels() {
  shopt -s nullglob
  # FA4's CuTe DSL libraries (nvidia-cutlass-dsl-libs-cu13, a 92 MB wheel) come as an xz tarball of the
  # wheel's contents split in parts (cu13xz.part*, 63 MB in all; fa4part DIR copies them in), extracted AFTER
  # pip: pip --target --upgrade replaces a top-level folder it installs into (nvidia_cutlass_dsl), which wiped
  # the libraries when they were extracted first. cuda-bindings is not among the wheels: the image has it.
  local wheels=(.whl/*.whl /tmp/fa4/*.whl)
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "${wheels[@]}" 2>&1 | grep -v -i warning
  local parts=(/tmp/fa4/cu13xz.part*)
  if [ ${#parts[@]} -ge 2 ]; then
    cat "${parts[@]}" | tar xJf - -C /tmp/site && echo "cutlass-dsl cu13 libraries extracted"
    [ -e /tmp/fa4/cu13_distinfo.tar ] && tar xf /tmp/fa4/cu13_distinfo.tar -C /tmp/site
  fi
  $PY -c "import diffusers, sageattention; print('diffusers', diffusers.__version__)"
  $PY -c "from flash_attn.cute import flash_attn_func; print('flash-attn-4 ok')"
}

kernels() {  # the kernel benchmarks and their baselines (FA4 rows where installed)
  $PY -m benchmarks.bench_vsmooth_attn --quick
  [ "${SPARSE_BENCH:-1}" = 1 ] && $PY -m benchmarks.bench_sparse_attn --quick --no-sweep
  return 0
}

GPU_TESTS="tests/methods/test_anchor.py tests/kernels/test_anchor_mass.py tests/kernels/test_topk.py
  tests/kernels/test_finite_flags.py tests/methods/test_mcsparse_guard.py tests/methods/test_mcsparse_warmup.py
  tests/kernels/test_vsmooth_attn_sm90.py tests/kernels/test_vsmooth_attn.py tests/kernels/test_sparse_attn.py
  tests/kernels/test_preprocess.py tests/kernels/test_kmeans.py tests/kernels/test_pddp.py tests/kernels/test_select.py
  tests/tune/test_tune_lookup.py tests/methods/test_mcsparse_ladder.py tests/runtime/test_steps.py
  tests/passes/test_rope_fuse.py tests/test_ops.py tests/test_key_padding.py tests/tune/test_speed_gate.py"

while [ $# -gt 0 ]; do
  case $1 in
    fa4part) cp "$2"/cu13xz.part* "$2"/*.whl "$2"/*.tar /tmp/fa4/ 2>/dev/null; ls -la /tmp/fa4; shift ;;
    tritonpart) mkdir -p /tmp/tritonparts && cp "$2"/*.part* /tmp/tritonparts/ && ls -la /tmp/tritonparts; shift ;;
    tritoninstall)
      rm -rf /tmp/triton_site && mkdir -p /tmp/triton_site
      cat /tmp/tritonparts/*.part* | xz -dc | tar xif - -C /tmp/triton_site  # parts may hold several tarballs
      export PYTHONPATH=/tmp/triton_site:$PYTHONPATH
      $PY -c "import triton, torch; print('triton', triton.__version__, triton.__file__, 'torch', torch.__version__)" ;;
    toolchain) run_stage toolchain "${TOOLCHAIN_S:-300}" $PY -m pytest -n 8 -v -p no:cacheprovider -rfE --timeout 200 \
                 tests/test_toolchain.py tests/kernels/test_vsmooth_attn_sm90.py \
                 tests/kernels/test_sparse_attn_sm90.py tests/kernels/test_launch.py tests/kernels/test_programs.py \
                 ${TOOLCHAIN_K:+-k "$TOOLCHAIN_K"} ;;
    install) run_stage install 240 install_wheels ;;
    tests) run_stage tests "${TESTS_S:-240}" $PY -m pytest -n 8 -v -p no:cacheprovider -rfE --timeout 150 \
             ${TESTS_K:+-k "$TESTS_K"} ${TESTS_FILES:-$GPU_TESTS} ;;
    kernels) run_stage kernels "${KERNELS_S:-300}" kernels ;;
    pipeline) run_stage pipeline "${PIPELINE_S:-560}" $PY -m benchmarks.bench_pipeline \
                --budget $(( ${PIPELINE_S:-560} - 30 )) ${PIPELINE_ARGS:-} ;;
    generation) run_stage generation "${GENERATION_S:-300}" $PY -m benchmarks.bench_generation \
                  --budget $(( ${GENERATION_S:-300} - 20 )) ${GENERATION_ARGS:-} ;;
    cold) run_stage cold "${COLD_S:-400}" $PY -m benchmarks.bench_cold_start ${COLD_ARGS:-} ;;
    keypad) run_stage keypad "${KEYPAD_S:-300}" $PY -m benchmarks.bench_key_padding ${KEYPAD_ARGS:-} ;;
    e2e)
      run_stage demo 260 $PY -m vc_compile.demo --regional --out "$OUT/demo"
      run_stage e2e32k 270 $PY -m benchmarks.bench_e2e --sizes 32k --regional --csv "$OUT/bench_e2e.csv" ;;
    e2e75)
      run_stage e2e75k 400 $PY -m benchmarks.bench_e2e --sizes 75k --regional --csv "$OUT/bench_e2e.csv" ;;
    c128)  # MC-Sparse with C = 128 query groups against the C = 64 default, plus V-Smooth, at 16K
      run_stage c128 300 $PY -m benchmarks.bench_e2e --sizes 16k --regional --no-floor \
        --methods vsmooth,vsmooth+expcast,mcsparse@0.15,mcsparse-c128@0.15,mcsparse@0.25,mcsparse-c128@0.25 \
        --csv "$OUT/bench_e2e.csv" ;;
    ladder)
      run_stage ladder16k 170 $PY -m benchmarks.bench_e2e --sizes 16k --ladder --regional \
        --csv "$OUT/bench_e2e.csv" ;;
    sparseab)
      run_stage sparseab 260 $PY -m benchmarks.bench_sparse_attn --ab --budget 200 \
        --csv "$OUT/bench_sparse_attn.csv" ;;
    sparseab75)
      run_stage sparseab75 200 $PY -m benchmarks.bench_sparse_attn --ab --sizes 75600 --budget 150 \
        --group-sizes 128 --ab-switches base,kvoff \
        --csv "$OUT/bench_sparse_attn.csv" ;;
    sparse90)
      run_stage sparse90 "${SPARSE90_S:-240}" $PY -m benchmarks.bench_sparse_attn_sm90 ${SPARSE90_ARGS:-} ;;
    soak)
      run_stage soak 170 $PY -m benchmarks.bench_soak --generations 60 --steps 6 --seq 4096 --alt-seq 3072 \
        --heads 8 --dim 1024 --cfg --plot "$OUT/soak_cuda.png" ;;
    cp)
      run_stage cp 380 torchrun --nproc-per-node 2 -m benchmarks.bench_context_parallel --diffusers \
        --csv "$OUT/bench_context_parallel.csv" ;;
    gputests)
      run_stage gputests 210 $PY -m pytest -q -n 8 --timeout 170 -p no:cacheprovider -rfE \
        tests/kernels/test_vsmooth_attn.py tests/kernels/test_preprocess.py tests/kernels/test_sparse_attn.py \
        tests/test_hostile.py tests/tune/test_tune_lookup.py tests/kernels/test_kmeans.py tests/kernels/test_pddp.py \
        tests/kernels/test_select.py tests/methods/test_mcsparse_ladder.py tests/test_ops.py tests/runtime/test_steps.py \
        $(ls tests/passes/test_rope_fuse.py 2>/dev/null) ;;
    gpukey)  # the GPU-only tests and the hostile suite's kernel cases (gputests in full does not fit a call)
      run_stage gpukey 140 $PY -m pytest -q -n 8 --timeout 130 -p no:cacheprovider -rfE \
        tests/tune/test_tune_lookup.py tests/kernels/test_vsmooth_attn.py tests/kernels/test_sparse_attn.py \
        tests/kernels/test_preprocess.py tests/passes/test_rope_fuse.py tests/kernels/test_kmeans.py \
        tests/kernels/test_pddp.py tests/kernels/test_select.py tests/methods/test_mcsparse_ladder.py \
        tests/test_hostile.py -k "gpu or cuda or kernels" ;;
    vsmooth)
      run_stage vsmooth 170 $PY -m benchmarks.bench_vsmooth_attn --quick --ab --ab-plan ws ;;
    sm90)  # the Gluon kernel alone beside FA3 FP8 / torchao / cuDNN (its default and SM90_CONFIGS' launches)
      run_stage sm90 "${SM90_S:-300}" $PY -m benchmarks.bench_vsmooth_attn_sm90 \
        --shapes "${SM90_SHAPES:-40x32760x128,40x75600x128}" --configs "${SM90_CONFIGS:-[]}" ;;
    overhead)  # host time, launches and GPU time of reuse calls beside stock SDPA (the speed gate's rows)
      run_stage overhead "${OVERHEAD_S:-300}" $PY -m benchmarks.bench_op_overhead ${OVERHEAD_ARGS:-} ;;
    pkg)
      run_stage pkg 240 bash -c '$PY -c "from vc_compile import nvml; print(nvml.limits(0)); print(nvml.state(0))"
        $PY -c "from vc_compile.tune.cache import current_arch as a, cache_dir as d; print(a().dirname, d())"
        $PY -m pytest -q -p no:cacheprovider tests/test_pipeline.py tests/runtime/test_pipeline_calls.py \
          tests/test_package.py' ;;
    pack)  # everything under $OUT in one archive (a run returns a limited number of files)
      (cd "$OUT" && tar czf /tmp/pack.tgz --exclude=pack.tgz . && find . -mindepth 1 -delete && mv /tmp/pack.tgz .)
      ls -la "$OUT" ;;
    *) echo "unknown stage $1"; exit 2 ;;
  esac
  shift
done
