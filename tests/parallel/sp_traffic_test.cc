// What the sp_region plan moves, for docs/parallel.md: rows and bytes per
// rank for the test shapes and the H3 shapes (S = 4097, 32768, 131072; block
// and interleaved packing; B = 2; world 2..8), next to an alternative design
// that tiles sorted segments (a 256-row tile of each table row's positions in
// ascending p, owned by the owner of its first row; every row of a tile owned
// elsewhere moves). The tables are printed and recorded as test properties.
//
// Every case (printed or not) is checked against the straddling-row bound,
// derived from the plan's definition alone in check_straddling_rows below:
// per rank, exactly the rows that the definition moves, at most 255 per shard
// boundary per batch item, and in total at most 255 * (world * B - 1);
// chunk-aligned shards move nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "support/cases.h"
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
  int64_t max_send = 0, total_sent = 0, max_chunks = 0, max_segments = 0, links = 0, rows = 0;
  ReferenceTraffic reference;
};

// The straddling-row bound, from the definition of the plan alone
// (include/detdit/parallel.h): positions are flattened p = b*S + s and cut into
// chunks of 256; a chunk belongs to the owner of its first position; a row
// moves when its chunk belongs to another rank.
//
// Rank q holds the run I(q, b) = [b*S + lo_q, b*S + hi_q) of every batch item
// b, lo_q = q*S/world. A chunk holding a position of I(q, b) either starts
// inside I(q, b) (then q owns it and nothing moves) or starts before the run,
// and then it is the one chunk that holds the run's first position
// start = b*S + lo_q. So q sends from I(q, b) only rows of that chunk:
//   none                                 if start % 256 == 0 (the chunk starts at start),
//   min(hi_q - lo_q, 256 - start % 256)  otherwise (at most 255),
// the latter exactly when the chunk's first position belongs to another rank
// (it can belong to q itself when the chunk reaches back over the other ranks'
// rows into I(q, b-1): short sequences, e.g. S = 40 at world 8).
//
// Each run start is a boundary: the world-1 shard boundaries inside every
// batch item (ranks 1..world-1), and, for b >= 1, the boundary between item
// b-1 (rank world-1) and item b (rank 0). The latter straddle too whenever
// 256 does not divide b*S, because chunks run over the flattened p. Item 0's
// rank 0 starts at p = 0 and never sends. Hence, for every case:
//   send_rows(q) <= 255 * B        for q >= 1,
//   send_rows(0) <= 255 * (B - 1),
//   sum over ranks <= 255 * (world * B - 1),
// and 255 * (world - 1) * B alone would be false (S = 515, world 2, B = 2
// moves 760 rows: SpTraffic.BatchBoundariesStraddleToo).
void check_straddling_rows(const IndexCase& c, int world, const SpPlan& sp) {
  const int64_t s_len = c.seq_len, batch = c.batch, chunk = kReductionChunk;
  const std::string where = c.name() + " world " + std::to_string(world);
  auto lo = [&](int64_t q) { return q * s_len / world; };
  auto owner_of = [&](int64_t p) {  // the rank that holds flattened position p
    const int64_t s = p % s_len;
    int64_t q = 0;
    while (s >= lo(q + 1)) ++q;
    return q;
  };
  ASSERT_EQ(static_cast<int64_t>(sp.traffic().size()), world) << where;
  int64_t total = 0, total_received = 0, most = 0;
  for (int64_t q = 0; q < world; ++q) {
    int64_t expected = 0;
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t start = b * s_len + lo(q), length = lo(q + 1) - lo(q), offset = start % chunk;
      if (offset == 0) continue;                             // the run starts a chunk: q owns it
      if (owner_of(start - offset) == q) continue;           // the chunk started in q's previous run
      expected += std::min(length, chunk - offset);  // offset >= 1: at most 255
    }
    const int64_t sent = sp.traffic()[q].send_rows;
    EXPECT_EQ(sent, expected) << where << ": rank " << q << " sends the rows of the chunks that straddle its run starts";
    EXPECT_LE(sent, (chunk - 1) * (q == 0 ? batch - 1 : batch))
        << where << ": rank " << q << " sends at most 255 rows per boundary per batch item";
    total += sent;
    total_received += sp.traffic()[q].receive_rows;
    most = std::max(most, sent);
  }
  EXPECT_LE(total, (chunk - 1) * (world * batch - 1)) << where << ": 255 rows per boundary, world*B - 1 boundaries";
  EXPECT_EQ(total_received, total) << where << ": every moved row is received once";
  EXPECT_EQ(sp.max_send(), most) << where;
  if (s_len % (world * chunk) == 0) {
    EXPECT_EQ(total, 0) << where << ": chunk-aligned shards move no rows";
  }
}

TrafficRow traffic(const IndexCase& c, int world) {
  SpPlan sp;
  EXPECT_TRUE(SpPlan::create(testing::adaln_plan(c), world, 0, &sp).ok());
  check_straddling_rows(c, world, sp);
  TrafficRow row;
  row.max_send = sp.max_send();
  row.max_chunks = sp.max_chunks();
  row.max_segments = sp.max_segments();
  row.links = sp.chain_links();
  row.rows = c.num_rows();
  for (const SpPlan::RankTraffic& t : sp.traffic()) row.total_sent += t.send_rows;
  row.reference = reference_traffic(c, world);
  return row;
}

