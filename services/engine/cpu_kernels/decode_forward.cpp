// One step of a Llama-family model (Llama, Mistral, Qwen2) on the CPU: every layer, from the token
// embeddings to the final norm and the logits, in one OpenMP parallel region. A step's rows are the
// new tokens of its requests: first the decoding requests, one row each, then the chunks of prompts
// (prefill), any number of rows each.
//
// A decode step at small batch is a chain of many short operations (the projections stream their
// weights in tens of microseconds, the norms, rotary and activation take a few), so what it costs
// beyond the weight reads is the cost of starting each one: a call from Python, an OpenMP region whose
// idle threads may have gone to sleep, a temporary tensor. Here the threads enter one region and go
// through the phases of each layer together, a phase ending when its last item is done (ProgressSplit,
// work_split.h: a thread the OS took away between items holds nobody up, and the run of items of one
// taken away in the middle of it is taken over by the others; each layer is an epoch of its own):
//
//   norm(residual + x) -> qkv -> rotary, K/V store -> paged attention (decode rows, then prefill rows)
//   -> o -> norm(residual + o) -> gate_up -> silu(gate) * up -> down
//
// and after the last layer: final norm -> the logits of the rows that sample.
//
// A step with prompt chunks is long (hundreds of milliseconds at 2,048 rows) and runs the same way: as
// a chain of torch operations, each an OpenMP region with its threads split statically and a barrier at
// its end, it lost a core's share whenever another process (the gateway, the tokenizer, a client) took
// one of its threads' cores, the other thread waiting at the barrier with its core idle.
//
// The projections are linear_panels.h's kernels on the weights linear.py blocked at load time, the
// attention is paged_decode_kernels.h's for the decode rows and paged_prefill_kernels.h's for the
// prompt rows. Every intermediate is rounded to the model's dtype where the torch forward
// (services/engine/models/llama.py) rounds it, so both compute the same numbers up to the order of
// float32 sums in the norms.

#include "core_binding.h"
#include "linear_panels.h"
#include "paged_decode_kernels.h"
#include "paged_prefill_kernels.h"
#include "row_ops.h"

#include <initializer_list>
#include <memory>
#include <new>
#include <type_traits>

