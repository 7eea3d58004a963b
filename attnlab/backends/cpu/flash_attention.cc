// Fused softmax attention for XLA:CPU, called through the jax FFI
// (attnlab/backends/cpu/fused_kernel.py).
//
// softmax(q kᵀ) v over flattened rows (batch * heads), float32, AVX-512. The queries arrive
// already scaled. For each block of query rows the kernel forms the rows' scores against every
// visible key in a buffer that stays in the core's L2 cache, takes the softmax there and
// multiplies by v, so each score is written once and read twice, all in cache (XLA's tile loops
// make four passes over tiles in memory). The backward pass recomputes the probabilities from q,
// k and the saved row logsumexp (flash-attention style) and forms dq, dk, dv. Work is split over
// `threads` threads by rows (and, in the forward, by query blocks when rows are few).
//
// Causal: query i sees key j iff j <= i + offset, offset = max(k_len - q_len, 0) (as
// attnlab.attention.core.attend aligns the queries to the end of the keys). An optional key mask
// (a padding mask: one row of k_len bytes per group of rows) hides keys for every query; a
// query with no visible key gets a zero context and zero gradients.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;  // floats per zmm register
constexpr int kMR = 6;      // C rows per micro-kernel call
constexpr int kNV = 4;      // zmm vectors per C row in one micro-kernel call (64 columns)

// C[MR x 16*NV] (=, or += when acc) A[MR x K] B[K x 16*NV]: A's element (i, p) at
// a[i * ars + p * acs] (so a transposed operand costs nothing), B and C row-major; the last
// vector of each row is masked by `last` (a partial column block).
template <int MR, int NV>
void MicroKernel(const float* a, int64_t ars, int64_t acs, const float* b, int64_t ldb, float* c,
                 int64_t ldc, int64_t k, __mmask16 last, bool acc) {
  __m512 s[MR][NV];
  #pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    #pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      const __mmask16 m = v == NV - 1 ? last : 0xFFFF;
      s[r][v] = acc ? _mm512_maskz_loadu_ps(m, c + r * ldc + v * kLanes) : _mm512_setzero_ps();
    }
  }
  for (int64_t p = 0; p < k; ++p) {
    const float* bp = b + p * ldb;
    __m512 bv[NV];
    #pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      bv[v] = _mm512_maskz_loadu_ps(v == NV - 1 ? last : 0xFFFF, bp + v * kLanes);
    }
    const float* ap = a + p * acs;
    #pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 ar = _mm512_set1_ps(ap[r * ars]);
      #pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) s[r][v] = _mm512_fmadd_ps(ar, bv[v], s[r][v]);
    }
  }
  #pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    #pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      _mm512_mask_storeu_ps(c + r * ldc + v * kLanes, v == NV - 1 ? last : 0xFFFF, s[r][v]);
    }
  }
}

using MicroFn = void (*)(const float*, int64_t, int64_t, const float*, int64_t, float*, int64_t,
                         int64_t, __mmask16, bool);

template <int MR>
constexpr MicroFn Pick(int nv) {
  return nv == 1 ? MicroKernel<MR, 1> : nv == 2 ? MicroKernel<MR, 2>
       : nv == 3 ? MicroKernel<MR, 3> : MicroKernel<MR, 4>;
}

MicroFn PickKernel(int mr, int nv) {
  switch (mr) {
    case 1: return Pick<1>(nv);
    case 2: return Pick<2>(nv);
    case 3: return Pick<3>(nv);
    case 4: return Pick<4>(nv);
    case 5: return Pick<5>(nv);
    default: return Pick<6>(nv);
  }
}

// C[M x N] (=, or += when acc) A[M x K] B[K x N], A strided as in MicroKernel.
void Gemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t ars, int64_t acs,
          const float* b, int64_t ldb, float* c, int64_t ldc, bool acc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {
    if (!acc) {
      for (int64_t i = 0; i < m; ++i) std::memset(c + i * ldc, 0, n * sizeof(float));
    }
    return;
  }
  for (int64_t j = 0; j < n; j += kNV * kLanes) {
    const int64_t width = std::min<int64_t>(kNV * kLanes, n - j);
    const int nv = static_cast<int>((width + kLanes - 1) / kLanes);
    const int tail = static_cast<int>(width % kLanes);
    const __mmask16 last = tail ? static_cast<__mmask16>((1u << tail) - 1) : 0xFFFF;
    for (int64_t i = 0; i < m; i += kMR) {
      const int mr = static_cast<int>(std::min<int64_t>(kMR, m - i));
      PickKernel(mr, nv)(a + i * ars, ars, acs, b + j, ldb, c + i * ldc + j, ldc, k, last, acc);
    }
  }
}

