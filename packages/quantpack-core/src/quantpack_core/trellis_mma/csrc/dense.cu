// The dense route for many rows: a shard's weight matrix rebuilt once per call in the model dtype, then one cuBLAS
// GEMM (ops.py), so that the decode's cost is paid once per weight instead of once per weight and row block.
//
// The layer computes y = had128(had128(x * suh) / sqrt(128) @ What) / sqrt(128) * svh per 128-column block (linear.cuh,
// finish_block; common.cuh, input_transform). Both transforms and both scales fold into the weights:
//   W[i][c] = suh[i] * svh[c] / 128 * (H What_b H)[i][c]    (H: the 128-point Sylvester matrix, What_b: a 128 x 128
//                                                           block of the decoded trellis, i and c inside the block)
// so y = x @ W. One CTA rebuilds one 128 x 128 block: each warp decodes its column of 8 tiles into shared memory
// (float), a warp per k row transforms the row (H on the right, svh), a warp per column transforms the column (H on
// the left, suh) and writes it as a row of W^T, (columns, k) with k contiguous: the layout a linear layer's weight
// has, which the GEMM reads transposed.
//
// A warp's 128 values of a row or column are held as index i * 32 + lane of register i, where fwht128 expects
// lane * 4 + i: the two indices differ by a permutation of the index bits, under which the Sylvester matrix is
// unchanged (H[a][b] = (-1)^popcount(a & b)), so the transform is the same, and these loads hit 32 distinct banks.

#include "common.cuh"

namespace qp {

constexpr int DENSE_STRIDE = BLOCK_N + 1;  // floats per row of the CTA's block in shared memory
constexpr int DENSE_SMEM = BLOCK_N * DENSE_STRIDE * 4;

struct DenseParams {
    const uint8_t* trellis;  // the shard's (k/16, n/16, tile bytes)
    const __half* suh;       // (k,)
    const __half* svh;       // (n,)
    void* w;                 // (cols, k) model dtype: W^T of columns [nb0 * 128, + cols)
    int k, n;                // the shard's stored input and output features
    int nb0;                 // the first column block rebuilt
    int cols;                // columns written (the last block may be cut)
    int bf16;
};

template <int CB, int KA, bool HALFK>
__device__ __forceinline__ void dense_decode(const DenseParams& p, float* S, int nb, int kb) {
    using T = Tile<KA, HALFK>;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int widx[T::NORM + 1], shift;
    lane_window<KA, HALFK>(lane, widx, shift);
    const int r0 = 2 * (lane % 4), c0 = warp * 16 + lane / 4;
    const size_t ntiles_n = p.n / 16;
    const uint8_t* column = p.trellis + ((size_t)kb * 8 * ntiles_n + nb * 8 + warp) * T::BYTES;
#pragma unroll
    for (int t = 0; t < 8; ++t) {
        uint32_t b[4];
        decode_lane<CB, KA, HALFK>(reinterpret_cast<const uint32_t*>(column + t * ntiles_n * T::BYTES), widx, shift,
                                   b);
        // b[h]: k rows r0 (+1) (+8 for odd h) of column c0 (+8 for h >= 2), low half first (the B fragment)
#pragma unroll
        for (int h = 0; h < 4; ++h) {
            const __half2 pair = *reinterpret_cast<const __half2*>(&b[h]);
            const int r = t * 16 + r0 + 8 * (h & 1), c = c0 + 8 * (h >> 1);
            S[r * DENSE_STRIDE + c] = __low2float(pair);
            S[(r + 1) * DENSE_STRIDE + c] = __high2float(pair);
        }
    }
}

// One 128 x 128 block of W: column block p.nb0 + blockIdx.x, k block blockIdx.y.
template <int CB, int KA, bool HALFK>
__global__ void __launch_bounds__(THREADS) trellis_dense_kernel(const DenseParams p) {
    extern __shared__ float S[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int nb = p.nb0 + blockIdx.x, kb = blockIdx.y;
    dense_decode<CB, KA, HALFK>(p, S, nb, kb);
    __syncthreads();
    for (int r = warp; r < BLOCK_N; r += WARPS) {  // rows: What_b H, times svh / sqrt(128)
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = S[r * DENSE_STRIDE + i * 32 + lane];
        fwht128(v, lane);
#pragma unroll
        for (int i = 0; i < 4; ++i)
            S[r * DENSE_STRIDE + i * 32 + lane] = v[i] * HAD_SCALE * __half2float(p.svh[nb * BLOCK_N + i * 32 + lane]);
    }
    __syncthreads();
    for (int c = warp; c < BLOCK_N; c += WARPS) {  // columns: H (...), times suh / sqrt(128), as a row of W^T
        const int row = blockIdx.x * BLOCK_N + c;
        if (row >= p.cols) break;
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = S[(i * 32 + lane) * DENSE_STRIDE + c];
        fwht128(v, lane);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int k = kb * BLOCK_N + i * 32 + lane;
            store_act(p.w, (size_t)row * p.k + k, v[i] * HAD_SCALE * __half2float(p.suh[k]), p.bf16);
        }
    }
}

template <int CB, int KA, bool HALFK>
int dense_launch(const DenseParams& p, cudaStream_t s) {
    static int configured[64] = {};  // per device
    int device = 0;
    cudaError_t e = cudaGetDevice(&device);
    if (e != cudaSuccess) return (int)e;
    if (!configured[device & 63]) {
        e = cudaFuncSetAttribute(trellis_dense_kernel<CB, KA, HALFK>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 DENSE_SMEM);
        if (e != cudaSuccess) return (int)e;
        configured[device & 63] = 1;
    }
    const dim3 grid((p.cols + BLOCK_N - 1) / BLOCK_N, p.k / BLOCK_N);
    trellis_dense_kernel<CB, KA, HALFK><<<grid, THREADS, DENSE_SMEM, s>>>(p);
    return (int)cudaGetLastError();
}

}  // namespace qp

// W^T of one shard's columns [col0, col0 + cols) (col0 a multiple of 128) into w, (cols, k) in the model dtype
// (bf16 or fp16), row stride k: y[:, col0:col0 + cols] = x @ w.T (see the file's head). Returns 0, -1 (bad
// geometry), -2 (no such K), -3 (bad codebook) or a CUDA error code.
QP_API int qp_trellis_dense(const void* trellis, const void* suh, const void* svh, void* w, int k, int n, int col0,
                            int cols, int codebook, int k2, int bf16, void* stream) {
    if (cols <= 0) return 0;
    if (k <= 0 || n <= 0 || k % 128 || n % 128 || col0 % 128 || col0 < 0 || col0 + cols > n) return -1;
    const qp::DenseParams p{static_cast<const uint8_t*>(trellis), static_cast<const __half*>(suh),
                            static_cast<const __half*>(svh), w, k, n, col0 / qp::BLOCK_N, cols, bf16};
    return qp::with_codebook_k(codebook, k2, [&](auto cb, auto ka, auto half) {
        return qp::dense_launch<decltype(cb)::value, decltype(ka)::value, decltype(half)::value>(
            p, static_cast<cudaStream_t>(stream));
    });
}