namespace {

// Pointers into one layer's tensors, in the model's dtype; biases may be null.
struct LayerWeights {
  const void* input_norm;    // [H]
  const void* qkv;           // blocked [q + 2 kv, H]
  const void* qkv_bias;      // [q + 2 kv]
  const void* o;             // blocked [H, q]
  const void* o_bias;        // [H]
  const void* post_norm;     // [H]
  const void* gate_up;       // blocked [2 I, H]: gate rows, then up rows
  const void* gate_up_bias;  // [2 I]
  const void* down;          // blocked [H, I]
  const void* down_bias;     // [H]
  void* k_cache;             // [num_blocks, block_size, kv_heads, D], contiguous
  void* v_cache;
  int64_t window;            // 0: the whole context
  // int8 weights (bfloat16 models with --quantization int8): each projection's float32 scale per
  // output, its blocked weight int8 in bfloat16's layout (linear_panels.h); null: weights of the dtype
  const float* qkv_scales;
  const float* o_scales;
  const float* gate_up_scales;
  const float* down_scales;
};

struct ModelWeights {
  int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
  float eps, scale;
  const void* embed;       // [vocab, H]
  const void* final_norm;  // [H]
  const void* cos;         // [positions, D]
  const void* sin;         // [positions, D], the second half negated (see models/rope.py)
  const LayerWeights* layers;
  const void* logits;       // blocked [vocab, H] (the head, tied or not), or null: no logits here
  const void* logits_bias;  // [vocab] or null
  int64_t vocab;
  const float* logits_scales;  // [vocab] for an int8 head, else null
};

struct StepInputs {
  int64_t num_rows;             // M: the decode rows, then the prompt chunks' rows
  const int64_t* token_ids;     // [M]
  const int64_t* positions;     // [M]
  const int64_t* slot_mapping;  // [M]: where each new token's K/V goes
  const int64_t* block_tables;  // [D + P, >= blocks], row stride table_stride: the decode requests', then the prefills'
  const int64_t* seq_lens;      // [D]: each decode request's context including its new token
  int64_t table_stride;
  int64_t min_chunk_tokens;     // see paged_decode_kernels.h's plan_chunks
  void* out;                    // [M, H]: the final norm of the last hidden state
  int64_t num_logit_rows;       // S: rows whose logits are wanted (with ModelWeights::logits)
  const int64_t* logit_rows;    // [S]: which rows, in the order of `logits`
  float* logits;                // [S, vocab]: rounded to the model's dtype as the torch head rounds them
  int64_t num_decodes;          // D: requests decoding one token each, rows 0 .. D - 1
  int64_t num_prefills;         // P: prompt chunks, rows D onwards
  const int64_t* query_start;   // [P + 1]: chunk p's rows are D + query_start[p] .. D + query_start[p + 1] - 1
  const int64_t* context_lens;  // [P]: positions of chunk p's request before its first new token
  const int32_t* thread_cores;  // the cores the region's threads bind to, one each (core_binding.h); null: none
  int64_t num_thread_cores;
};

// x[m, k] W^T from inside the parallel region (a phase of `split`), each row's float32 sums handed to
// `store(row, first_out, acc, num_outs)`. `packed` holds LayerBuffers::packed_size(m, k) elements: x in
// the layout of the panel kernels, skipped for one row where that layout is x itself, or the AMX path's
// last partial tile of rows. With `scales` (bfloat16 only), W is int8 and each output's sums are scaled;
// x then goes to it as int16 blocks (pack_x_i8_pass), or as it is to the AMX tiles.
template <typename T, typename Split, typename Store>
void linear_into(const T* x, int64_t m, int64_t k, const void* blocked, const float* scales, int64_t n,
                 typename Elem<T>::Packed* packed, Split& split, Store store) {
  using P = typename Elem<T>::Packed;
  if constexpr (std::is_same_v<T, float>) {
    (void)scales;  // (int8 weights serve bfloat16 models only)
    const float* xp = x;
    if (m > 1) {
      split.items(passes_of(m), 1, [&](int64_t pass) {
        pack_x_pass<float>(packed, x, m, k, k, k, 1, [](float v) { return v; }, pass);
      });
      xp = packed;
    }
    run_panels_f32(xp, m, k, static_cast<const float*>(blocked), k * kPanel, k, n, store, split);
  } else {
    const int64_t k_pairs = (k + 1) / 2;
    const int8_t* int8_blocked = scales ? static_cast<const int8_t*>(blocked) : nullptr;
    auto scaled = [&](int64_t row, int64_t first_out, const float* acc, int num_outs) {
      alignas(64) float sums[kPanel];
      for (int o = 0; o < num_outs; ++o) sums[o] = acc[o] * scales[first_out + o];
      store(row, first_out, sums, num_outs);
    };
    if (amx_serves(m, k, int8_blocked ? kAmxMinRowsI8 : kAmxMinRows)) {
      if (int8_blocked)
        run_panels_amx(x, m, k, int8_blocked, k_pairs * 2 * kPanel, k_pairs, n, reinterpret_cast<uint16_t*>(packed),
                       scaled, split);
      else
        run_panels_amx(x, m, k, static_cast<const uint16_t*>(blocked), k_pairs * 2 * kPanel, k_pairs, n,
                       reinterpret_cast<uint16_t*>(packed), store, split);
      return;
    }
    if (int8_blocked) {  // x as int16 blocks (linear_panels.h)
      int16_t* x16 = reinterpret_cast<int16_t*>(packed);
      split.items(passes_of(m), 1, [&](int64_t pass) { pack_x_i8_pass(x16, x, m, k, k, pass); });
      run_panels<PanelI8>(x16, m, x_i8_row_stride(k), int8_blocked, k_pairs * 2 * kPanel, k_pairs, n, scaled, split);
      return;
    }
    const P* xp = reinterpret_cast<const P*>(x);
    if (m > 1 || k % 2 || !std::is_same_v<P, uint16_t>) {
      split.items(passes_of(m), 1, [&](int64_t pass) { pack_x_pass<P>(packed, x, m, k, k, k_pairs, 2, x_element, pass); });
      xp = packed;
    }
    run_panels_bf16(xp, m, 2 * k_pairs, static_cast<const uint16_t*>(blocked), k_pairs * 2 * kPanel, k_pairs, n,
                    store, split);
  }
}

// y[m, n] = x[m, k] W^T + b in T (linear_into).
template <typename T, typename Split>
void linear(const T* x, int64_t m, int64_t k, const void* blocked, const float* scales, const void* bias, int64_t n,
            T* y, typename Elem<T>::Packed* packed, Split& split) {
  const T* b = static_cast<const T*>(bias);
  linear_into<T>(x, m, k, blocked, scales, n, packed, split, [=](int64_t row, int64_t first_out, const float* acc, int num_outs) {
    T* out = y + row * n + first_out;
#ifdef STRATA_AVX512
    // one panel's outputs (num_outs <= 16) in one vector: the scalar loop took ~5% of a 64-row step
    const __mmask16 mask = lanes(num_outs);
    __m512 sums = _mm512_maskz_loadu_ps(mask, acc);
    if (b) sums = _mm512_add_ps(sums, load_row16(b + first_out, mask));
    store16(out, sums, mask);
#else
    for (int o = 0; o < num_outs; ++o)
      out[o] = Elem<T>::store(acc[o] + (b ? Elem<T>::load(b[first_out + o]) : 0.0f));
#endif
  });
}

constexpr int64_t kActivationSpan = 256;  // elements of one row per silu_mul work item
constexpr size_t kMaxPhasesPerLayer = 18;  // ProgressSplit phases a layer may take (it takes at most 16)
constexpr size_t kFinalPhases = 4;         // after the layers: the final norm, the logits' rows, x's packing, the head

// The memory a step's buffers are carved from, kept by the caller (one per engine) from one step to the
// next: it grows to the largest step and stays, and is not cleared (every buffer element is written
// before it is read). Fresh buffers per step cost their zeroing (~2% of a 64-row decode step) and, for a
// step of prompt chunks (hundreds of MB at 2,048 rows), the page faults of memory the allocator had
// handed back to the OS.
class StepArena {
 public:
  // A layout pass (`base` null) counts the bytes; the carving pass after it hands them out.
  template <typename X>
  X* take(int64_t count) {
    used_ = (used_ + 63) / 64 * 64;
    X* at = base_ ? reinterpret_cast<X*>(base_ + used_) : nullptr;
    used_ += count * int64_t(sizeof(X));
    return at;
  }
  // Starts the carving pass over at least the bytes the layout pass counted.
  void carve() {
    if (used_ > capacity_) {
      memory_.reset(static_cast<char*>(::operator new(size_t(used_), std::align_val_t(64))));
      capacity_ = used_;
    }
    base_ = memory_.get();
    used_ = 0;
  }
  void restart() { base_ = nullptr, used_ = 0; }
  int64_t capacity() const { return capacity_; }

