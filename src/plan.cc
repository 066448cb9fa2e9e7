// IndexPlan: validation of the index and the chunk tables of the canonical
// cross-row reduction (contract in include/detdit/plan.h and docs/numerics.md).
#include "detdit/plan.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <mutex>
#include <new>
#include <string>
#include <utility>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "common/backends.h"
#include "common/fnv1a.h"
#include "common/out_of_memory.h"
#include "common/validate.h"

namespace detdit {

struct IndexPlan::Impl {
  int64_t seq_len = 0, batch = 0, num_rows = 0, positions = 0, num_chunks = 0, num_segments = 0;
  int64_t max_chunk_segments = 0;
  // Computed on first use (fingerprint()): only the parallel ops need it,
  // and hashing every row is a fifth of a block-packed build.
  mutable std::once_flag fingerprint_once;
  mutable uint64_t fingerprint = 0;
  Device device;
  std::vector<int32_t> row_of_seq, chunk_segment_begin, segment_row, segment_pos_begin, segment_positions,
      row_segment_begin, row_segments;
  PlanTables host, device_tables;
  std::shared_ptr<void> device_memory;  // owns the device copies of the tables
};

struct PlanBuilder {
  static void set(IndexPlan* plan, std::shared_ptr<const IndexPlan::Impl> impl) { plan->impl_ = std::move(impl); }
};

namespace {

Status check_index_tensor(const TensorView& t, const char* name) {
  DETDIT_RETURN_IF_ERROR(check::present(t, name));
  DETDIT_RETURN_IF_ERROR(check::dtype(t, name, {DType::kI64, DType::kI32}));
  DETDIT_RETURN_IF_ERROR(check::rank(t, name, 1, "(S,)"));
  DETDIT_RETURN_IF_ERROR(check::contiguous(t, name));
  if (t.shape[0] < 1) return Status::value_error(std::string(name) + " must hold at least one position (S >= 1), got S = 0");
  return Status();
}

// The entries of an index on the host: a CPU index is read in place, a CUDA
// index is copied once into `staging`.
Status host_entries(const TensorView& t, Stream stream, std::vector<char>* staging, const void** entries) {
  if (!t.device.is_cuda()) {
    *entries = t.data;
    return Status();
  }
  staging->resize(t.nbytes());
  DETDIT_RETURN_IF_ERROR(cuda::copy_to_host(t.data, staging->data(), staging->size(), t.device, stream));
  *entries = staging->data();
  return Status();
}

// An entry is in [0, bound) iff it is below bound as an unsigned 64-bit value
// (a negative entry converts to 2^64 + entry >= 2^63).
template <typename Int>
bool outside(Int entry, int64_t bound) {
  return static_cast<uint64_t>(static_cast<int64_t>(entry)) >= static_cast<uint64_t>(bound);
}

// The fast form of the same test over a range of entries, for a bound in
// [1, 2^31), in two accumulations that vectorise without 64-bit compares
// (SSE2 has none) and with no shift or compare per entry:
//   the OR of the entries as unsigned 64-bit values (all_bits) is below 2^31
//   iff every entry is in [0, 2^31) (a negative one sets bit 63);
//   each such entry, exact as an int32, is below bound iff uint32(entry) -
//   bound wraps, i.e. sets bit 31; it does for every entry iff it does in the
//   AND of those differences (below_bound).
template <typename Int>
uint64_t bits_of(Int entry) {
  return static_cast<uint64_t>(static_cast<int64_t>(entry));
}
inline uint32_t difference(int32_t value, int32_t bound) {
  return static_cast<uint32_t>(value) - static_cast<uint32_t>(bound);
}
inline bool all_in_range(uint64_t all_bits, uint32_t below_bound) {
  return (all_bits >> 31) == 0 && (below_bound >> 31) == 1;
}

// A summary of some rows, gathered where they are computed at two
// instructions per four rows: their AND and OR bound them, [all_and, all_or],
// and are equal iff the rows are (SSE2 has no int32 min or max: a separate
// min/max pass was 17 % of an interleaved build).
struct RowSummary {
  int32_t all_and = -1, all_or = 0;
};

// rows[s] = row_index[s] for s in [0, n), in one branch-free pass that also
// gathers the range test of every entry and the rows' summary; only when
// some entry is out of range does a second pass find the first. Returns its
// position, or -1.
template <typename Int>
inline __attribute__((always_inline)) int64_t rows_from_row_index_body(const Int* row_index, int64_t n,
                                                                       int64_t num_rows, int32_t* rows,
                                                                       RowSummary* summary) {
  const int32_t bound = static_cast<int32_t>(num_rows);
  uint64_t all_bits = 0;
  uint32_t below_bound = ~uint32_t{0};
  int32_t all_and = -1, all_or = 0;
  for (int64_t s = 0; s < n; ++s) {
    const int32_t row = static_cast<int32_t>(row_index[s]);  // exact when every entry is in [0, 2^31)
    all_bits |= bits_of(row_index[s]);
    below_bound &= difference(row, bound);
    all_and &= row;
    all_or |= row;
    rows[s] = row;
  }
  *summary = {all_and, all_or};
  if (all_in_range(all_bits, below_bound)) return -1;
  int64_t s = 0;
  while (!outside(row_index[s], num_rows)) ++s;
  return s;
}

// rows[s] = ti[s]*3 + tag[s], the same way. The row is computed in uint32
// (wrapping is defined) and is only kept when every entry is in range, where
// it is below 2^31.
template <typename Int>
inline __attribute__((always_inline)) int64_t rows_from_timesteps_and_tags_body(const Int* ti, const Int* tags,
                                                                                int64_t n, int64_t num_timesteps,
                                                                                int32_t* rows, RowSummary* summary) {
  const int32_t bound = static_cast<int32_t>(num_timesteps);
  uint64_t all_bits = 0;
  uint32_t below_bound = ~uint32_t{0};
  int32_t all_and = -1, all_or = 0;
  for (int64_t s = 0; s < n; ++s) {
    const int32_t timestep = static_cast<int32_t>(ti[s]), tag = static_cast<int32_t>(tags[s]);
    all_bits |= bits_of(ti[s]) | bits_of(tags[s]);
    below_bound &= difference(timestep, bound) & difference(tag, kNumModalities);
    const int32_t row =
        static_cast<int32_t>(static_cast<uint32_t>(timestep) * kNumModalities + static_cast<uint32_t>(tag));
    all_and &= row;
    all_or |= row;
    rows[s] = row;
  }
  *summary = {all_and, all_or};
  if (all_in_range(all_bits, below_bound)) return -1;
  int64_t s = 0;
  while (!outside(ti[s], num_timesteps) && !outside(tags[s], kNumModalities)) ++s;
  return s;
}

// The two validation passes are compiled twice: for the baseline ISA, and
// with AVX2, picked at run time when the CPU has it. Both are the same
// integer arithmetic, so the choice changes no bit; AVX2 converts and checks
// eight entries per instruction instead of four, and the pass, which reads
// the index (2 MB of int64 at S = 131072) and is most of a build, takes 29
// instead of 40 us there on the 2-core development host.
template <typename Int>
int64_t rows_from_row_index_baseline(const Int* row_index, int64_t n, int64_t num_rows, int32_t* rows,
                                     RowSummary* summary) {
  return rows_from_row_index_body(row_index, n, num_rows, rows, summary);
}
template <typename Int>
int64_t rows_from_timesteps_and_tags_baseline(const Int* ti, const Int* tags, int64_t n, int64_t num_timesteps,
                                              int32_t* rows, RowSummary* summary) {
  return rows_from_timesteps_and_tags_body(ti, tags, n, num_timesteps, rows, summary);
}
#if defined(__x86_64__) && defined(__GNUC__)
template <typename Int>
__attribute__((target("avx2"))) int64_t rows_from_row_index_avx2(const Int* row_index, int64_t n, int64_t num_rows,
                                                                 int32_t* rows, RowSummary* summary) {
  return rows_from_row_index_body(row_index, n, num_rows, rows, summary);
}
template <typename Int>
__attribute__((target("avx2"))) int64_t rows_from_timesteps_and_tags_avx2(const Int* ti, const Int* tags, int64_t n,
                                                                          int64_t num_timesteps, int32_t* rows,
                                                                          RowSummary* summary) {
  return rows_from_timesteps_and_tags_body(ti, tags, n, num_timesteps, rows, summary);
}
bool cpu_has_avx2() {
  static const bool has_avx2 = (__builtin_cpu_init(), __builtin_cpu_supports("avx2"));
  return has_avx2;
}
#endif

template <typename Int>
int64_t rows_from_row_index(const Int* row_index, int64_t n, int64_t num_rows, int32_t* rows, RowSummary* summary) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (cpu_has_avx2()) return rows_from_row_index_avx2(row_index, n, num_rows, rows, summary);
#endif
  return rows_from_row_index_baseline(row_index, n, num_rows, rows, summary);
}
template <typename Int>
int64_t rows_from_timesteps_and_tags(const Int* ti, const Int* tags, int64_t n, int64_t num_timesteps, int32_t* rows,
                                     RowSummary* summary) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (cpu_has_avx2()) return rows_from_timesteps_and_tags_avx2(ti, tags, n, num_timesteps, rows, summary);
#endif
  return rows_from_timesteps_and_tags_baseline(ti, tags, n, num_timesteps, rows, summary);
}

