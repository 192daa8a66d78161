// The dense route for many rows: a shard's weight matrix rebuilt once per call in the model dtype, then one cuBLAS
// GEMM (ops.py), so that the decode's cost is paid once per weight instead of once per weight and row block.
//
// The layer computes y = had128(had128(x * suh) / sqrt(128) @ What) / sqrt(128) * svh per 128-column block (linear.cuh,
// finish_block; common.cuh, input_transform). Both transforms and both scales fold into the weights:
//   W[i][c] = suh[i] * svh[c] / 128 * (H What_b H)[i][c]    (H: the 128-point Sylvester matrix, What_b: a 128 x 128
//                                                           block of the decoded trellis, i and c inside the block)
// so y = x @ W. One CTA rebuilds one 128 x 128 block in three passes, each warp on its own slice:
//   1. decode: each warp decodes its column of 8 tiles into registers; a lane then holds 32 of the 128 k rows of two
//      columns (row bits 0 and 3-6 in its registers, bits 1-2 in lane % 4), so H on the left is five butterfly
//      stages in registers and two across lanes; stored to shared memory (float);
//   2. rows: four lanes per k row, 32 values each (column bits 2-6 in registers, bits 0-1 in lane % 4): H on the
//      right, five stages in registers and two across lanes, back in place;
//   3. columns: one column at a time, a lane's 4 consecutive k values scaled by suh and svh / 128 and written as one
//      8-byte store into a row of W^T, (columns, k) with k contiguous: the layout a linear layer's weight has, which
//      the GEMM reads transposed.
// The Sylvester matrix is unchanged by a permutation of the index bits (H[a][b] = (-1)^popcount(a & b)), so a
// transform may take the bits in any order and from registers or lanes alike. The block sits in shared memory as rows
// of 128 floats with the columns XOR-swizzled by the row (dense_at), under which each pass's loads and stores hit 32
// distinct banks.

#include "common.cuh"

namespace qp {

constexpr int DENSE_SMEM = BLOCK_N * BLOCK_N * 4;  // one 128 x 128 float block

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

// Element (r, c) of the block in shared memory. The swizzle's bits 2-4 follow row bits 0-2 (pass 2: 8 rows x 4
// lanes; pass 1: row bits 1-2 against column bits 0-2) and its bits 0-3 row bits 3-6 (pass 3: rows 4 * lane + i).
__device__ __forceinline__ int dense_at(int r, int c) { return r * BLOCK_N + (c ^ ((((r & 7) << 2) ^ (r >> 3)) & 31)); }

// The Sylvester transform over the index bits of N registers (unnormalized).
template <int N>
__device__ __forceinline__ void fwht_registers(float (&v)[N]) {
#pragma unroll
    for (int h = 1; h < N; h <<= 1) {
#pragma unroll
        for (int i = 0; i < N; ++i) {
            if (i & h) continue;
            const float a = v[i], b = v[i | h];
            v[i] = a + b;
            v[i | h] = a - b;
        }
    }
}

// ... and over lane bits 0-1 (the lane's register i against register i of lanes lane ^ 1, ^ 2, ^ 3). The lower lane
// of a pair keeps v + o, the upper o - v: one FFMA with the lane's sign, the same rounding as the add or subtract
// (a product by +-1 is exact), where the select of both would take three instructions.
template <int N>
__device__ __forceinline__ void fwht_lane_pairs(float (&v)[N], int lane) {
#pragma unroll
    for (int m = 1; m < 4; m <<= 1) {
        const float sign = (lane & m) ? -1.0f : 1.0f;
#pragma unroll
        for (int i = 0; i < N; ++i) v[i] = __fmaf_rn(sign, v[i], __shfl_xor_sync(0xFFFFFFFFu, v[i], m));
    }
}

// Pass 1: the warp's 16 columns of k block kb, H applied over k, into S.
template <int CB, int KA, bool HALFK>
__device__ __forceinline__ void dense_decode(const DenseParams& p, float* S, int nb, int kb) {
    using T = Tile<KA, HALFK>;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int widx[T::NORM + 1], shift;
    lane_window<KA, HALFK>(lane, widx, shift);
    const size_t ntiles_n = p.n / 16;
    const uint8_t* column = p.trellis + ((size_t)kb * 8 * ntiles_n + nb * 8 + warp) * T::BYTES;
    uint32_t b[8][4];  // b[t][h]: tile t's k rows 2 * (lane % 4) (+1) (+8 for odd h), column lane / 4 (+8 for h >= 2)
#pragma unroll
    for (int t = 0; t < 8; ++t)
        decode_lane<CB, KA, HALFK>(reinterpret_cast<const uint32_t*>(column + t * ntiles_n * T::BYTES), widx, shift,
                                   b[t]);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float v[32];  // v[t * 4 + h1 * 2 + e]: k row t * 16 + 8 * h1 + 2 * (lane % 4) + e
#pragma unroll
        for (int t = 0; t < 8; ++t) {
#pragma unroll
            for (int h1 = 0; h1 < 2; ++h1) {
                const __half2 pair = *reinterpret_cast<const __half2*>(&b[t][half * 2 + h1]);
                v[t * 4 + h1 * 2] = __low2float(pair);
                v[t * 4 + h1 * 2 + 1] = __high2float(pair);
            }
        }
        fwht_registers(v);
        fwht_lane_pairs(v, lane);
        const int c = warp * 16 + half * 8 + lane / 4;
#pragma unroll
        for (int q = 0; q < 32; ++q) {
            const int r = (q >> 2) * 16 + ((q >> 1) & 1) * 8 + 2 * (lane % 4) + (q & 1);
            S[dense_at(r, c)] = v[q];
        }
    }
}

