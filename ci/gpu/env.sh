# Environment of every GPU-tier step (source it). See ci/gpu/README.md.
# the checkout's sources come first, so a run tests the code that travelled with it; the installed wheels under
# /tmp/site still provide the plugin's entry point (its dist-info)
_qp_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# (/tmp/ext-prebuilt holds exllamav3_ext.so when a prebuilt one travelled, see setup.sh)
_qp_src=$_qp_root/packages/quantpack-core/src:$_qp_root/packages/quantpack-exl3/src:$_qp_root/packages/quantpack-escha-rocm/src:$_qp_root/packages/quantpack-families/src
export PYTHONPATH=$_qp_src:/tmp/site:/tmp/ext-prebuilt${PYTHONPATH:+:$PYTHONPATH}
export PATH=/tmp/site/bin:$PATH
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/torch_ext
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 VLLM_DO_NOT_TRACK=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# the GPU tier's folder of pytest reports (JUnit XML, the runs' own) and records (records/, read by
# ci/gpu/matrix_table.py): QUANTPACK_GPU_RESULTS, default /tmp/gpu-matrix, made absolute and created
gpu_matrix_dir() {
  local dir
  dir=$(realpath -m "${QUANTPACK_GPU_RESULTS:-/tmp/gpu-matrix}")
  mkdir -p "$dir"
  echo "$dir"
}
# the report path of one pytest run there: vllm-<release>-<time>[-<step>].xml
gpu_report() {
  local release
  release=$(python3 "$_qp_root/ci/gpu/matrix_table.py" --release 2>/dev/null || echo none)
  echo "$(gpu_matrix_dir)/vllm-$release-$(date +%Y%m%d-%H%M%S)${1:+-$1}.xml"
}
# the card a report's tests ran on, as pytest's option naming the report's test suite:
# -o 'junit_suite_name=gpu NVIDIA H100 80GB HBM3'; nothing where nvidia-smi names no card
gpu_card_opt() {
  local card
  card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  [ -z "$card" ] || echo "-o 'junit_suite_name=gpu $card'"
}
# where the GPU tests write their records (tests/gpu_records.py): the reports' folder's records/ unless set
export QUANTPACK_GPU_RECORDS=${QUANTPACK_GPU_RECORDS:-$(realpath -m "${QUANTPACK_GPU_RESULTS:-/tmp/gpu-matrix}")/records}
# the commit the records name: a snapshot's (ci/gpu/snapshot.sh: .quantpack-commit in its copy, .stage/head/commit
# beside the checkout it travelled with), else git's where the tree is a clone (tests/gpu_records.py asks it)
for _qp_commit in "$_qp_root/.quantpack-commit" "$_qp_root/.stage/head/commit"; do
  if [ -z "${QUANTPACK_COMMIT:-}" ] && [ -f "$_qp_commit" ]; then
    export QUANTPACK_COMMIT=$(cat "$_qp_commit")
  fi
done
unset _qp_commit
