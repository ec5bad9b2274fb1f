// Ragged decode attention for the continuous engine on CPU: an XLA FFI custom call.
//
// One query token per row attends over the first `lengths[b]` positions of its own cache, and reads nothing
// beyond them. XLA's dense form (decode.py: _attention) reads the slot group's whole window for every row; in
// a long-tailed request set most rows are far shorter than the longest, and attention is bound by reading the
// cache, so the positions not read are the time saved. Rows x KV heads are spread over XLA's intra-op
// thread pool (XLA:CPU runs its batched attention dots on one thread).
//
// Layouts (decode.py's cache):
//   q       [B, KV, G, D]  float32: the G query heads sharing KV head h, already scaled
//   keys    [B, KV, D, W]  float32: keys transposed, W cache positions
//   values  [B, KV, W, D]  float32
//   lengths [B]            int32: valid positions of each row (clamped to 1..W); positions 0..len-1 are attended
//   out     [B, KV, G, D]  float32
// Attribute `softcap` (0: none) applies Gemma 2's tanh cap to the scores.
//
// Numerics: scores and softmax in float32 with the maximum subtracted, as jax.nn.softmax does; positions past a
// row's length contribute exactly 0, as XLA's masked logits do after exp. Only the order of the float32 sums
// differs from XLA's dots (relative differences of order 1e-7).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Problem {
  const float* q;
  const float* keys;
  const float* values;
  const int32_t* lengths;
  float* out;
  int64_t rows, kv, group, dim, window;
  float softcap;
};

// 8 floats: one AVX register with -march=native on x86, two NEON registers on ARM (GCC/Clang vector extensions).
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  // the same, loaded from any float address
typedef int32_t i8 __attribute__((vector_size(32)));