// exp(x) for x <= 0 (scores less their row maximum): 2^n e^r with |r| <= ln2 / 2, e^r by its
// Taylor polynomial of degree 6 (relative error about 1e-7); very negative x gives 0.
inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 Mask(int64_t count) {
  return count >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1);
}

// Lanes j..j+15 of a key mask (bytes, nonzero = visible) that are set, among `lanes`.
inline __mmask16 KeyLanes(const uint8_t* key_mask, int64_t j, __mmask16 lanes) {
  if (key_mask == nullptr) return lanes;
  const __m128i bytes = _mm_maskz_loadu_epi8(lanes, key_mask + j);
  return _mm_mask_cmpneq_epi8_mask(lanes, bytes, _mm_setzero_si128());
}

// Maximum of x[j] over j < n that the key mask (if any) leaves visible; -inf if none.
float RowMax(const float* x, int64_t n, const uint8_t* key_mask) {
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < n; j += kLanes) {
    const __mmask16 k = KeyLanes(key_mask, j, Mask(n - j));
    m = _mm512_mask_max_ps(m, k, m, _mm512_maskz_loadu_ps(k, x + j));
  }
  return _mm512_reduce_max_ps(m);
}

// x[j] = exp(x[j] - shift) for the visible j < n (key mask), 0 for the others up to `width`;
// returns the sum. A row with nothing visible (shift infinite) becomes zeros.
float ExpRow(float* x, int64_t n, int64_t width, float shift, const uint8_t* key_mask) {
  if (!std::isfinite(shift)) {
    std::memset(x, 0, width * sizeof(float));
    return 0.0f;
  }
  const __m512 s = _mm512_set1_ps(shift);
  __m512 sum = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j < n; j += kLanes) {
    const __mmask16 m = KeyLanes(key_mask, j, Mask(n - j));
    const __m512 e = _mm512_maskz_mov_ps(m, Exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + j), s)));
    _mm512_storeu_ps(x + j, e);  // lanes past n are zeroed (they are inside the row's width)
    sum = _mm512_add_ps(sum, e);
  }
  for (; j < width; j += kLanes) _mm512_storeu_ps(x + j, _mm512_setzero_ps());
  return _mm512_reduce_add_ps(sum);
}

// dst[d * ld + j] = src[j * cols + d]: a [rows x cols] row-major matrix transposed, a row of
// dst (16 elements of a column of src) per gather.
void Transpose(const float* src, int64_t rows, int64_t cols, float* dst, int64_t ld) {
  const __m512i stride = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(cols)));
  for (int64_t j = 0; j < rows; j += kLanes) {
    const __mmask16 m = Mask(rows - j);
    const float* base = src + j * cols;
    for (int64_t d = 0; d < cols; ++d) {
      _mm512_mask_storeu_ps(dst + d * ld + j, m,
                            _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, stride, base + d, 4));
    }
  }
}