Status check_sizes(int64_t seq_len, int64_t num_rows, int64_t batch) {
  if (batch < 1) return Status::value_error("batch must be >= 1, got " + std::to_string(batch));
  if (num_rows < 1) return Status::value_error("num_rows must be >= 1, got " + std::to_string(num_rows));
  if (num_rows > std::numeric_limits<int32_t>::max())
    return Status::value_error("num_rows must be < 2^31, got " + std::to_string(num_rows));
  if (seq_len > std::numeric_limits<int32_t>::max() / batch)
    return Status::value_error("batch * seq_len must be < 2^31 positions, got " + std::to_string(batch) + " * " +
                               std::to_string(seq_len));
  return Status();
}

constexpr int32_t kChunk = static_cast<int32_t>(kReductionChunk);

// A narrow chunk's rows lie in [lo, lo + 254]; each is sorted by its one-byte
// key row - lo, and the byte kNoKey, never a key, ends the keys.
constexpr int32_t kNarrowSpan = 254;
constexpr uint8_t kNoKey = 255;

// Narrow chunks whose keys take fewer than this many values are counted one
// value at a time, by a vectorised compare over the chunk's keys; wider ones
// by one counter update per position. (Measured on the 2-core development
// host: ~3.4 ns per value and chunk against ~94 ns per chunk, even near 28.)
constexpr int32_t kCountByCompareSpan = 28;