inline v8 Load(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline void Store(float* p, v8 v) { *reinterpret_cast<v8u*>(p) = v; }
inline v8 Splat(float x) { return v8{} + x; }

// exp on 8 lanes: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-6 Taylor-Horner polynomial (relative
// error under 2e-7 there), times 2^n built in the exponent bits. Inputs here are scores minus their maximum (<= 0);
// below -87 the result is 0 (float32's exp is denormal or 0 there). A scalar exp per score cost more
// than reading the cache.
inline v8 Exp(v8 in) {
  const v8 x = in < -87.0f ? Splat(-87.0f) : in;
  const i8 ni = __builtin_convertvector(x * 1.44269504f + (x < 0.0f ? Splat(-0.5f) : Splat(0.5f)), i8);
  const v8 n = __builtin_convertvector(ni, v8);
  v8 r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;  // ln2 split in two: r stays exact
  v8 poly = Splat(1.0f / 720.0f);
  poly = poly * r + 1.0f / 120.0f;
  poly = poly * r + 1.0f / 24.0f;
  poly = poly * r + 1.0f / 6.0f;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.0f;
  poly = poly * r + 1.0f;
  const i8 bits = (ni + 127) << 23;
  v8 scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return in < -87.0f ? Splat(0.0f) : poly * scale;
}

// scores[g, s] = sum_d q[g, d] keys[d, s] for GN (<= 4) queries and 16 positions at a time, the 2 x GN sums held
// in registers across d: each key row is read once per 16 positions, the scores written once.
template <int GN>
void Scores(const float* q, int64_t d_n, const float* keys, int64_t w, int64_t len, float* scores,
            int64_t stride) {
  for (int64_t s0 = 0; s0 < len; s0 += 16) {  // len rounds up to 16 within the window (a multiple of 64)
    v8 acc[GN][2] = {};
    for (int64_t d = 0; d < d_n; ++d) {
      __builtin_prefetch(keys + d * w + s0 + 32);  // two blocks ahead: 64 rows are too many streams for the hardware
      const v8 k0 = Load(keys + d * w + s0), k1 = Load(keys + d * w + s0 + 8);
      for (int g = 0; g < GN; ++g) {
        const v8 qv = Splat(q[g * d_n + d]);
        acc[g][0] += qv * k0;
        acc[g][1] += qv * k1;
      }
    }
    for (int g = 0; g < GN; ++g) {
      Store(scores + g * stride + s0, acc[g][0]);
      Store(scores + g * stride + s0 + 8, acc[g][1]);
    }
  }
}

// out[g, :] = sum_s p[g, s] values[s, :] for GN (<= 4) queries, 16 of the D outputs at a time, then 8, then one
// (head dims that are not multiples of 16, as small test models have).
template <int GN>
void Mix(const float* probs, int64_t stride, const float* values, int64_t d_n, int64_t len, float* out) {
  int64_t d0 = 0;
  for (; d0 + 16 <= d_n; d0 += 16) {
    v8 acc[GN][2] = {};
    for (int64_t s = 0; s < len; ++s) {
      const v8 v0 = Load(values + s * d_n + d0), v1 = Load(values + s * d_n + d0 + 8);
      for (int g = 0; g < GN; ++g) {
        const v8 pv = Splat(probs[g * stride + s]);
        acc[g][0] += pv * v0;
        acc[g][1] += pv * v1;
      }
    }
    for (int g = 0; g < GN; ++g) {
      Store(out + g * d_n + d0, acc[g][0]);
      Store(out + g * d_n + d0 + 8, acc[g][1]);
    }
  }
  if (d0 + 8 <= d_n) {
    v8 acc[GN] = {};
    for (int64_t s = 0; s < len; ++s) {
      const v8 v0 = Load(values + s * d_n + d0);
      for (int g = 0; g < GN; ++g) acc[g] += Splat(probs[g * stride + s]) * v0;
    }
    for (int g = 0; g < GN; ++g) Store(out + g * d_n + d0, acc[g]);
    d0 += 8;
  }
  for (; d0 < d_n; ++d0) {
    for (int g = 0; g < GN; ++g) {
      float acc = 0.0f;
      for (int64_t s = 0; s < len; ++s) acc += probs[g * stride + s] * values[s * d_n + d0];
      out[g * d_n + d0] = acc;
    }
  }
}

// Mix for D a multiple of 64: one query at a time, 64 outputs in 8 registers, each value row read contiguously
// (twice as fast as Mix's 16-output strips on AVX2, which read every row once per strip)
template <int GN>
void Mix64(const float* probs, int64_t stride, const float* values, int64_t d_n, int64_t len, float* out) {
  for (int g = 0; g < GN; ++g) {
    for (int64_t d0 = 0; d0 < d_n; d0 += 64) {
      v8 acc[8] = {};
      const float* pg = probs + g * stride;
      for (int64_t s = 0; s < len; ++s) {
        const float* vr = values + s * d_n + d0;
        const v8 pv = Splat(pg[s]);
        for (int j = 0; j < 8; ++j) acc[j] += pv * Load(vr + 8 * j);
      }
      for (int j = 0; j < 8; ++j) Store(out + g * d_n + d0 + 8 * j, acc[j]);
    }
  }
}

template <int GN>
void Block(const float* q, const float* keys, const float* values, int64_t d_n, int64_t w, int64_t len,
           float* scores, int64_t stride, float softcap, float* out) {
  Scores<GN>(q, d_n, keys, w, len, scores, stride);
  for (int g = 0; g < GN; ++g) {
    float* sc = scores + g * stride;
    if (softcap > 0.0f) {
      for (int64_t s = 0; s < len; ++s) sc[s] = std::tanh(sc[s] / softcap) * softcap;
    }
    float top = sc[0];
    for (int64_t s = 1; s < len; ++s) top = std::max(top, sc[s]);
    const int64_t padded = (len + 15) / 16 * 16;
    for (int64_t s = len; s < padded; ++s) sc[s] = -INFINITY;  // read past the row: weight 0
    v8 total = {};
    for (int64_t s = 0; s < padded; s += 8) {
      const v8 e = Exp(Load(sc + s) - top);
      Store(sc + s, e);
      total += e;
    }
    float sum = 0.0f;
    for (int i = 0; i < 8; ++i) sum += total[i];
    const float inv = 1.0f / sum;
    for (int64_t s = 0; s < padded; s += 8) Store(sc + s, Load(sc + s) * inv);
  }
  if (d_n % 64 == 0) Mix64<GN>(scores, stride, values, d_n, len, out);
  else Mix<GN>(scores, stride, values, d_n, len, out);
}

// One (row, KV head): G queries over the row's own positions.
void AttendOne(const Problem& p, int64_t item, std::vector<float>& scores) {
  const int64_t b = item / p.kv;
  const int64_t g_n = p.group, d_n = p.dim, w = p.window;
  const int64_t len = std::clamp<int64_t>(p.lengths[b], 1, w);
  const int64_t stride = (len + 15) / 16 * 16;
  const float* q = p.q + item * g_n * d_n;
  const float* keys = p.keys + item * d_n * w;
  const float* values = p.values + item * w * d_n;
  float* out = p.out + item * g_n * d_n;
  scores.resize(4 * stride);
  if (item + 1 < p.rows * p.kv) {  // the next item's first key and value lines, so their misses overlap this work
    const float* nk = keys + d_n * w;
    const float* nv = values + w * d_n;
    for (int64_t d = 0; d < d_n; ++d) __builtin_prefetch(nk + d * w);
    for (int64_t s = 0; s < 16; ++s) __builtin_prefetch(nv + s * 16);
  }
  for (int64_t g0 = 0; g0 < g_n; g0 += 4) {
    const float* qg = q + g0 * d_n;
    float* og = out + g0 * d_n;
    switch (std::min<int64_t>(4, g_n - g0)) {
      case 1: Block<1>(qg, keys, values, d_n, w, len, scores.data(), stride, p.softcap, og); break;
      case 2: Block<2>(qg, keys, values, d_n, w, len, scores.data(), stride, p.softcap, og); break;
      case 3: Block<3>(qg, keys, values, d_n, w, len, scores.data(), stride, p.softcap, og); break;
      default: Block<4>(qg, keys, values, d_n, w, len, scores.data(), stride, p.softcap, og); break;
    }
  }
}

// Work shared between the calling thread and pool tasks. Items are claimed from an atomic counter, so a task the
// pool starts late (or never, if it is busy) only finds nothing left; the caller waits just for items that were
// claimed and are running. Held by shared_ptr: a task that starts after the call returned still finds it alive.
struct Shared {
  Problem problem;
  int64_t items, per_claim;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable finished;

  void Work() {
    std::vector<float> scores;
    for (;;) {
      const int64_t start = next.fetch_add(per_claim);
      if (start >= items) return;
      const int64_t end = std::min(items, start + per_claim);
      for (int64_t i = start; i < end; ++i) AttendOne(problem, i, scores);
      if (done.fetch_add(end - start) + (end - start) == items) {
        std::lock_guard<std::mutex> lock(mu);
        finished.notify_all();
      }
    }
  }
};

ffi::Error RaggedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> keys,
                               ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::S32> lengths,
                               ffi::ResultBuffer<ffi::F32> out, float softcap) {
  auto qd = q.dimensions(), kd = keys.dimensions(), vd = values.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || lengths.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument("ragged_attention: q, keys, values must be rank 4 and lengths rank 1");
  }
  const int64_t rows = qd[0], kv = qd[1], group = qd[2], dim = qd[3], window = kd[3];
  if (window % 16 != 0) {  // scores are computed 16 positions at a time, up to the window
    return ffi::Error::InvalidArgument("ragged_attention: the window must be a multiple of 16");
  }
  if (kd[0] != rows || kd[1] != kv || kd[2] != dim || vd[0] != rows || vd[1] != kv || vd[2] != window ||
      vd[3] != dim || lengths.dimensions()[0] != rows) {
    return ffi::Error::InvalidArgument("ragged_attention: shapes disagree (q [B,KV,G,D], keys [B,KV,D,W], "
                                       "values [B,KV,W,D], lengths [B])");
  }
  auto shared = std::make_shared<Shared>();
  shared->problem = Problem{q.typed_data(), keys.typed_data(), values.typed_data(), lengths.typed_data(),
                            out->typed_data(), rows, kv, group, dim, window, softcap};
  shared->items = rows * kv;
  if (shared->items == 0) return ffi::Error::Success();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // a few claims per thread keep the load even when rows differ in length
  shared->per_claim = std::max<int64_t>(1, shared->items / (8 * (threads + 1)));
  const int64_t helpers = std::min<int64_t>(threads, shared->items / shared->per_claim - 1);
  for (int64_t t = 0; t < helpers; ++t) {
    pool.Schedule([shared] { shared->Work(); });
  }
  shared->Work();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->finished.wait(lock, [&] { return shared->done.load() == shared->items; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GrpoStreamRaggedAttention, RaggedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("softcap"));