int64_t RoundUp(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// Row stride of the per-row buffers (kᵀ, vᵀ, scores): the keys rounded up to whole vectors, plus
// one vector when that is a multiple of 128 floats, so that the rows of a panel do not all fall
// into the same L1 cache sets (a 2 or 4 KiB stride would make every row of a 64-row panel evict
// the others).
int64_t LeadingDim(int64_t k_len) {
  const int64_t padded = RoundUp(std::max<int64_t>(k_len, 1), kLanes);
  return padded % 128 == 0 ? padded + kLanes : padded;
}

// Query rows per block: the block's score rows (block x padded k_len floats) fill at most
// about 192 KiB, so that they stay in L2 beside the operands.
// (Tried 32-96 rows and 64-384 KiB: within noise of each other at 512 and 1024 keys.)
constexpr int64_t kMaxBlock = 64;
int64_t QueryBlock(int64_t k_pad) {
  return std::clamp<int64_t>((48 * 1024) / k_pad / kMR * kMR, kMR, kMaxBlock);
}

// Runs fn(task) for task in [0, tasks) on `threads` threads (the caller's included); false if
// a task threw (an allocation failed), after every thread has stopped.
template <typename Fn>
bool ParallelFor(int64_t tasks, int64_t threads, Fn fn) {
  threads = std::max<int64_t>(1, std::min(threads, tasks));
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  auto work = [&]() {
    try {
      for (int64_t t = next++; t < tasks && !failed; t = next++) fn(t);
    } catch (...) {
      failed = true;
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int64_t i = 1; i < threads; ++i) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
  return !failed;
}

struct Shape {
  int64_t rows, q_len, k_len, d, dv;
};

// The key mask of row r: key_mask holds mask_rows rows of k_len bytes, each shared by
// rows / mask_rows consecutive rows (a [batch, 1, 1, k_len] padding mask against [batch, heads]
// rows); nullptr when the call has none.
struct KeyMask {
  const uint8_t* data = nullptr;
  int64_t group = 1, k_len = 0;
  const uint8_t* Row(int64_t r) const { return data ? data + (r / group) * k_len : nullptr; }
  // Keys past the last visible one of row r are skipped altogether (the padding at the end).
  int64_t End(int64_t r, int64_t k_end) const {
    const uint8_t* row = Row(r);
    if (row == nullptr) return k_end;
    while (k_end > 0 && row[k_end - 1] == 0) --k_end;
    return k_end;
  }
};

ffi::Error KeyMaskOf(ffi::Buffer<ffi::U8>& mask, int64_t masked, int64_t rows, int64_t k_len,
                     KeyMask* out) {
  if (!masked) return ffi::Error::Success();
  const int64_t count = static_cast<int64_t>(mask.element_count());
  if (count == 0 || count % k_len != 0 || rows % (count / k_len) != 0) {
    return ffi::Error::InvalidArgument(
        "the key mask must be [mask_rows, k_len] with mask_rows dividing the rows");
  }
  out->data = mask.typed_data();
  out->group = rows / (count / k_len);
  out->k_len = k_len;
  return ffi::Error::Success();
}

ffi::Error ShapeOf(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k, ffi::Buffer<ffi::F32>& v,
                   Shape* s) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() < 2 || kd.size() != qd.size() || vd.size() != qd.size()) {
    return ffi::Error::InvalidArgument("q, k, v must have the same rank >= 2");
  }
  s->rows = 1;
  for (size_t i = 0; i + 2 < qd.size(); ++i) {
    if (kd[i] != qd[i] || vd[i] != qd[i]) {
      return ffi::Error::InvalidArgument("q, k, v must share their leading dims");
    }
    s->rows *= qd[i];
  }
  s->q_len = qd[qd.size() - 2];
  s->d = qd[qd.size() - 1];
  s->k_len = kd[kd.size() - 2];
  s->dv = vd[vd.size() - 1];
  if (kd[kd.size() - 1] != s->d || vd[vd.size() - 2] != s->k_len) {
    return ffi::Error::InvalidArgument("k must be [..., k_len, d] and v [..., k_len, d_v]");
  }
  return ffi::Error::Success();
}

// One call's geometry: shapes, the key mask, the buffers' row stride and query block, and which
// keys a query block and a query row see (causal limit, then the padding at the end skipped).
struct Problem {
  Shape s;
  KeyMask key_mask;
  bool causal = false;
  int64_t k_pad = 0, block = 0, offset = 0;

  // Keys [0, BlockEnd) are visited by query rows [i0, i0 + n) of row r.
  int64_t BlockEnd(int64_t r, int64_t i0, int64_t n) const {
    return key_mask.End(r, causal ? std::min(s.k_len, i0 + n + offset) : s.k_len);
  }
  // Keys [0, RowEnd) are visible to query i of a block visiting [0, block_end).
  int64_t RowEnd(int64_t i, int64_t block_end) const {
    return causal ? std::min(block_end, i + offset + 1) : block_end;
  }
};

ffi::Error Prepare(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k, ffi::Buffer<ffi::F32>& v,
                   ffi::Buffer<ffi::U8>& mask, int64_t causal, int64_t masked, Problem* p) {
  if (auto err = ShapeOf(q, k, v, &p->s); !err.success()) return err;
  if (auto err = KeyMaskOf(mask, masked, p->s.rows, p->s.k_len, &p->key_mask); !err.success()) {
    return err;
  }
  p->causal = causal != 0;
  p->k_pad = LeadingDim(p->s.k_len);
  p->block = QueryBlock(p->k_pad);
  p->offset = std::max<int64_t>(p->s.k_len - p->s.q_len, 0);
  return ffi::Error::Success();
}