// The lowest and highest of rows[0, n).
void exact_row_span(const int32_t* rows, int32_t n, int32_t* lo, int32_t* hi) {
  int32_t low = rows[0], high = rows[0];
  for (int32_t i = 0; i < n; ++i) {
    low = std::min(low, rows[i]);
    high = std::max(high, rows[i]);
  }
  *lo = low;
  *hi = high;
}

// The number of the n keys equal to key, which the caller guarantees is at
// most 255 (the byte accumulator keeps the loop in byte lanes, 16 per
// compare). Not inlined: inlined, GCC vectorised the caller's loop over the
// key values instead of this one (4.2 instead of 0.8 ns per position).
__attribute__((noinline)) uint8_t count_of_key(const uint8_t* keys, int32_t n, uint8_t key) {
  uint8_t count = 0;
  for (int32_t i = 0; i < n; ++i) count = static_cast<uint8_t>(count + (keys[i] == key));
  return count;
}

#if defined(__x86_64__) && defined(__GNUC__)
// The offsets 0..255 of a chunk's positions, as bytes.
struct ChunkOffsets {
  alignas(64) uint8_t value[kChunk];
};
constexpr ChunkOffsets make_chunk_offsets() {
  ChunkOffsets offsets{};
  for (int32_t i = 0; i < kChunk; ++i) offsets.value[i] = static_cast<uint8_t>(i);
  return offsets;
}
constexpr ChunkOffsets kChunkOffsets = make_chunk_offsets();

// The stable sort of a whole chunk (256 positions from `first`) by byte keys
// in [0, span], without the counting sort's scatter: for each key in
// ascending order, the offsets of the positions with that key are compressed
// out of each 64-key block in ascending order (vpcompressb) and appended, so
// `positions` comes out in the counting sort's order (the tables do not
// depend on the path); count[key] gets the number of them. On the 2-core
// development host (AVX-512 with VBMI2) an interleaved build at S = 131072,
// B = 2 took 168-170 instead of 226-299 us.
__attribute__((target("avx512f,avx512bw,avx512vbmi2,popcnt"))) void sort_chunk_by_key_avx512(
    const uint8_t* keys, int32_t span, int32_t first, int32_t* count, int32_t* positions) {
  __m512i key_blocks[4], offsets[4];
  for (int j = 0; j < 4; ++j) {
    key_blocks[j] = _mm512_loadu_si512(keys + 64 * j);
    offsets[j] = _mm512_load_si512(kChunkOffsets.value + 64 * j);
  }
  alignas(64) uint8_t grouped[kChunk + 64];  // 64 bytes of slack: every store writes a whole block
  int32_t written = 0;
  for (int32_t key = 0; key <= span; ++key) {
    const __m512i wanted = _mm512_set1_epi8(static_cast<char>(key));
    const int32_t before = written;
    for (int j = 0; j < 4; ++j) {
      const __mmask64 match = _mm512_cmpeq_epi8_mask(key_blocks[j], wanted);
      _mm512_storeu_si512(grouped + written, _mm512_maskz_compress_epi8(match, offsets[j]));
      written += static_cast<int32_t>(__builtin_popcountll(match));
    }
    count[key] = written - before;
  }
  const __m512i base = _mm512_set1_epi32(first);
  for (int32_t i = 0; i < kChunk; i += 16) {
    // the masked form: GCC 12 warns of the unmasked one's undefined source vector
    const __m512i offset =
        _mm512_maskz_cvtepu8_epi32(0xFFFF, _mm_load_si128(reinterpret_cast<const __m128i*>(grouped + i)));
    _mm512_storeu_si512(positions + i, _mm512_add_epi32(base, offset));
  }
}
bool cpu_has_avx512_vbmi2() {
  static const bool has = (__builtin_cpu_init(), __builtin_cpu_supports("avx512bw") &&
                                                     __builtin_cpu_supports("avx512vbmi2"));
  return has;
}
#endif

// The per-chunk step of the table build: a stable sort of one chunk's
// positions by row, appended to impl's segment tables. Chunks are added in
// ascending order, so the tables are written front to back and need not be
// allocated zero-filled first (a zero-filled segment_positions of B*S entries
// cost 6-9 us of a build at S = 131072, B = 2). The chunk's segments and
// positions are gathered in the sorter's buffers and appended once.
class ChunkSorter {
 public:
  // by_row: the plan's (R+1) row_segment_begin table, all zeros, lent as the
  // per-row scratch of chunks that span more than 255 rows (the one
  // allocation of R entries, so a plan's memory is O(B*S) + 4(R+1) bytes);
  // it is all zeros again after every chunk.
  explicit ChunkSorter(IndexPlan::Impl* impl) : impl_(impl), by_row_(impl->row_segment_begin.data()) {}