// Pass 2: H over the columns of the warp's 16 rows, in place.
__device__ __forceinline__ void dense_rows(float* S) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = warp * 16 + half * 8 + lane / 4;
        float v[32];  // v[j]: column 4 * j + lane % 4
#pragma unroll
        for (int j = 0; j < 32; ++j) v[j] = S[dense_at(r, 4 * j + lane % 4)];
        fwht_registers(v);
        fwht_lane_pairs(v, lane);
#pragma unroll
        for (int j = 0; j < 32; ++j) S[dense_at(r, 4 * j + lane % 4)] = v[j];
    }
}

// Four values as one 8-byte store in the model dtype (i a multiple of 4).
__device__ __forceinline__ void store_act4(void* p, size_t i, const float (&v)[4], int bf16) {
    uint2 u;
    if (bf16) {
        const __nv_bfloat162 a = __floats2bfloat162_rn(v[0], v[1]), b = __floats2bfloat162_rn(v[2], v[3]);
        u = make_uint2(*reinterpret_cast<const uint32_t*>(&a), *reinterpret_cast<const uint32_t*>(&b));
        *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(p) + i) = u;
    } else {
        const __half2 a = __floats2half2_rn(v[0], v[1]), b = __floats2half2_rn(v[2], v[3]);
        u = make_uint2(*reinterpret_cast<const uint32_t*>(&a), *reinterpret_cast<const uint32_t*>(&b));
        *reinterpret_cast<uint2*>(static_cast<__half*>(p) + i) = u;
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
    dense_rows(S);
    __syncthreads();
    const int k0 = kb * BLOCK_N + 4 * lane;  // pass 3: the lane's k rows 4 * lane + i
    float suh[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) suh[i] = __half2float(p.suh[k0 + i]) * (1.0f / 128);  // HAD_SCALE squared, exactly
    for (int c = warp * 16; c < warp * 16 + 16; ++c) {
        const int row = blockIdx.x * BLOCK_N + c;  // of W^T
        if (row >= p.cols) break;
        const float svh = __half2float(p.svh[nb * BLOCK_N + c]);
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = S[dense_at(4 * lane + i, c)] * suh[i] * svh;
        store_act4(p.w, (size_t)row * p.k + k0, v, p.bf16);
    }
}

template <int CB, int KA, bool HALFK>
int dense_launch(const DenseParams& p, cudaStream_t s) {
    static int fits[64] = {};  // per device; 0 = not configured yet
    int slot = 0, code = device_slot(&slot);
    if (code == 0)
        code = configure_kernel(trellis_dense_kernel<CB, KA, HALFK>, DENSE_SMEM, DENSE_SMEM, fits[slot], nullptr);
    if (code != 0) return code;
    const dim3 grid((p.cols + BLOCK_N - 1) / BLOCK_N, p.k / BLOCK_N);
    trellis_dense_kernel<CB, KA, HALFK><<<grid, THREADS, DENSE_SMEM, s>>>(p);
    return (int)cudaGetLastError();
}

}  // namespace qp

// W^T of one shard's columns [col0, col0 + cols) (col0 a multiple of 128) into w, (cols, k) in the model dtype
// (bf16 or fp16), row stride k, 8-byte aligned (a lane writes 4 values in one store): y[:, col0:col0 + cols] = x @ w.T
// (see the file's head). Returns 0, -1 (bad geometry or a misaligned w), -2 (no such K), -3 (bad codebook) or a CUDA
// error code.
QP_API int qp_trellis_dense(const void* trellis, const void* suh, const void* svh, void* w, int k, int n, int col0,
                            int cols, int codebook, int k2, int bf16, void* stream) {
    if (cols <= 0) return 0;
    if (k <= 0 || n <= 0 || k % 128 || n % 128 || col0 % 128 || col0 < 0 || col0 + cols > n) return -1;
    if (reinterpret_cast<uintptr_t>(w) % 8) return -1;
    const qp::DenseParams p{static_cast<const uint8_t*>(trellis), static_cast<const __half*>(suh),
                            static_cast<const __half*>(svh), w, k, n, col0 / qp::BLOCK_N, cols, bf16};
    return qp::with_codebook_k(codebook, k2, [&](auto cb, auto ka, auto half) {
        return qp::dense_launch<decltype(cb)::value, decltype(ka)::value, decltype(half)::value>(
            p, static_cast<cudaStream_t>(stream));
    });
}