const ffi::Error kOutOfMemory(ffi::ErrorCode::kResourceExhausted, "fused attention: out of memory");

ffi::Error Forward(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                   ffi::Buffer<ffi::U8> mask, ffi::ResultBuffer<ffi::F32> out,
                   ffi::ResultBuffer<ffi::F32> lse, int64_t causal, int64_t masked,
                   int64_t threads) {
  Problem pr;
  if (auto err = Prepare(q, k, v, mask, causal, masked, &pr); !err.success()) return err;
  const Shape& s = pr.s;
  const int64_t k_pad = pr.k_pad, block = pr.block;
  if (out->element_count() != static_cast<size_t>(s.rows * s.q_len * s.dv) ||
      lse->element_count() != static_cast<size_t>(s.rows * s.q_len)) {
    return ffi::Error::InvalidArgument("fused attention: result sizes disagree with q, k, v");
  }
  const int64_t q_blocks = (s.q_len + block - 1) / block;
  // Tasks: (row, chunk of query blocks); several chunks per row only when rows are few.
  const int64_t chunks = std::min<int64_t>(q_blocks, std::max<int64_t>(1, 2 * threads / s.rows));
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  float* op = out->typed_data();
  float* lp = lse->typed_data();
  const bool ok = ParallelFor(s.rows * chunks, threads, [&](int64_t task) {
    const int64_t r = task / chunks, chunk = task % chunks;
    thread_local std::vector<float> kt, scores;
    kt.resize(s.d * k_pad);
    scores.resize(block * k_pad);
    const float* qr = qp + r * s.q_len * s.d;
    const float* kr = kp + r * s.k_len * s.d;
    const float* vr = vp + r * s.k_len * s.dv;
    Transpose(kr, s.k_len, s.d, kt.data(), k_pad);
    const int64_t b0 = chunk * q_blocks / chunks, b1 = (chunk + 1) * q_blocks / chunks;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t i0 = b * block, n = std::min(block, s.q_len - i0);
      const int64_t k_end = pr.BlockEnd(r, i0, n);
      float* o = op + (r * s.q_len + i0) * s.dv;
      float* l = lp + r * s.q_len + i0;
      Gemm(n, k_end, s.d, qr + i0 * s.d, s.d, 1, kt.data(), k_pad, scores.data(), k_pad, false);
      const int64_t width = RoundUp(k_end, kLanes);
      float inv[kMaxBlock];
      for (int64_t i = 0; i < n; ++i) {
        const int64_t visible = pr.RowEnd(i0 + i, k_end);
        float* row = scores.data() + i * k_pad;
        const float m = RowMax(row, visible, pr.key_mask.Row(r));
        const float sum = ExpRow(row, visible, width, m, pr.key_mask.Row(r));
        // a query with no visible key: zero context, and an infinite logsumexp that makes the
        // backward pass's probabilities zero
        l[i] = sum > 0.0f ? m + std::log(sum) : std::numeric_limits<float>::infinity();
        inv[i] = sum > 0.0f ? 1.0f / sum : 0.0f;
      }
      Gemm(n, s.dv, k_end, scores.data(), k_pad, 1, vr, s.dv, o, s.dv, false);
      for (int64_t i = 0; i < n; ++i) {
        const __m512 f = _mm512_set1_ps(inv[i]);
        for (int64_t d = 0; d < s.dv; d += kLanes) {
          const __mmask16 m = Mask(s.dv - d);
          _mm512_mask_storeu_ps(o + i * s.dv + d, m,
                                _mm512_mul_ps(f, _mm512_maskz_loadu_ps(m, o + i * s.dv + d)));
        }
      }
    }
  });
  return ok ? ffi::Error::Success() : kOutOfMemory;
}