  // The chunk whose positions are [first, first + n), n <= 256, rows[i] the
  // row of position first + i.
  void add_chunk(const int32_t* rows, int32_t n, int32_t first) {
    RowSummary summary;
    for (int32_t i = 0; i < n; ++i) {
      summary.all_and &= rows[i];
      summary.all_or |= rows[i];
    }
    add_chunk(rows, n, first, summary);
  }

  // The same, with the rows' summary gathered by the caller.
  void add_chunk(const int32_t* rows, int32_t n, int32_t first, const RowSummary& summary) {
    chunk_first_ = first;
    if (summary.all_and == summary.all_or) {
      // One segment, its positions in order (block packings: most chunks).
      add_segment(summary.all_and, n);
      for (int32_t i = 0; i < n; ++i) positions_[i] = first + i;
    } else {
      sort_mixed_chunk(rows, n, first, summary);
    }
    append_chunk(n);
  }

 private:
  // Adds a segment of count positions after the chunk's segments so far and
  // returns its first slot in positions_.
  int32_t add_segment(int32_t row, int32_t count) {
    const int32_t slot = slots_used_;
    slots_used_ += count;
    segment_row_[segments_] = row;
    segment_end_[segments_] = chunk_first_ + slots_used_;  // slot 0 is position chunk_first_ of the table
    ++segments_;
    return slot;
  }

  // A chunk of at least two distinct rows.
  void sort_mixed_chunk(const int32_t* rows, int32_t n, int32_t first, const RowSummary& summary) {
    // The bounds are loose where the rows cross a power of two (255 and 256
    // give [0, 511]); then the exact int32 span decides.
    int32_t base = summary.all_and;
    if (summary.all_or - summary.all_and > kNarrowSpan) {
      int32_t lo, hi;
      exact_row_span(rows, n, &lo, &hi);
      if (hi - lo > kNarrowSpan) {
        sort_wide_chunk(rows, n, first);
        return;
      }
      base = lo;
    }
    sort_narrow_chunk(rows, n, first, base);
  }

  // Rows within [base, base + 254], sorted by their byte keys row - lo.
  void sort_narrow_chunk(const int32_t* rows, int32_t n, int32_t first, int32_t base) {
    for (int32_t i = 0; i < n; ++i) keys_[i] = static_cast<uint8_t>(rows[i] - base);
    uint8_t low_key = kNoKey, high_key = 0;  // byte min and max: 16 per SSE2 instruction
    for (int32_t i = 0; i < n; ++i) {
      low_key = std::min(low_key, keys_[i]);
      high_key = std::max(high_key, keys_[i]);
    }
    if (low_key != 0)
      for (int32_t i = 0; i < n; ++i) keys_[i] = static_cast<uint8_t>(keys_[i] - low_key);
    const int32_t lo = base + low_key, span = high_key - low_key;
    std::memset(keys_ + n, kNoKey, 8);  // ends the last run for next_run_start
    // Runs of equal keys, counted branch-free (at most 255 changes: a byte).
    uint8_t changes = 0;
    for (int32_t i = 1; i < n; ++i) changes = static_cast<uint8_t>(changes + (keys_[i] != keys_[i - 1]));
    const int32_t runs = 1 + changes;
    int32_t* count = slot_of_key_;  // first each key's count, then its segment's next slot
    std::fill_n(count, span + 1, 0);
    if (runs * 8 <= n) {
      // Long runs (block packings) are counted and written a run at a time:
      // a loop over positions would chain its updates of one key's counter
      // through memory.
      int32_t run_begin[kChunk];
      for (int32_t i = 0, r = 0; i < n; ++r) {
        run_begin[r] = i;
        const int32_t end = next_run_start(i);
        count[keys_[i]] += end - i;
        i = end;
      }
      add_narrow_segments(lo, span);
      for (int32_t r = 0; r < runs; ++r) {
        const int32_t begin = run_begin[r], end = r + 1 < runs ? run_begin[r + 1] : n;
        int32_t* out = positions_ + count[keys_[begin]];
        for (int32_t i = begin; i < end; ++i) *out++ = first + i;
        count[keys_[begin]] += end - begin;
      }
      return;
    }
    // Short runs (interleaved packings) go position by position. Each key's
    // count is at most n - 1 <= 255: the chunk has two distinct rows.
#if defined(__x86_64__) && defined(__GNUC__)
    // A whole chunk with few keys, where the CPU has AVX-512 VBMI2: sorted
    // without a scatter (partial chunks, and other CPUs, take the loops below).
    if (n == kChunk && span < kCountByCompareSpan && cpu_has_avx512_vbmi2()) {
      sort_chunk_by_key_avx512(keys_, span, first, count, positions_);
      add_narrow_segments(lo, span);
      return;
    }
#endif
    if (span < kCountByCompareSpan) {
      for (int32_t key = 0; key <= span; ++key) count[key] = count_of_key(keys_, n, static_cast<uint8_t>(key));
    } else {
      for (int32_t i = 0; i < n; ++i) ++count[keys_[i]];
    }
    add_narrow_segments(lo, span);
    for (int32_t i = 0; i < n; ++i) positions_[count[keys_[i]]++] = first + i;
  }

  // The segments of a narrow chunk in ascending row (key) order; each key's
  // count becomes its segment's first slot.
  void add_narrow_segments(int32_t lo, int32_t span) {
    int32_t* count = slot_of_key_;
    for (int32_t key = 0; key <= span; ++key)
      if (count[key] != 0) count[key] = add_segment(lo + key, count[key]);
  }