 private:
  struct Free {
    void operator()(char* p) const { ::operator delete(p, std::align_val_t(64)); }
  };
  std::unique_ptr<char, Free> memory_;
  char* base_ = nullptr;
  int64_t used_ = 0, capacity_ = 0;
};

// What one layer writes, in buffers of its own: the layers alternate between two sets, so that a thread
// that comes back late to a layer's work item another thread took over (work_split.h's stealing) only
// writes values that are there already, into a set nobody else writes meanwhile (layer l + 2 waits for
// it, begin_epoch). Only a layer's first phase reads the set before (the last layer's residual and
// down projection), which layer l + 1 may be rewriting while a late thread reads it: what that late
// thread then writes (residual_in, x_in) is read by nobody before layer l + 2 writes it again.
template <typename T>
struct LayerBuffers {
  using P = typename Elem<T>::Packed;
  T *residual_in, *x_in, *qkv, *q, *attn, *o, *residual_post, *x_post, *gate_up, *act, *down;
  float* attn_f32;
  P *packed_qkv, *packed_o, *packed_gate_up, *packed_down;  // x in the panel kernels' layout
  Partial* partials;

  void carve(StepArena& arena, int64_t m, int64_t hidden, int64_t q_size, int64_t qkv_size, int64_t inter,
             int64_t num_partials) {
    for (T** buffer : {&residual_in, &x_in, &o, &residual_post, &x_post, &down}) *buffer = arena.take<T>(m * hidden);
    qkv = arena.take<T>(m * qkv_size);
    q = arena.take<T>(m * q_size);
    attn = arena.take<T>(m * q_size);
    gate_up = arena.take<T>(m * 2 * inter);
    act = arena.take<T>(m * inter);
    attn_f32 = arena.take<float>(m * q_size);
    packed_qkv = arena.take<P>(packed_size(m, hidden));
    packed_o = arena.take<P>(packed_size(m, q_size));
    packed_gate_up = arena.take<P>(packed_size(m, hidden));
    packed_down = arena.take<P>(packed_size(m, inter));
    partials = arena.take<Partial>(num_partials);
  }
  // x packed for the panel kernels (k + 1 elements a row), or an int8 model's int16 blocks of x (two bytes
  // an element and a float32 scale per 32: x_i8_row_stride(k) <= k + k / 16 + 34 int16)
  static int64_t packed_size(int64_t m, int64_t k) { return std::max(m, kTileRows) * (k + k / 16 + 35); }
};

template <typename T>
void decode_step(const ModelWeights& mw, const StepInputs& in, StepArena& arena) {
  using E = Elem<T>;
  const int64_t m = in.num_rows, hidden = mw.hidden, dim = mw.head_dim, inter = mw.intermediate;
  const int64_t q_size = mw.num_heads * dim, kv_size = mw.num_kv_heads * dim, qkv_size = q_size + 2 * kv_size;
  const int64_t decodes = in.num_decodes, prefills = in.num_prefills;

  // Each layer's attention problems, the decode rows' and the prompt rows', and the decode rows' cut
  // into work items (sliding windows differ per layer).
  const int num_threads = omp_get_max_threads();
  std::vector<Plan> plans;
  int64_t num_partials = 0;
  for (int64_t l = 0; l < mw.num_layers; ++l) {
    Problem shape{nullptr, nullptr, nullptr, in.block_tables, in.seq_lens, nullptr, decodes, mw.num_heads,
                  mw.num_kv_heads, dim, mw.block_size, q_size, dim, in.table_stride, mw.layers[l].window, mw.scale};
    plans.push_back(plan_chunks(shape, in.min_chunk_tokens, num_threads));
    if (plans.back().split) num_partials = std::max(num_partials, plans.back().num_partials(shape));
  }

  // The logits' rows: `out` itself when every row samples in order, else a copy of those that do.
  const bool logits = mw.logits != nullptr && in.logits != nullptr && in.num_logit_rows > 0;
  const int64_t s = logits ? in.num_logit_rows : 0;
  bool rows_in_order = s == m;
  for (int64_t j = 0; j < s && rows_in_order; ++j) rows_in_order = in.logit_rows[j] == j;

  LayerBuffers<T> sets[2];
  T* picked = nullptr;
  typename E::Packed* packed_head = nullptr;
  T* residual_final = nullptr;
  arena.restart();
  for (int pass = 0; pass < 2; ++pass) {  // the layout pass counts the bytes, the second hands them out
    if (pass == 1) arena.carve();
    for (LayerBuffers<T>& set : sets) set.carve(arena, m, hidden, q_size, qkv_size, inter, num_partials);
    picked = arena.take<T>(rows_in_order ? 0 : s * hidden);
    packed_head = arena.take<typename E::Packed>(LayerBuffers<T>::packed_size(s, hidden));
    residual_final = arena.take<T>(m * hidden);
  }

  std::vector<Problem> problems;
  std::vector<PrefillProblem> prefill_problems;
  for (int64_t l = 0; l < mw.num_layers; ++l) {
    LayerBuffers<T>& b = sets[l % 2];
    const LayerWeights& lw = mw.layers[l];
    problems.push_back(Problem{b.q, lw.k_cache, lw.v_cache, in.block_tables, in.seq_lens, b.attn_f32, decodes,
                               mw.num_heads, mw.num_kv_heads, dim, mw.block_size, q_size, dim, in.table_stride,
                               lw.window, mw.scale});
    prefill_problems.push_back(PrefillProblem{b.q + decodes * q_size, lw.k_cache, lw.v_cache,
                                              in.block_tables + decodes * in.table_stride, in.query_start,
                                              in.context_lens, b.attn_f32 + decodes * q_size, prefills, mw.num_heads,
                                              mw.num_kv_heads, dim, mw.block_size, q_size, dim, in.table_stride,
                                              lw.window, mw.scale});
  }
  // The prompt rows' work items (the same cut for every layer: it depends only on the rows)
  const PrefillItems prefill_items(prefill_problems.front());
  const T* embed = static_cast<const T*>(mw.embed);
  const T* cos = static_cast<const T*>(mw.cos);
  const T* sin = static_cast<const T*>(mw.sin);
  T* out = static_cast<T*>(in.out);

  // Items of a phase a thread takes at a time: about 8 turns per thread, fewer atomic counts than one each.
  auto grab = [&](int64_t items) { return std::max<int64_t>(1, items / (8 * num_threads)); };
  // The epochs are the layers and then the final phases; every work item below may run twice.
  PhaseCounters counters(mw.num_layers * kMaxPhasesPerLayer + kFinalPhases, num_threads, mw.num_layers + 1);

  // sum = residual + addend (the embeddings on the first layer), then normed = norm(sum). The sum is
  // made in `row` and copied, so that `sum` only ever holds its final value.
  auto add_and_norm = [&](const T* residual, const T* addend, const void* weight, T* sum, T* normed,
                          ProgressSplit& split) {
    split.items(m, grab(m), [&](int64_t r) {
      T* row = sum + r * hidden;
      if (residual == nullptr) {
        std::memcpy(row, embed + in.token_ids[r] * hidden, hidden * sizeof(T));
      } else {
        thread_local std::vector<T> scratch;
        scratch.assign(residual + r * hidden, residual + (r + 1) * hidden);
        add_row(scratch.data(), addend + r * hidden, hidden);
        std::memcpy(row, scratch.data(), hidden * sizeof(T));
      }
      rms_norm_row(row, static_cast<const T*>(weight), hidden, mw.eps, normed + r * hidden);
    });
  };

  const CoreList cores{in.thread_cores, in.num_thread_cores};
  MasterBinding master_binding(cores, num_threads);
#pragma omp parallel num_threads(num_threads)
  {
    bind_team_thread(cores, omp_get_thread_num(), num_threads);
    ProgressSplit split(counters, omp_get_thread_num());  // this thread's way through the phases (work_split.h)
    for (int64_t l = 0; l < mw.num_layers; ++l) {
      split.begin_epoch(l);
      const LayerWeights& lw = mw.layers[l];
      LayerBuffers<T>& b = sets[l % 2];
      const LayerBuffers<T>& before = sets[(l + 1) % 2];
      add_and_norm(l == 0 ? nullptr : before.residual_post, before.down, lw.input_norm,
                   b.residual_in, b.x_in, split);
      linear(b.x_in, m, hidden, lw.qkv, lw.qkv_scales, lw.qkv_bias, qkv_size, b.qkv, b.packed_qkv, split);

      // Rotary on the q heads (into q) and the k heads, then the new token's K and V into the pools.
      const int64_t heads_per_row = mw.num_heads + 2 * mw.num_kv_heads;
      split.items(m * heads_per_row, grab(m * heads_per_row), [&](int64_t item) {
        const int64_t r = item / heads_per_row, h = item % heads_per_row;
        const T* head = b.qkv + r * qkv_size + h * dim;
        T* to = h < mw.num_heads ? b.q + r * q_size + h * dim
                                 : static_cast<T*>(h < mw.num_heads + mw.num_kv_heads ? lw.k_cache : lw.v_cache) +
                                       in.slot_mapping[r] * kv_size + (h - mw.num_heads) % mw.num_kv_heads * dim;
        alignas(64) T rotated[kMaxHeadDim];  // rotated here, so that `to` only ever holds its final value
        if (h < mw.num_heads + mw.num_kv_heads) {
          std::memcpy(rotated, head, dim * sizeof(T));
          rotate_head(rotated, cos + in.positions[r] * dim, sin + in.positions[r] * dim, dim);
          head = rotated;
        }
        std::memcpy(to, head, dim * sizeof(T));
      });

      attend<E::kDtype>(problems[l], plans[l], b.partials, split);
      split.items(prefill_items.count(), 1, [&](int64_t item) { prefill_items.run<E::kDtype>(prefill_problems[l], item); });
      split.items(m, grab(m), [&](int64_t r) {
#ifdef STRATA_AVX512
        for (int64_t i = r * q_size; i < (r + 1) * q_size; i += 16) {
          const __mmask16 mask = lanes((r + 1) * q_size - i);
          store16(b.attn + i, _mm512_maskz_loadu_ps(mask, b.attn_f32 + i), mask);
        }
#else
        for (int64_t i = r * q_size; i < (r + 1) * q_size; ++i) b.attn[i] = E::store(b.attn_f32[i]);
#endif
      });
      linear(b.attn, m, q_size, lw.o, lw.o_scales, lw.o_bias, hidden, b.o, b.packed_o, split);

      add_and_norm(b.residual_in, b.o, lw.post_norm, b.residual_post, b.x_post, split);
      linear(b.x_post, m, hidden, lw.gate_up, lw.gate_up_scales, lw.gate_up_bias, 2 * inter, b.gate_up,
             b.packed_gate_up, split);
      const int64_t spans = (inter + kActivationSpan - 1) / kActivationSpan;
      split.items(m * spans, grab(m * spans), [&](int64_t item) {
        const int64_t r = item / spans, first = item % spans * kActivationSpan;
        const T* row = b.gate_up + r * 2 * inter;
        silu_mul(row + first, row + inter + first, b.act + r * inter + first,
                 std::min(kActivationSpan, inter - first));
      });
      linear(b.act, m, inter, lw.down, lw.down_scales, lw.down_bias, hidden, b.down, b.packed_down, split);
    }
    split.begin_epoch(mw.num_layers);
    const LayerBuffers<T>& last = sets[(mw.num_layers + 1) % 2];
    add_and_norm(last.residual_post, last.down, mw.final_norm, residual_final, out, split);

    if (logits) {
      const T* rows = out;
      if (!rows_in_order) {
        split.items(s, grab(s), [&](int64_t j) {
          std::memcpy(picked + j * hidden, out + in.logit_rows[j] * hidden, hidden * sizeof(T));
        });
        rows = picked;
      }
      const T* bias = static_cast<const T*>(mw.logits_bias);
      linear_into<T>(rows, s, hidden, mw.logits, mw.logits_scales, mw.vocab, packed_head, split,
                     [&](int64_t row, int64_t first_out, const float* acc, int num_outs) {
                       float* logit = in.logits + row * mw.vocab + first_out;
#ifdef STRATA_AVX512
                       const __mmask16 mask = lanes(num_outs);
                       __m512 sums = _mm512_maskz_loadu_ps(mask, acc);
                       if (bias) sums = _mm512_add_ps(sums, load_row16(bias + first_out, mask));
                       _mm512_mask_storeu_ps(logit, mask, round16<T>(sums));
#else
                       for (int o = 0; o < num_outs; ++o)
                         logit[o] = E::round(acc[o] + (bias ? E::load(bias[first_out + o]) : 0.0f));
#endif
                     });
    }
  }
}

}  // namespace

extern "C" {

// The buffers of one engine's steps (see StepArena): made once, passed to every step, freed with the engine.
void* strata_step_arena_new() { return new StepArena(); }
void strata_step_arena_free(void* arena) { delete static_cast<StepArena*>(arena); }
int64_t strata_step_arena_bytes(const void* arena) { return static_cast<const StepArena*>(arena)->capacity(); }

// dtype: 0 float32, 1 bfloat16 (the weights', the pools' and `out`'s).
void strata_decode_step(int32_t dtype, const ModelWeights* weights, const StepInputs* inputs, void* arena) {
  StepArena& buffers = *static_cast<StepArena*>(arena);
  if (dtype == kFloat32)
    decode_step<float>(*weights, *inputs, buffers);
  else
    decode_step<uint16_t>(*weights, *inputs, buffers);
}

}  // extern "C"