// Bytes per rank of the modulated rmsnorm backward (bf16, H = 5376): the
// row all-gather (x, grad: 2 bytes/elem; rstd 4 bytes) and the fold chain
// (one broadcast of the FP32 running sums, d_weight H + [d_shift|d_scale]
// (R, 2H), per link), next to the partial all-gather the chain replaced
// (d_weight: H fp32 per chunk; [d_shift|d_scale]: 2H fp32 per segment, padded
// to the most any rank owns).
double row_megabytes(int64_t rows) { return rows * (2.0 * kH3Hidden * 2 + 4) / 1e6; }
double chain_megabytes(const TrafficRow& r) { return r.links * (1.0 + 2.0 * r.rows) * kH3Hidden * 4 / 1e6; }
double gathered_partial_megabytes(const TrafficRow& r) {
  return (r.max_chunks * kH3Hidden * 4.0 + r.max_segments * 2.0 * kH3Hidden * 4) / 1e6;
}
double reference_partial_megabytes(const TrafficRow& r) {
  return r.reference.max_tile_floats_per_hidden * kH3Hidden * 4.0 / 1e6;
}

void print_table(const char* title, const std::vector<int64_t>& seq_lens) {
  std::printf("\n%s (B = 2, T = 3, rmsnorm backward bytes at bf16 H = %lld)\n", title,
              static_cast<long long>(kH3Hidden));
  std::printf("| S | packing | world | max_send (rows/rank) | rows moved (all ranks) | reference max_send | "
              "rows MB/rank | chain links | chain MB/rank | partial all-gather MB/rank (replaced) | "
              "reference rows MB/rank | reference partials MB/rank |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  for (int64_t seq_len : seq_lens) {
    for (Packing packing : {Packing::kBlock, Packing::kInterleaved}) {
      const IndexCase c = testing::make_index_case(packing, seq_len, 3, 2);
      for (int world = 2; world <= 8; ++world) {
        const TrafficRow r = traffic(c, world);
        const char* name = packing == Packing::kBlock ? "block" : "interleaved";
        std::printf("| %lld | %s | %d | %lld | %lld | %lld | %.2f | %lld | %.2f | %.2f | %.2f | %.2f |\n",
                    static_cast<long long>(seq_len), name, world, static_cast<long long>(r.max_send),
                    static_cast<long long>(r.total_sent), static_cast<long long>(r.reference.max_send),
                    row_megabytes(r.max_send), static_cast<long long>(r.links), chain_megabytes(r),
                    gathered_partial_megabytes(r), row_megabytes(r.reference.max_send),
                    reference_partial_megabytes(r));
        ::testing::Test::RecordProperty(std::string("max_send_S") + std::to_string(seq_len) + "_" + name + "_sp" +
                                            std::to_string(world),
                                        std::to_string(r.max_send) + "/ref " + std::to_string(r.reference.max_send));
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
  check_straddling_rows(c, 3, sp);
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

// The boundary between two batch items straddles a chunk like a shard
// boundary: S = 515, world 2 (rank 1 holds s >= 257), B = 2. Rank 1 sends
// b0 s257..511 (255 rows, chunk 1 starts at b0 s256, rank 0's) and b1
// s257..508 (252 rows: chunk 3 = p 768..1023 starts at b1 s253, rank 0's);
// rank 0 sends b1 s0..252 (253 rows: chunk 2 = p 512..767 starts at b0 s512,
// rank 1's). 760 rows: more than 255 * (world - 1) * B = 510, within
// 255 * (world * B - 1) = 765.
TEST(SpTraffic, BatchBoundariesStraddleToo) {
  const IndexCase c = testing::make_index_case(Packing::kBlock, 515, 1, 2);
  SpPlan sp;
  ASSERT_TRUE(SpPlan::create(testing::adaln_plan(c), 2, 0, &sp).ok());
  check_straddling_rows(c, 2, sp);
  EXPECT_EQ(sp.traffic()[0].send_rows, 253);
  EXPECT_EQ(sp.traffic()[1].send_rows, 255 + 252);
  EXPECT_GT(sp.traffic()[0].send_rows + sp.traffic()[1].send_rows, 255 * (2 - 1) * 2);
}

// The bound on sizes the printed tables do not reach: every world 2..8, B in
// {1, 2, 3}, S from one row per rank up to several chunks per rank, shard
// boundaries and batch boundaries on and off the chunk grid.
TEST(SpTraffic, StraddlingRowBoundSweep) {
  for (int64_t seq_len : {8, 40, 255, 256, 257, 515, 700, 768, 1000, 1024, 2048, 4097}) {
    for (int64_t batch : {1, 2, 3}) {
      const IndexCase c = testing::make_index_case(Packing::kInterleaved, seq_len, 3, batch);
      for (int world = 2; world <= 8; ++world) {
        SpPlan sp;
        ASSERT_TRUE(SpPlan::create(testing::adaln_plan(c), world, 0, &sp).ok()) << c.name() << " world " << world;
        check_straddling_rows(c, world, sp);
      }
    }
  }
}

TEST(SpTraffic, TestShapes) { print_table("test shapes", {40, 4097, 32768}); }

TEST(SpTraffic, H3Shapes) { print_table("H3 shapes", {4097, 32768, 131072}); }

}  // namespace
}  // namespace detdit