  // Rows spanning more than 255 rows (few in practice: a random index over
  // many rows): a counting sort with the (R,) scratch and the chunk's
  // distinct rows sorted.
  void sort_wide_chunk(const int32_t* rows, int32_t n, int32_t first) {
    for (int32_t i = 0; i < n; ++i) ++by_row_[rows[i]];
    int32_t distinct[kChunk];
    std::copy_n(rows, n, distinct);
    std::sort(distinct, distinct + n);
    const int32_t* distinct_end = std::unique(distinct, distinct + n);
    for (const int32_t* row = distinct; row != distinct_end; ++row) by_row_[*row] = add_segment(*row, by_row_[*row]);
    for (int32_t i = 0; i < n; ++i) positions_[by_row_[rows[i]]++] = first + i;
    for (const int32_t* row = distinct; row != distinct_end; ++row) by_row_[*row] = 0;
  }

  // Appends the chunk gathered in the buffers: its positions, and per segment
  // its row and its end in segment_positions.
  void append_chunk(int32_t n) {
    IndexPlan::Impl& impl = *impl_;
    impl.segment_positions.insert(impl.segment_positions.end(), positions_, positions_ + n);
    impl.segment_row.insert(impl.segment_row.end(), segment_row_, segment_row_ + segments_);
    impl.segment_pos_begin.insert(impl.segment_pos_begin.end(), segment_end_, segment_end_ + segments_);
    impl.max_chunk_segments = std::max<int64_t>(impl.max_chunk_segments, segments_);
    segments_ = 0;
    slots_used_ = 0;
  }

  // The first run start after i (keys_[n] = kNoKey ends the search), eight
  // keys per step: the first byte of the 8-byte word at j that differs from key.
  int32_t next_run_start(int32_t i) const {
    const uint64_t key = keys_[i] * 0x0101010101010101ull;
    for (int32_t j = i + 1;; j += 8) {
      uint64_t word;
      std::memcpy(&word, keys_ + j, sizeof(word));
      if (word != key) return j + __builtin_ctzll(word ^ key) / 8;  // little-endian: byte k is key j + k
    }
  }

  IndexPlan::Impl* impl_;
  int32_t* by_row_;  // (R,)
  // The chunk being added: its first position p, which is also where its
  // positions start in segment_positions (the chunks before it hold exactly
  // the positions before it), its segments so far and the positions they hold.
  int32_t chunk_first_ = 0, segments_ = 0, slots_used_ = 0;
  int32_t segment_row_[kChunk], segment_end_[kChunk];
  int32_t positions_[kChunk];    // the chunk's positions, grouped by segment
  int32_t slot_of_key_[kChunk];  // narrow chunks: per key, its count, then its segment's next slot
  uint8_t keys_[kChunk + 8];     // narrow chunks: row - lo of each position, then kNoKey
};
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "ChunkSorter::next_run_start reads its keys little-endian");