ffi::Error Backward(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                    ffi::Buffer<ffi::U8> mask, ffi::Buffer<ffi::F32> out,
                    ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dout,
                    ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                    ffi::ResultBuffer<ffi::F32> dv, int64_t causal, int64_t masked,
                    int64_t threads) {
  Problem pr;
  if (auto err = Prepare(q, k, v, mask, causal, masked, &pr); !err.success()) return err;
  const Shape& s = pr.s;
  const int64_t k_pad = pr.k_pad, block = pr.block;
  const size_t outs = static_cast<size_t>(s.rows * s.q_len * s.dv);
  if (out.element_count() != outs || dout.element_count() != outs ||
      lse.element_count() != static_cast<size_t>(s.rows * s.q_len) ||
      dq->element_count() != q.element_count() || dk->element_count() != k.element_count() ||
      dv->element_count() != v.element_count()) {
    return ffi::Error::InvalidArgument("fused attention backward: operand sizes disagree");
  }
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const float* op = out.typed_data();
  const float* lp = lse.typed_data();
  const float* gp = dout.typed_data();
  float* dqp = dq->typed_data();
  float* dkp = dk->typed_data();
  float* dvp = dv->typed_data();
  const bool ok = ParallelFor(s.rows, threads, [&](int64_t r) {
    thread_local std::vector<float> kt, vt, probs, grads;
    kt.resize(s.d * k_pad);
    vt.resize(s.dv * k_pad);
    probs.resize(block * k_pad);
    grads.resize(block * k_pad);
    const float* qr = qp + r * s.q_len * s.d;
    const float* kr = kp + r * s.k_len * s.d;
    const float* vr = vp + r * s.k_len * s.dv;
    const float* orow = op + r * s.q_len * s.dv;
    const float* gr = gp + r * s.q_len * s.dv;
    float* dkr = dkp + r * s.k_len * s.d;
    float* dvr = dvp + r * s.k_len * s.dv;
    Transpose(kr, s.k_len, s.d, kt.data(), k_pad);
    Transpose(vr, s.k_len, s.dv, vt.data(), k_pad);
    std::memset(dkr, 0, s.k_len * s.d * sizeof(float));
    std::memset(dvr, 0, s.k_len * s.dv * sizeof(float));
    for (int64_t i0 = 0; i0 < s.q_len; i0 += block) {
      const int64_t n = std::min(block, s.q_len - i0);
      const int64_t k_end = pr.BlockEnd(r, i0, n);
      const int64_t width = RoundUp(k_end, kLanes);
      const float* qb = qr + i0 * s.d;
      const float* gb = gr + i0 * s.dv;
      // P: the probabilities, recomputed from the saved logsumexp
      Gemm(n, k_end, s.d, qb, s.d, 1, kt.data(), k_pad, probs.data(), k_pad, false);
      for (int64_t i = 0; i < n; ++i) {
        ExpRow(probs.data() + i * k_pad, pr.RowEnd(i0 + i, k_end), width,
               lp[r * s.q_len + i0 + i], pr.key_mask.Row(r));
      }
      // dV += Pᵀ dO
      Gemm(k_end, s.dv, n, probs.data(), 1, k_pad, gb, s.dv, dvr, s.dv, true);
      // dP = dO Vᵀ, then dS = P (dP - rowsum(dO o O)) in place
      Gemm(n, k_end, s.dv, gb, s.dv, 1, vt.data(), k_pad, grads.data(), k_pad, false);
      for (int64_t i = 0; i < n; ++i) {
        const float* ob = orow + (i0 + i) * s.dv;
        const float* g = gb + i * s.dv;
        float delta = 0.0f;
        for (int64_t d = 0; d < s.dv; ++d) delta += g[d] * ob[d];
        const __m512 dl = _mm512_set1_ps(delta);
        float* ds = grads.data() + i * k_pad;
        const float* p = probs.data() + i * k_pad;
        for (int64_t j = 0; j < k_end; j += kLanes) {  // columns past k_end are never read
          const __mmask16 m = Mask(k_end - j);
          _mm512_mask_storeu_ps(ds + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, p + j),
              _mm512_sub_ps(_mm512_maskz_loadu_ps(m, ds + j), dl)));
        }
      }
      // dQ = dS K, dK += dSᵀ Q
      Gemm(n, s.d, k_end, grads.data(), k_pad, 1, kr, s.d, dqp + (r * s.q_len + i0) * s.d, s.d,
           false);
      Gemm(k_end, s.d, n, grads.data(), 1, k_pad, qb, s.d, dkr, s.d, true);
    }
  });
  return ok ? ffi::Error::Success() : kOutOfMemory;
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnlabFusedAttentionFwd, Forward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("causal")
                                  .Attr<int64_t>("masked")
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttnlabFusedAttentionBwd, Backward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("causal")
                                  .Attr<int64_t>("masked")
                                  .Attr<int64_t>("threads"));
