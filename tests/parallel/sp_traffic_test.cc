// What the sp_region plan moves, for docs/parallel.md: rows and bytes per
// rank for the test shapes and the H3 shapes (S = 4097, 32768, 131072; block
// and interleaved packing; B = 2; world 2..8), next to the reference design
// that tiles sorted segments (spec 2.4 / 3.11: a tile is owned by the owner of
// its first row in (row, p) order, and every row of a tile owned elsewhere
// moves). The tables are printed and recorded as test properties; the test
// asserts the bound the design promises: a rank sends at most 255 rows per
// batch item (only the chunk that straddles the start of its range), and
// chunk-aligned shards move nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "common/cases.h"
#include "detdit/parallel.h"

namespace detdit {
namespace {

using testing::IndexCase;
using testing::Packing;

constexpr int64_t kH3Hidden = 5376;

// The reference design: max_send = unique rows of any tile (family 0: 256
// positions of p; family 1: 256-row tiles of each table row's positions in
// ascending p) whose owner (owner of the tile's first row) is another rank;
// its partials: family 0 tiles (H fp32 each) and family 1 tiles (2H fp32),
// max over ranks of the tiles a rank owns.
struct ReferenceTraffic {
  int64_t max_send = 0, max_tile_floats_per_hidden = 0;  // max over ranks of (family0 + 2 * family1 tiles)
};
ReferenceTraffic reference_traffic(const IndexCase& c, int world) {
  const int64_t s_len = c.seq_len, positions = c.positions();
  std::vector<int> owner(static_cast<std::size_t>(s_len));
  for (int q = 0; q < world; ++q)
    for (int64_t s = q * s_len / world; s < (q + 1) * s_len / world; ++s) owner[s] = q;
  auto owner_of = [&](int64_t p) { return owner[p % s_len]; };
  std::vector<char> shared(static_cast<std::size_t>(positions), 0);
  std::vector<int64_t> tile_floats(static_cast<std::size_t>(world), 0);
  for (int64_t t = 0; t < positions; t += 256) {  // family 0
    const int tile_owner = owner_of(t);
    tile_floats[tile_owner] += 1;
    for (int64_t p = t; p < std::min(positions, t + 256); ++p)
      if (owner_of(p) != tile_owner) shared[p] = 1;
  }
  std::vector<int64_t> sorted(static_cast<std::size_t>(positions));  // family 1: stable sort by row
  std::iota(sorted.begin(), sorted.end(), 0);
  std::stable_sort(sorted.begin(), sorted.end(),
                   [&](int64_t a, int64_t b) { return c.row(a % s_len) < c.row(b % s_len); });
  for (int64_t i = 0; i < positions;) {
    int64_t end = i;
    while (end < positions && c.row(sorted[end] % s_len) == c.row(sorted[i] % s_len)) ++end;
    for (int64_t t = i; t < end; t += 256) {
      const int tile_owner = owner_of(sorted[t]);
      tile_floats[tile_owner] += 2;
      for (int64_t k = t; k < std::min(end, t + 256); ++k)
        if (owner_of(sorted[k]) != tile_owner) shared[sorted[k]] = 1;
    }
    i = end;
  }
  std::vector<int64_t> sent(static_cast<std::size_t>(world), 0);
  for (int64_t p = 0; p < positions; ++p)
    if (shared[p]) ++sent[owner_of(p)];
  return ReferenceTraffic{*std::max_element(sent.begin(), sent.end()),
                          *std::max_element(tile_floats.begin(), tile_floats.end())};
}

struct TrafficRow {
  int64_t max_send = 0, total_sent = 0, max_chunks = 0, max_segments = 0;
  ReferenceTraffic reference;
};

TrafficRow traffic(const IndexCase& c, int world) {
  SpPlan sp;
  EXPECT_TRUE(SpPlan::create(testing::adaln_plan(c), world, 0, &sp).ok());
  TrafficRow row;
  row.max_send = sp.max_send();
  row.max_chunks = sp.max_chunks();
  row.max_segments = sp.max_segments();
  for (const SpPlan::RankTraffic& t : sp.traffic()) {
    row.total_sent += t.send_rows;
    EXPECT_LE(t.send_rows, 255 * c.batch) << c.name() << " world " << world;  // one straddling chunk per batch item
  }
  row.reference = reference_traffic(c, world);
  return row;
}

// Bytes each rank contributes to the two all-gathers of the modulated
// rmsnorm backward (bf16, H = 5376): rows (x, grad: 2 bytes/elem; rstd 4
// bytes) and partials (d_weight: H fp32 per chunk; [d_shift|d_scale]: 2H fp32
// per segment).
double row_megabytes(int64_t rows) { return rows * (2.0 * kH3Hidden * 2 + 4) / 1e6; }
double partial_megabytes(const TrafficRow& r) {
  return (r.max_chunks * kH3Hidden * 4.0 + r.max_segments * 2.0 * kH3Hidden * 4) / 1e6;
}
double reference_partial_megabytes(const TrafficRow& r) {
  return r.reference.max_tile_floats_per_hidden * kH3Hidden * 4.0 / 1e6;
}

void print_table(const char* title, const std::vector<int64_t>& seq_lens) {
  std::printf("\n%s (B = 2, T = 3, rmsnorm backward bytes at bf16 H = %lld)\n", title,
              static_cast<long long>(kH3Hidden));
  std::printf("| S | packing | world | max_send (rows/rank) | rows moved (all ranks) | reference max_send | "
              "rows MB/rank | partials MB/rank | reference rows MB/rank | reference partials MB/rank |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  for (int64_t seq_len : seq_lens) {
    for (Packing packing : {Packing::kBlock, Packing::kInterleaved}) {
      const IndexCase c = testing::make_index_case(packing, seq_len, 3, 2);
      for (int world = 2; world <= 8; ++world) {
        const TrafficRow r = traffic(c, world);
        const char* name = packing == Packing::kBlock ? "block" : "interleaved";
        std::printf("| %lld | %s | %d | %lld | %lld | %lld | %.2f | %.2f | %.2f | %.2f |\n",
                    static_cast<long long>(seq_len), name, world, static_cast<long long>(r.max_send),
                    static_cast<long long>(r.total_sent), static_cast<long long>(r.reference.max_send),
                    row_megabytes(r.max_send), partial_megabytes(r), row_megabytes(r.reference.max_send),
                    reference_partial_megabytes(r));
        ::testing::Test::RecordProperty(std::string("max_send_S") + std::to_string(seq_len) + "_" + name + "_sp" +
                                            std::to_string(world),
                                        std::to_string(r.max_send) + "/ref " + std::to_string(r.reference.max_send));
        if (seq_len % (world * 256) == 0) {
          EXPECT_EQ(r.total_sent, 0) << "chunk-aligned shards move no rows";
        }
      }
    }
  }
}

TEST(SpTraffic, WorkedExampleThreeRanks) {
  // S = 700, B = 2, world 3: the example of docs/parallel.md.
  const IndexCase c = testing::make_index_case(Packing::kBlock, 700, 1, 2);
  std::printf("worked example: S = 700, B = 2, world = 3, chunks of 256 positions p = b*700 + s\n");
  for (int rank = 0; rank < 3; ++rank) {
    SpPlan sp;
    ASSERT_TRUE(SpPlan::create(testing::adaln_plan(c), 3, rank, &sp).ok());
    const auto& mine = sp.traffic()[rank];
    std::printf("rank %d: positions [%lld, %lld), owns %lld chunks, sends %lld rows, receives %lld rows, max_send %lld\n",
                rank, static_cast<long long>(sp.local_begin()), static_cast<long long>(sp.local_end()),
                static_cast<long long>(mine.chunks), static_cast<long long>(mine.send_rows),
                static_cast<long long>(mine.receive_rows), static_cast<long long>(sp.max_send()));
  }
  SpPlan sp;
  ASSERT_TRUE(SpPlan::create(testing::adaln_plan(c), 3, 0, &sp).ok());
  // Independently derived (docs/parallel.md): rank 0 sends b1 s0..67 (68 rows) to
  // rank 2; rank 1 sends b0 s233..255 (23) and b1 s233..323 (91) to rank 0; rank 2
  // sends b0 s466..511 (46) and b1 s466..579 (114) to rank 1.
  EXPECT_EQ(sp.traffic()[0].send_rows, 68);
  EXPECT_EQ(sp.traffic()[1].send_rows, 23 + 91);
  EXPECT_EQ(sp.traffic()[2].send_rows, 46 + 114);
  EXPECT_EQ(sp.traffic()[0].receive_rows, 23 + 91);
  EXPECT_EQ(sp.max_send(), 160);
  EXPECT_EQ(sp.traffic()[0].chunks, 2);  // chunks 0 (p 0) and 3 (p 768 = b1 s68)
  EXPECT_EQ(sp.traffic()[1].chunks, 2);  // chunks 1 (p 256) and 4 (p 1024 = b1 s324)
  EXPECT_EQ(sp.traffic()[2].chunks, 2);  // chunks 2 (p 512) and 5 (p 1280 = b1 s580)
}

TEST(SpTraffic, TestShapes) { print_table("test shapes", {40, 4097, 32768}); }

TEST(SpTraffic, H3Shapes) { print_table("H3 shapes", {4097, 32768, 131072}); }

}  // namespace
}  // namespace detdit