// Chunk tables from an index of S positions. to_rows(begin, n, rows)
// validates the entries [begin, begin + n) and converts them to rows,
// returning the first bad position or -1; bad_entry(s) is the IndexError of
// the bad entry at s.
//
// The index is read once, in chunk-sized pieces: each piece of [0, S) is
// validated into a 1 KB buffer and, when it is a whole chunk of item 0, sorted
// from there while it is in L1 (one pass over the positions instead of a
// validation pass and a sorting pass over 512 KB of rows).
template <typename ToRows, typename BadEntry>
Status build(int64_t seq_len, int64_t num_rows, int64_t batch, ToRows to_rows, BadEntry bad_entry,
             const Device& device, Stream stream, IndexPlan* plan) {
  auto impl = std::make_shared<IndexPlan::Impl>();
  const int64_t positions = seq_len * batch;
  const int64_t num_chunks = (positions + kReductionChunk - 1) / kReductionChunk;
  impl->seq_len = seq_len;
  impl->batch = batch;
  impl->num_rows = num_rows;
  impl->positions = positions;
  impl->num_chunks = num_chunks;
  impl->device = device;
  impl->row_of_seq.reserve(static_cast<std::size_t>(seq_len));
  impl->chunk_segment_begin.reserve(static_cast<std::size_t>(num_chunks + 1));
  impl->segment_positions.reserve(static_cast<std::size_t>(positions));
  impl->segment_pos_begin.push_back(0);
  impl->row_segment_begin.assign(static_cast<std::size_t>(num_rows + 1), 0);
  ChunkSorter sorter(impl.get());
  std::vector<int32_t>& row_of_seq = impl->row_of_seq;

  // The chunks that lie within item 0, each validated and sorted in turn.
  int32_t piece[kChunk];
  const int64_t item0_chunks = seq_len / kReductionChunk;
  for (int64_t c = 0; c < item0_chunks; ++c) {
    const int64_t first = c * kReductionChunk;
    RowSummary summary;
    const int64_t bad = to_rows(first, kReductionChunk, piece, &summary);
    if (bad >= 0) return bad_entry(bad);
    row_of_seq.insert(row_of_seq.end(), piece, piece + kChunk);
    impl->chunk_segment_begin.push_back(static_cast<int32_t>(impl->segment_row.size()));
    sorter.add_chunk(piece, kChunk, static_cast<int32_t>(first), summary);
  }
  const int64_t tail_begin = item0_chunks * kReductionChunk;
  if (tail_begin < seq_len) {
    RowSummary unused;  // the tail's chunk is sorted below, with the next item's first rows
    const int64_t bad = to_rows(tail_begin, seq_len - tail_begin, piece, &unused);
    if (bad >= 0) return bad_entry(bad);
    row_of_seq.insert(row_of_seq.end(), piece, piece + (seq_len - tail_begin));
  }

  // When 256 divides S, no chunk straddles two batch items, and batch item
  // b's chunks are item 0's with positions + b*S and segments + b*G0, so they
  // are copied, not sorted.
  const bool replicated = tail_begin == seq_len;
  const int32_t segments0 = static_cast<int32_t>(impl->segment_row.size());
  if (replicated) {
    const int64_t chunks0 = item0_chunks;
    impl->segment_row.reserve(static_cast<std::size_t>(segments0 * batch));
    impl->segment_pos_begin.reserve(static_cast<std::size_t>(segments0 * batch + 1));
    for (int64_t b = 1; b < batch; ++b) {
      const int32_t segment_shift = static_cast<int32_t>(b) * segments0;
      const int32_t position_shift = static_cast<int32_t>(b * seq_len);
      for (int64_t c = 0; c < chunks0; ++c)
        impl->chunk_segment_begin.push_back(impl->chunk_segment_begin[c] + segment_shift);
      // Item b's segments follow item b-1's: b*G0 rows and 1 + b*G0 segment ends so far.
      impl->segment_row.resize(impl->segment_row.size() + segments0);
      std::copy_n(impl->segment_row.data(), segments0, impl->segment_row.data() + b * segments0);
      impl->segment_pos_begin.resize(impl->segment_pos_begin.size() + segments0);
      int32_t* pos_begin = impl->segment_pos_begin.data();
      int32_t* item_pos_begin = pos_begin + 1 + b * segments0;
      for (int32_t g = 0; g < segments0; ++g) item_pos_begin[g] = pos_begin[g + 1] + position_shift;
      // A resize zero-fills before the copy overwrites, but an insert from
      // the vector into itself is not allowed, and appending through an L1
      // buffer measured no faster.
      impl->segment_positions.resize(static_cast<std::size_t>((b + 1) * seq_len));
      int32_t* item0 = impl->segment_positions.data();
      int32_t* item = item0 + b * seq_len;
      for (int64_t i = 0; i < seq_len; ++i) item[i] = item0[i] + position_shift;
    }
  } else {
    // The rest of the positions, from the first chunk that is not inside
    // item 0 on, with rows from the now complete row_of_seq.
    int32_t straddling_rows[kChunk];  // rows of a chunk that wraps past s = S - 1
    int64_t s = tail_begin;  // sequence position of the chunk's first position p (p % S, advanced incrementally)
    for (int64_t first = tail_begin; first < positions; first += kReductionChunk) {
      impl->chunk_segment_begin.push_back(static_cast<int32_t>(impl->segment_row.size()));
      const int64_t n = std::min(kReductionChunk, positions - first);
      const int32_t* rows = row_of_seq.data() + s;
      if (s + n <= seq_len) {
        s += n;
      } else {
        for (int64_t i = 0; i < n; ++i, s = (s + 1 == seq_len ? 0 : s + 1)) straddling_rows[i] = row_of_seq[s];
        rows = straddling_rows;
      }
      if (s == seq_len) s = 0;
      sorter.add_chunk(rows, static_cast<int32_t>(n), static_cast<int32_t>(first));
    }
  }
  impl->chunk_segment_begin.push_back(static_cast<int32_t>(impl->segment_row.size()));
  const int64_t num_segments = static_cast<int64_t>(impl->segment_row.size());
  impl->num_segments = num_segments;

  // Segments of each row in ascending chunk order: a counting sort by row
  // (the sorter left row_segment_begin all zeros). begin[r] is used as row
  // r's cursor, which leaves it at begin[r + 1]; one shift restores it. When
  // the items are copies, row r's segments are item 0's, then those + G0,
  // + 2*G0, ...: only item 0's G0 segments are sorted, and each row's list is
  // written B times (5 of 92 us in an interleaved build, S = 131072, B = 2).
  const int64_t sorted_segments = replicated ? segments0 : num_segments;
  const int64_t copies = replicated ? batch : 1;
  int32_t* begin = impl->row_segment_begin.data();
  const int32_t* segment_row = impl->segment_row.data();
  for (int64_t g = 0; g < sorted_segments; ++g) ++begin[segment_row[g] + 1];
  for (int64_t r = 0; r < num_rows; ++r) begin[r + 1] += begin[r];
  std::vector<int32_t> sorted(static_cast<std::size_t>(sorted_segments));
  for (int64_t g = 0; g < sorted_segments; ++g) sorted[begin[segment_row[g]]++] = static_cast<int32_t>(g);
  std::copy_backward(begin, begin + num_rows, begin + num_rows + 1);
  begin[0] = 0;
  if (copies == 1) {
    impl->row_segments = std::move(sorted);
  } else {
    impl->row_segments.resize(static_cast<std::size_t>(num_segments));
    int32_t* out = impl->row_segments.data();
    for (int64_t r = 0; r < num_rows; ++r) {
      const int32_t* list = sorted.data() + begin[r];
      const int32_t count = begin[r + 1] - begin[r];
      for (int64_t b = 0; b < copies; ++b, out += count) {
        const int32_t shift = static_cast<int32_t>(b) * segments0;
        for (int32_t i = 0; i < count; ++i) out[i] = list[i] + shift;
      }
    }
    for (int64_t r = 1; r <= num_rows; ++r) begin[r] *= static_cast<int32_t>(copies);
  }

  PlanTables& h = impl->host;
  h.row_of_seq = impl->row_of_seq.data();
  h.chunk_segment_begin = impl->chunk_segment_begin.data();
  h.segment_row = impl->segment_row.data();
  h.segment_pos_begin = impl->segment_pos_begin.data();
  h.segment_positions = impl->segment_positions.data();
  h.row_segment_begin = impl->row_segment_begin.data();
  h.row_segments = impl->row_segments.data();
  impl->device_tables = h;
  if (device.is_cuda()) {
    std::vector<const int32_t*> d;
    DETDIT_RETURN_IF_ERROR(cuda::upload_tables(
        device,
        {&impl->row_of_seq, &impl->chunk_segment_begin, &impl->segment_row, &impl->segment_pos_begin,
         &impl->segment_positions, &impl->row_segment_begin, &impl->row_segments},
        &d, &impl->device_memory, stream));
    PlanTables& t = impl->device_tables;
    t.row_of_seq = d[0];
    t.chunk_segment_begin = d[1];
    t.segment_row = d[2];
    t.segment_pos_begin = d[3];
    t.segment_positions = d[4];
    t.row_segment_begin = d[5];
    t.row_segments = d[6];
  }
  PlanBuilder::set(plan, std::move(impl));
  return Status();
}

