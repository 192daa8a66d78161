#!/usr/bin/env bash
# The GPU measurements and tests still owed, in priority order, each step's log and record under /tmp/pending
# (GPU machine, repo root, after ci/gpu/setup.sh has unpacked vLLM and loaded the extension). Start it detached and
# collect its results in later calls, each of which returns what exists so far:
#   ci/gpu/bg.sh start pending bash ci/gpu/pending.sh [STEP...]
#   ci/gpu/bg.sh wait 540 pending; ci/gpu/pending.sh --collect      # -> $OUT/pending.tgz
# With no STEP, every step runs in the order below; see ci/gpu/README.md for the times measured.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
source ci/gpu/env.sh
res=/tmp/pending
mkdir -p "$res"
# every pytest step's report also goes to the GPU matrix's folder, named by the release, and its tests' records under
# its records/ (QUANTPACK_GPU_RECORDS, ci/gpu/env.sh; each run's folder named by the step: ci/gpu/matrix_table.py)
matrix=$(gpu_matrix_dir)
if [ "${1:-}" = "--collect" ]; then
  ci/gpu/bg.sh copy "$res" pending 2>/dev/null
  tar czf "${OUT:-/tmp}/pending.tgz" -C /tmp pending -C "$(dirname "$matrix")" "$(basename "$matrix")"
  exit 0
fi
# the bundled packs every test step reads (ci/gpu/snapshot.sh copies them whole, or not at all)
if [ ! -f fixtures/README.md ] || [ ! -d fixtures/tools ]; then
  echo "pending.sh: no fixtures/ beside the code in $root: make the copy with ci/gpu/snapshot.sh DEST" >&2
  exit 2
fi
T=(python3 -m pytest -rA -p no:cacheprovider --durations=5 -m gpu -q)  # -rA: passing tests' figures too
step() {
  local name=$1 dir=${logs:-$res}
  shift
  echo "=== $name $(date +%T)"
  QUANTPACK_GPU_STEP=$name PYTEST_ADDOPTS="--junitxml=$(gpu_report "$name") $(gpu_card_opt)" "$@" > "$dir/$name.log" 2>&1
  echo "=== $name rc=$? $(date +%T)"
  tail -15 "$dir/$name.log"
}
# one Nsight Compute report of one shard's kernel (KERNEL regex, SHAPE in,out, ROWS), with the stall reasons per
# issued instruction (where the issue slots between a warp's instructions go)
ncu_shard() {
  QUANTPACK_TRELLIS_MMA_DELEGATE_ROWS=0 /usr/local/cuda/bin/ncu --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section SchedulerStats --section WarpStateStats --section LaunchStats --section Occupancy \
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
    -k "regex:$1" --profile-from-start off --launch-count 1 python3 benchmarks/profile_shard.py --shape "$2" --rows "$3"
}
# what the machine offers the vision towers (Qwen3.5 VL, Nemotron VL: vLLM's model files import torchvision)
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)
try:
    import torchvision; print('torchvision', torchvision.__version__)
except Exception as e:
    print('torchvision: not importable:', type(e).__name__, e)" > "$res/machine.log" 2>&1
# (the EAGLE draft on CUDA first: its test has not run on a GPU yet; then the matrix: a release's column with its
# bundle staged; 0.22.1 and 0.26.0 passed on 2026-12-05, 0.25.1's column has not run as one step (its files' reports
# come from single steps); the families' columns ran on 2026-12-05; then the escha Triton kernel's time; the last
# steps re-check what passed before)
all=(tier e2e-spec matrix matrix-families escha-times escha-kernel nemotron-vl nemotron-twin e2e-moe serve-moe serve-moe-mixed profile-moe profile
  family-converter families qwen-vl-converter moe-kernels qwen-vl nemotron-moe moe-ungated escha-gpu e2e-dense
  linear-kernels escha-vllm serve-8b kernel-8b kernel-8b-wide ncu split wide-fused ctas kernel-8b-panel)