Status build_from_row_index(const TensorView& row_index, int64_t num_rows, int64_t batch, IndexPlan* plan,
                            Stream stream) {
  DETDIT_RETURN_IF_ERROR(check_index_tensor(row_index, "row_index"));
  DETDIT_RETURN_IF_ERROR(check_sizes(row_index.shape[0], num_rows, batch));
  std::vector<char> staging;
  const void* entries = nullptr;
  DETDIT_RETURN_IF_ERROR(host_entries(row_index, stream, &staging, &entries));
  const int64_t seq_len = row_index.shape[0];
  auto bad_entry = [&](int64_t bad, int64_t value) {
    return Status::index_error("row_index[" + std::to_string(bad) + "] = " + std::to_string(value) +
                               " is outside [0, " + std::to_string(num_rows) + ") (num_rows = " +
                               std::to_string(num_rows) + ")");
  };
  auto build_typed = [&](const auto* index) {
    auto to_rows = [index, num_rows](int64_t begin, int64_t n, int32_t* rows, RowSummary* summary) {
      const int64_t bad = rows_from_row_index(index + begin, n, num_rows, rows, summary);
      return bad < 0 ? bad : begin + bad;
    };
    return build(
        seq_len, num_rows, batch, to_rows, [&](int64_t bad) { return bad_entry(bad, int64_t{index[bad]}); },
        row_index.device, stream, plan);
  };
  return row_index.dtype == DType::kI64 ? build_typed(static_cast<const int64_t*>(entries))
                                        : build_typed(static_cast<const int32_t*>(entries));
}

Status build_from_timesteps_and_tags(const TensorView& timestep_indices, const TensorView& token_tags,
                                     int64_t num_timesteps, int64_t batch, IndexPlan* plan, Stream stream) {
  DETDIT_RETURN_IF_ERROR(check_index_tensor(timestep_indices, "timestep_indices"));
  DETDIT_RETURN_IF_ERROR(check_index_tensor(token_tags, "token_tags"));
  if (token_tags.dtype != timestep_indices.dtype)
    return Status::type_error(std::string("timestep_indices and token_tags must share an integer dtype, got ") +
                              dtype_name(timestep_indices.dtype) + " and " + dtype_name(token_tags.dtype));
  DETDIT_RETURN_IF_ERROR(check::same_device(token_tags, "token_tags", timestep_indices, "timestep_indices"));
  if (token_tags.shape[0] != timestep_indices.shape[0])
    return Status::value_error("timestep_indices (" + std::to_string(timestep_indices.shape[0]) +
                               ") and token_tags (" + std::to_string(token_tags.shape[0]) +
                               ") must have the same length");
  if (num_timesteps < 1) return Status::value_error("num_timesteps must be >= 1, got " + std::to_string(num_timesteps));
  if (num_timesteps > std::numeric_limits<int32_t>::max() / kNumModalities)
    return Status::value_error("num_timesteps must be < 2^31 / 3, got " + std::to_string(num_timesteps));
  const int64_t num_rows = num_timesteps * kNumModalities;
  DETDIT_RETURN_IF_ERROR(check_sizes(timestep_indices.shape[0], num_rows, batch));
  std::vector<char> ti_staging, tag_staging;
  const void* ti_entries = nullptr;
  const void* tag_entries = nullptr;
  DETDIT_RETURN_IF_ERROR(host_entries(timestep_indices, stream, &ti_staging, &ti_entries));
  DETDIT_RETURN_IF_ERROR(host_entries(token_tags, stream, &tag_staging, &tag_entries));
  const int64_t seq_len = timestep_indices.shape[0];
  auto bad_entry = [&](int64_t bad, int64_t ti, int64_t tag) {
    if (outside(ti, num_timesteps))
      return Status::index_error("timestep_indices[" + std::to_string(bad) + "] = " + std::to_string(ti) +
                                 " is outside [0, " + std::to_string(num_timesteps) + ") (num_timesteps)");
    return Status::index_error("token_tags[" + std::to_string(bad) + "] = " + std::to_string(tag) +
                               " is outside [0, 3) (0 video, 1 text, 2 audio)");
  };
  auto build_typed = [&](const auto* ti, const auto* tags) {
    auto to_rows = [ti, tags, num_timesteps](int64_t begin, int64_t n, int32_t* rows, RowSummary* summary) {
      const int64_t bad = rows_from_timesteps_and_tags(ti + begin, tags + begin, n, num_timesteps, rows, summary);
      return bad < 0 ? bad : begin + bad;
    };
    return build(
        seq_len, num_rows, batch, to_rows,
        [&](int64_t bad) { return bad_entry(bad, int64_t{ti[bad]}, int64_t{tags[bad]}); }, timestep_indices.device,
        stream, plan);
  };
  return timestep_indices.dtype == DType::kI64
             ? build_typed(static_cast<const int64_t*>(ti_entries), static_cast<const int64_t*>(tag_entries))
             : build_typed(static_cast<const int32_t*>(ti_entries), static_cast<const int32_t*>(tag_entries));
}