# the tiny models of the given families (of spark, nemotron-h, nemotron-vl) through exllamav3's own converter, each
# once per machine
family_convert() {
  local want=() f
  for f in "$@"; do [ -f "/tmp/family-exl3/$f-exl3-converter/config.json" ] || want+=("$f"); done
  [ ${#want[@]} -eq 0 ] && return 0
  local fams
  fams=$(IFS=,; echo "${want[*]}")
  step "family-convert-${fams//,/-}" python3 fixtures/tools/make_family_exl3.py --out /tmp/family-exl3 --families "$fams"
  cp /tmp/family-exl3/REPORT.json "$res/family-convert-${fams//,/-}-report.json" 2>/dev/null
  cp /tmp/family-exl3/*-convert.log "$res/" 2>/dev/null
}
for s in "${@:-${all[@]}}"; do
  case $s in
    # trellis_mma's linear kernel against the float64 oracle and exllamav3's error (every K, codebook, bundled pack)
    linear-kernels) step linear-kernels "${T[@]}" -k trellis_mma packages/quantpack-exl3/tests/test_exl3_gpu_kernels.py ;;
    # the 8B stack at rows 1-256, each kernel and as served, beside dense bf16 (benchmarks/results/kernel_8b.json)
    kernel-8b) step kernel-8b python3 benchmarks/kernel_8b.py --json "$res/kernel_8b.json" ;;
    # a layer's shards in one launch and the input transformed once per call (their kernel tests), then the 8B stack
    # with a launch per shard above 16 rows (QUANTPACK_TRELLIS_MMA_WIDE_FUSED=0): wide-fused's baseline
    split)
      step fused-tests "${T[@]}" -k "one_launch or once_per_call" packages/quantpack-exl3/tests/test_exl3_gpu_kernels.py
      step kernel-8b-split env QUANTPACK_TRELLIS_MMA_WIDE_FUSED=0 python3 benchmarks/kernel_8b.py --kernels trellis_mma --rows 1,2,4,8,16,32,64 --no-dense \
        --json "$res/kernel_8b_split.json" ;;
    # above 16 rows with fewer split-K CTAs per SM than the default (fewer partial rows to sum): which default to keep
    kernel-8b-wide)
      for c in 2 3; do
        step "kernel-8b-wide$c" python3 benchmarks/kernel_8b.py --kernels trellis_mma --rows 16,32,64,128,256 \
          --no-dense --ctas-per-sm-wide "$c" --json "$res/kernel_8b_wide$c.json"
      done ;;
    # Nsight Compute reports of the gate shard (4096 -> 14336, K 4 mul1) at 1, 16 and 64 rows and of q at 64 rows
    # (benchmarks/results/ncu/), for the issue-slot, occupancy and bandwidth figures of docs/kernels.md
    ncu)
      for r in 1 16 64; do step "ncu-gate-rows$r" ncu_shard trellis_mma_kernel 4096,14336 "$r"; done
      step ncu-q-rows64 ncu_shard trellis_mma_kernel 4096,4096 64 ;;
    # above 16 rows a layer's shards in one launch (QUANTPACK_TRELLIS_MMA_WIDE_FUSED, the default since 2026-12-03; its
    # tests in the split step) against a launch per shard (kernel-8b-split of the split step, which sets it to 0)
    wide-fused) step kernel-8b-wide-fused env QUANTPACK_TRELLIS_MMA_WIDE_FUSED=1 python3 benchmarks/kernel_8b.py \
      --kernels trellis_mma --rows 32,64,128 --no-dense --json "$res/kernel_8b_wide_fused.json" ;;
    # up to 16 rows with 5 and 6 CTAs per SM as split-K target instead of 4 (the one-row kernel's panel holds one row
    # since 2026-12-03, later: 25 KB of shared memory instead of 49, so 5 fit; the 2-16-row kernel fits 6): which default
    ctas)
      for c in 5 6; do
        step "kernel-8b-ctas$c" python3 benchmarks/kernel_8b.py --kernels trellis_mma --rows 1,2,4,8,16 --no-dense \
          --ctas-per-sm "$c" --json "$res/kernel_8b_ctas$c.json"
      done ;;
    # one row with the input transformed once per call (QUANTPACK_TRELLIS_MMA_INLINE_TRANSFORM_ROWS=0) against
    # kernel-8b's in-CTA transform (from two rows on the transform is always once per call): which default to keep
    kernel-8b-panel) step kernel-8b-panel python3 benchmarks/kernel_8b.py --kernels trellis_mma --rows 1 \
      --no-dense --inline-transform-rows 0 --json "$res/kernel_8b_panel.json" ;;
    # the same stack in mcg (the 3INST / mcg decode)
    kernel-8b-mcg) step kernel-8b-mcg python3 benchmarks/kernel_8b.py --codebook mcg --rows 1,16,64 --no-dense \
      --json "$res/kernel_8b_mcg.json" ;;
    # the expert kernels' ungated relu2 banks alone (28 passed, 2026-12-03), and the Nemotron-H pack whose routed
    # relu2 experts are EXL3 through vLLM (eager and graphs, its experts on the EXL3 banks; passed with the family's
    # float16 fix, 2026-12-03)
    moe-ungated) step moe-ungated "${T[@]}" -k ungated packages/quantpack-exl3/tests/test_exl3_gpu_moe.py ;;
    nemotron-moe) QUANTPACK_GPU_JOBS=nemotron-h-moe step nemotron-moe "${T[@]}" \
      packages/quantpack-families/tests/test_families_gpu.py ;;
    # the expert banks through both kernels against the float64 oracle, trellis_mma within 1.1x exllamav3's error
    moe-kernels) step moe-kernels "${T[@]}" packages/quantpack-exl3/tests/test_exl3_gpu_moe.py ;;
    # the vLLM MoE jobs (eager and graphs) with trellis_mma's experts, the CUDA default since its first run
    e2e-moe) QUANTPACK_GPU_JOBS=moe/ step e2e-moe "${T[@]}" packages/quantpack-exl3/tests/test_exl3_gpu_vllm.py ;;
    # the EAGLE draft beside the 4.0 bpw llama pack (two engines, plain and with the draft; not yet run on a GPU)
    e2e-spec) QUANTPACK_GPU_JOBS=spec step e2e-spec "${T[@]}" -k eagle \
      packages/quantpack-exl3/tests/test_exl3_gpu_vllm.py ;;
    # Spark, Flint and the Nemotron-H text tower (EXL3 packs and bf16 twins) in vLLM's CUDA build, eager and graphs
    # and the tiny EXL3 Qwen3.5 vision tower in vLLM's own Qwen3_VisionTransformer
    families) step families "${T[@]}" packages/quantpack-families/tests/test_qwen_vision_gpu.py \
      packages/quantpack-families/tests/test_families_gpu.py ;;
    # Nemotron-H's bf16 twin, KL 4.6 with compile + graphs until it passed on 2026-12-03 (night): compiled without
    # graphs, piecewise graphs only, and vLLM's default, each as a fresh process's only engine
    nemotron-twin)
      # vLLM's default graphs for the twin and the copy named as the EXL3 pack (layers_block_type) passed on
      # 2026-12-03 (night); NONE gave KL 4.6 and PIECEWISE 5.5e-6 on 2026-12-04 (evening). Still owed, each a fresh
      # process's only engine: FULL_AND_PIECEWISE; the default mode with capture sizes below the 128-token prompt
      # (its compiled pieces then run outside graphs, as under NONE: whether that alone gives the fault); NONE with
      # dynamo's graph split but no inductor (backend "eager": whether inductor's generated code is the fault)
      run_twin() {
        QUANTPACK_GPU_JOBS=nemotron-h-bf16/float16/graphs QUANTPACK_GPU_LLM_KWARGS="$2" \
          step "nemotron-twin-$1" "${T[@]}" -k match packages/quantpack-families/tests/test_families_gpu.py
      }
      run_twin FULL_AND_PIECEWISE '{"compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"}}'
      run_twin small-captures '{"compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8]}}'
      run_twin NONE-eager-backend '{"compilation_config": {"cudagraph_mode": "NONE", "backend": "eager"}}' ;;
    # the tiny Qwen3.5 VL model through exllamav3's own converter (vision tower at 6 bits; its pack keeps the dense
    # fused qkv too), then served by vLLM as the core writer's packs are (passed 2026-12-03 but for the test's layout
    # assumption, since fixed)
    qwen-vl-converter)
      step qwen-vl-convert python3 fixtures/tools/make_qwen_vl_exl3.py --out /tmp/qwen-vl-exl3
      cp /tmp/qwen-vl-exl3/REPORT.json "$res/qwen-vl-convert-report.json" 2>/dev/null
      cp /tmp/qwen-vl-exl3/convert.log "$res/qwen-vl-convert-converter.log" 2>/dev/null
      QUANTPACK_QWEN_VL_CONVERTED=/tmp/qwen-vl-exl3 QUANTPACK_GPU_JOBS=converter \
        step qwen-vl-converter "${T[@]}" packages/quantpack-families/tests/test_qwen_vl_gpu.py ;;
    # the whole tiny Nemotron-3.5-Super-VL pack (EXL3 language tower, RADIO tower with its final LayerNorm) served by
    # vLLM in bfloat16, eager and graphs: text KL and an image + text request's greedy tokens (first run 2026-12-04)
    # (with the converter's pack of the same model beside it, converted first)
    nemotron-vl)
      family_convert nemotron-vl
      QUANTPACK_FAMILY_CONVERTED=/tmp/family-exl3 step nemotron-vl "${T[@]}" \
        packages/quantpack-families/tests/test_nemotron_vl_gpu.py ;;
    # Spark and the Nemotron-H text tower (from the bf16 twins) through exllamav3's own converter, served against
    # their float64 references (passed 2026-12-03; the VL pack's converter job runs in nemotron-vl)
    family-converter)
      family_convert spark nemotron-h
      QUANTPACK_FAMILY_CONVERTED=/tmp/family-exl3 QUANTPACK_GPU_JOBS=converter \
        step family-converter "${T[@]}" packages/quantpack-families/tests/test_families_gpu.py ;;
    # the whole tiny Qwen3.5 VL pack (EXL3 text and vision towers) served by vLLM, both layouts, eager and graphs: text
    # KL and an image + text request's greedy tokens against transformers' dequantized model
    qwen-vl) step qwen-vl "${T[@]}" packages/quantpack-families/tests/test_qwen_vl_gpu.py ;;
    # the converted escha packs in vLLM (eager and graphs) on trellis_mma, and the two-K pack on the Triton kernel
    escha-vllm) step escha-vllm "${T[@]}" packages/quantpack-escha-rocm/tests/test_escha_gpu_vllm.py ;;
    # where the escha Triton kernel's time goes (30-45x the CUDA kernels on the mcg K=2 stack, 2026-12-02): each of
    # its three launches timed per call beside trellis_mma's on the same trellis (torch.profiler), then Nsight
    # Compute of its decode GEMM on the gate shard at one row
    escha-times)
      for kern in escha_triton escha_trellis_mma trellis_mma; do
        step "times-$kern" python3 benchmarks/profile_shard.py --kernel "$kern" --shape 4096,14336 --rows 1,16,64 \
          --k-bits 2 --codebook mcg --repeat 20 --kernel-times
      done
      QUANTPACK_TRELLIS_MMA_DELEGATE_ROWS=0 step ncu-escha-gate-rows1 /usr/local/cuda/bin/ncu --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats --section LaunchStats \
        --section Occupancy --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
        -k regex:gemm_kernel --profile-from-start off --launch-count 1 python3 benchmarks/profile_shard.py \
        --kernel escha_triton --shape 4096,14336 --rows 1 --k-bits 2 --codebook mcg ;;
    # the escha kernels of CUDA against the reference: quantpack-exl3's trellis_mma through the escha backend (first
    # run owed) and the Triton kernel
    escha-gpu) step escha-gpu "${T[@]}" packages/quantpack-escha-rocm/tests/test_escha_gpu.py ;;
    # the escha line of the 8B stack (mcg K=2): escha's trellis_mma backend and Triton kernel beside EXL3's kernels
    escha-kernel) step escha-kernel python3 benchmarks/kernel_8b.py --codebook mcg --layer-k 2 \
        --kernels exllamav3,trellis_mma,escha_trellis_mma,escha_triton --rows 1,64 --no-dense \
        --json "$res/kernel_8b_escha.json" ;;
    # 30B-A3B with three K groups per bank (the issue's mixed-K target: >= 0.9x the uniform pack, run after it)
    serve-moe-mixed) step serve-moe-mixed python3 benchmarks/serve_8b.py --model 30b-a3b-mixed --repeats 1 \
      --json "$res/serve_30b_a3b_mixed.json" ;;
    # 30B-A3B: plugin (trellis_mma experts), plugin-exllamav3 (exl3_mgemm: its capture failure), bf16, GPTQ (Marlin)
    # (SERVE_ENGINES=plugin,bf16 narrows the engines of serve-moe and serve-8b)
    serve-moe) step serve-moe python3 benchmarks/serve_8b.py --model 30b-a3b --repeats 1 ${SERVE_ENGINES:+--engines "$SERVE_ENGINES"} \
      --json "$res/serve_30b_a3b.json" ;;
    # the dense harness's five engines (the forced-exllamav3 one failed on a stale compile cache before its fix)
    serve-8b) step serve-8b python3 benchmarks/serve_8b.py --repeats 1 ${SERVE_ENGINES:+--engines "$SERVE_ENGINES"} \
      --json "$res/serve_8b.json" ;;
    # the dense end-to-end jobs with today's kernels (KL / top-1 against exllamav3's reference logits)
    e2e-dense) QUANTPACK_GPU_JOBS=llama-tiny,qwen3_5,qwen-int8,spec step e2e-dense "${T[@]}" \
      packages/quantpack-exl3/tests/test_exl3_gpu_vllm.py ;;
    # a decode step's device time by kernel group (torch.profiler), plugin against bf16: the 8B shape at batch 1 and
    # 64, then the 30B-A3B MoE shape (what is not an expert: issue 15's evidence at batch 1)
    profile)
      for e in plugin bf16; do
        for b in 1 64; do
          step "profile-8b-$e-b$b" python3 benchmarks/profile_decode.py --engine "$e" --batch "$b" \
            --json "$res/profile_8b_${e}_b$b.json"
        done
      done ;;
    profile-moe)
      for e in plugin bf16; do
        for b in 1 64; do
          step "profile-moe-$e-b$b" python3 benchmarks/profile_decode.py --model 30b-a3b --engine "$e" --batch "$b" \
            --json "$res/profile_30b_a3b_${e}_b$b.json"
        done
      done ;;
    # the whole GPU tier of the vLLM release unpacked, with its records: every GPU test file, vllm serve with its
    # engine in a process of its own (test_exl3_gpu_serve.py), the ring codec against exllamav3's and the Nemotron-H
    # twin in stock vLLM (in test_families_gpu.py), in six lanes side by side (each engine a fixed 2 GiB KV cache, as
    # in matrix), then the TP file (two GPUs; it skips on one). Logs under tier-<release>/. Expected on one H100 or
    # H200: about 12 minutes (the longest lane, the families', took 6.5-9 minutes in three lanes); where time is short
    # drop, in this order, TIER_DROP=escha (the escha files), kernels-exllamav3 (the kernel file's exllamav3 half),
    # converter (exllamav3's converter of the Nemotron VL pack)
    tier) (
      release=$(python3 ci/gpu/matrix_table.py --release)
      if [ -n "${MATRIX_RELEASE:-}" ] && [ "$release" != "$MATRIX_RELEASE" ]; then
        echo "tier: vLLM $release is unpacked, not MATRIX_RELEASE=$MATRIX_RELEASE: no run" >&2
        exit 2
      fi
      logs=$res/tier-$release
      mkdir -p "$logs"
      export QUANTPACK_GPU_LLM_KWARGS=${QUANTPACK_GPU_LLM_KWARGS:-'{"kv_cache_memory_bytes": 2147483648}'}
      drop=",${TIER_DROP:-},"
      X=packages/quantpack-exl3/tests
      F=packages/quantpack-families/tests
      C=packages/quantpack-core/tests
      E=packages/quantpack-escha-rocm/tests
      kernels=("${T[@]}")
      [[ $drop == *,kernels-exllamav3,* ]] && kernels+=(-k trellis_mma)
      (
        QUANTPACK_GPU_JOBS=llama-tiny,spec step tier-e2e-llama "${T[@]}" "$X/test_exl3_gpu_vllm.py"
        step tier-serve "${T[@]}" "$X/test_exl3_gpu_serve.py"
      ) > "$logs/lane-llama-serve.log" 2>&1 &
      (
        QUANTPACK_GPU_JOBS=moe/ step tier-e2e-moe "${T[@]}" "$X/test_exl3_gpu_vllm.py"
        [[ $drop == *,escha,* ]] || step tier-escha-vllm "${T[@]}" "$E/test_escha_gpu_vllm.py"
      ) > "$logs/lane-moe-escha.log" 2>&1 &
      (
        step tier-kernels "${kernels[@]}" "$X/test_exl3_gpu_kernels.py"
        step tier-moe-kernels "${T[@]}" "$X/test_exl3_gpu_moe.py"
        [[ $drop == *,escha,* ]] || step tier-escha-gpu "${T[@]}" "$E/test_escha_gpu.py"
        step tier-core "${T[@]}" "$C/test_ring_codec.py" "$C/test_int8_logits.py"
        QUANTPACK_GPU_JOBS=qwen3_5,qwen-int8 step tier-e2e-qwen "${T[@]}" "$X/test_exl3_gpu_vllm.py"
      ) > "$logs/lane-kernels-qwen.log" 2>&1 &
      step tier-families "${T[@]}" "$F/test_qwen_vision_gpu.py" "$F/test_families_gpu.py" \
        > "$logs/lane-families.log" 2>&1 &
      step tier-qwen-vl "${T[@]}" "$F/test_qwen_vl_gpu.py" > "$logs/lane-qwen-vl.log" 2>&1 &
      (
        if [[ $drop == *,converter,* ]]; then
          step tier-nemotron-vl "${T[@]}" "$F/test_nemotron_vl_gpu.py"
        else
          family_convert nemotron-vl
          QUANTPACK_FAMILY_CONVERTED=/tmp/family-exl3 step tier-nemotron-vl "${T[@]}" "$F/test_nemotron_vl_gpu.py"
        fi
      ) > "$logs/lane-nemotron-vl.log" 2>&1
      wait
      step tier-tp "${T[@]}" "$X/test_exl3_gpu_tp.py" > "$logs/lane-tp.log" 2>&1
      echo "=== tier $release: each step's exit status"
      grep -h "^=== .* rc=" "$logs"/lane-*.log
    ) ;;
    # one vLLM release's column of the GPU matrix (issue: 0.22.1 and 0.26.0 after 0.25.1), three lanes side by side:
    # the Llama end-to-end jobs; the MoE jobs, then the escha packs; the vLLM-free kernel files, then the Qwen3.5 jobs
    # (whose Triton Gated DeltaNet kernels compile on first use). Each engine takes a fixed 2 GiB KV cache
    # (QUANTPACK_GPU_LLM_KWARGS, tests/vllm_e2e.py), so vLLM skips its memory profiling, whose check fails an engine
    # when another lane's process frees GPU memory while it loads; contention only slows the lanes (the load-time row
    # routing may then choose other kernels, each tested correct). With MATRIX_RELEASE set, the step refuses to run
    # on another release (a bundle switch that failed). Each report is named by the release (ci/gpu/matrix_table.py);
    # the logs go under matrix-<release>/ (lane-*.log: each lane's steps and exit statuses), so a second release's
    # column (setup.sh with VLLM_RELEASE) keeps the first's
    matrix) (
      release=$(python3 ci/gpu/matrix_table.py --release)
      if [ -n "${MATRIX_RELEASE:-}" ] && [ "$release" != "$MATRIX_RELEASE" ]; then
        echo "matrix: vLLM $release is unpacked, not MATRIX_RELEASE=$MATRIX_RELEASE: no column run" >&2
        exit 2
      fi
      logs=$res/matrix-$release
      mkdir -p "$logs"
      export QUANTPACK_GPU_LLM_KWARGS=${QUANTPACK_GPU_LLM_KWARGS:-'{"kv_cache_memory_bytes": 2147483648}'}
      E2E=packages/quantpack-exl3/tests/test_exl3_gpu_vllm.py
      (
        step matrix-kernels "${T[@]}" packages/quantpack-exl3/tests/test_exl3_gpu_kernels.py
        step matrix-moe-kernels "${T[@]}" packages/quantpack-exl3/tests/test_exl3_gpu_moe.py
        step matrix-escha-gpu "${T[@]}" packages/quantpack-escha-rocm/tests/test_escha_gpu.py
        QUANTPACK_GPU_JOBS=qwen3_5,qwen-int8 step matrix-e2e-qwen "${T[@]}" "$E2E"
      ) > "$logs/lane-kernels-qwen.log" 2>&1 &
      (
        QUANTPACK_GPU_JOBS=moe/ step matrix-e2e-moe "${T[@]}" "$E2E"
        step matrix-escha-vllm "${T[@]}" packages/quantpack-escha-rocm/tests/test_escha_gpu_vllm.py
      ) > "$logs/lane-moe-escha.log" 2>&1 &
      QUANTPACK_GPU_JOBS=llama-tiny,spec step matrix-e2e-llama "${T[@]}" "$E2E" > "$logs/lane-llama.log" 2>&1
      wait
      echo "=== matrix $release: each step's exit status"
      grep -h "^=== .* rc=" "$logs"/lane-*.log
    ) ;;
    # the families' GPU files in one release's column (the matrix step runs the plugin's files), three lanes side by
    # side as there: Spark, Flint, Nemotron-H and the Qwen3.5 vision tower; the whole Qwen3.5 VL pack; the whole
    # Nemotron VL pack (exllamav3's converter first, about a minute). Written 2026-12-05 after the plugin's files
    # passed on 0.22.1 and 0.26.0; first run that afternoon: 6 minutes (0.22.1) and 8.7 (0.26.0), the families'
    # lane the longest
    matrix-families) (
      release=$(python3 ci/gpu/matrix_table.py --release)
      if [ -n "${MATRIX_RELEASE:-}" ] && [ "$release" != "$MATRIX_RELEASE" ]; then
        echo "matrix-families: vLLM $release is unpacked, not MATRIX_RELEASE=$MATRIX_RELEASE: no column run" >&2
        exit 2
      fi
      logs=$res/matrix-families-$release
      mkdir -p "$logs"
      export QUANTPACK_GPU_LLM_KWARGS=${QUANTPACK_GPU_LLM_KWARGS:-'{"kv_cache_memory_bytes": 2147483648}'}
      F=packages/quantpack-families/tests
      step matrix-families "${T[@]}" "$F/test_qwen_vision_gpu.py" "$F/test_families_gpu.py" \
        > "$logs/lane-families.log" 2>&1 &
      step matrix-qwen-vl "${T[@]}" "$F/test_qwen_vl_gpu.py" > "$logs/lane-qwen-vl.log" 2>&1 &
      (
        family_convert nemotron-vl
        QUANTPACK_FAMILY_CONVERTED=/tmp/family-exl3 step matrix-nemotron-vl "${T[@]}" "$F/test_nemotron_vl_gpu.py"
      ) > "$logs/lane-nemotron-vl.log" 2>&1
      wait
      echo "=== matrix-families $release: each step's exit status"
      grep -h "^=== .* rc=" "$logs"/lane-*.log
    ) ;;
    *) echo "unknown step $s (of: ${all[*]})" >&2 ;;
  esac
done
echo "=== pending done $(date +%T)"