// The RuntimeError of a builder that ran out of memory (out_of_memory_is_an_error):
// the tables take at most 4 * (S + 4*B*S + R + C + 3) bytes (S rows, B*S
// positions, at most B*S segments in three tables, R + 1 row starts, C + 1
// chunk starts). The sizes are doubles: they may be unvalidated arguments (no
// overflow in the message).
std::string out_of_memory_message(double seq_len, double num_rows, double batch) {
  const double positions = seq_len * batch;
  const double bytes = 4.0 * (seq_len + 4.0 * positions + num_rows + positions / kReductionChunk + 3.0);
  char message[256];
  std::snprintf(message, sizeof message,
                "out of memory building the index plan (S = %.0f, B = %.0f, R = %.0f): its tables take up to "
                "%.0f MB, 4 bytes per table row among them",
                seq_len, batch, num_rows, bytes / 1e6);
  return message;
}

}  // namespace

Status IndexPlan::from_row_index(const TensorView& row_index, int64_t num_rows, int64_t batch, IndexPlan* plan,
                                 Stream stream) {
  return out_of_memory_is_an_error(
      [&] {
        return out_of_memory_message(static_cast<double>(row_index.shape[0]), static_cast<double>(num_rows),
                                     static_cast<double>(batch));
      },
      [&] { return build_from_row_index(row_index, num_rows, batch, plan, stream); });
}

Status IndexPlan::from_timesteps_and_tags(const TensorView& timestep_indices, const TensorView& token_tags,
                                          int64_t num_timesteps, int64_t batch, IndexPlan* plan, Stream stream) {
  return out_of_memory_is_an_error(
      [&] {
        return out_of_memory_message(static_cast<double>(timestep_indices.shape[0]),
                                     static_cast<double>(num_timesteps) * kNumModalities, static_cast<double>(batch));
      },
      [&] { return build_from_timesteps_and_tags(timestep_indices, token_tags, num_timesteps, batch, plan, stream); });
}

int64_t IndexPlan::seq_len() const { return impl_ ? impl_->seq_len : 0; }
int64_t IndexPlan::batch() const { return impl_ ? impl_->batch : 0; }
int64_t IndexPlan::num_rows() const { return impl_ ? impl_->num_rows : 0; }
int64_t IndexPlan::positions() const { return impl_ ? impl_->positions : 0; }
int64_t IndexPlan::num_chunks() const { return impl_ ? impl_->num_chunks : 0; }
int64_t IndexPlan::num_segments() const { return impl_ ? impl_->num_segments : 0; }
int64_t IndexPlan::max_chunk_segments() const { return impl_ ? impl_->max_chunk_segments : 0; }
uint64_t IndexPlan::fingerprint() const {
  if (!impl_) return 0;
  const Impl& impl = *impl_;
  std::call_once(impl.fingerprint_once, [&impl] {
    const int64_t sizes[] = {impl.seq_len, impl.batch, impl.num_rows};
    impl.fingerprint = fnv1a_lanes(impl.row_of_seq.data(), impl.row_of_seq.size() * sizeof(int32_t),
                                   fnv1a(sizes, sizeof sizes));
  });
  return impl.fingerprint;
}
Device IndexPlan::device() const { return impl_ ? impl_->device : Device::cpu(); }
// An empty plan has empty tables (all null) rather than a null dereference.
const PlanTables& IndexPlan::host_tables() const {
  static const PlanTables kEmpty;
  return impl_ ? impl_->host : kEmpty;
}
const PlanTables& IndexPlan::device_tables() const {
  static const PlanTables kEmpty;
  return impl_ ? impl_->device_tables : kEmpty;
}

}  // namespace detdit
