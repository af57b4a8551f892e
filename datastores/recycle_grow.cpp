// REST Lab: the model source's draft in one call (datastores/recycle.py's `RecycleStore._grow` and the rows
// `lookup` makes of it, for the CPU).
//
// From the newest token, a tree of the successors the model predicted before: each node's successors those kept
// after the same two tokens (the pair table) when that pair was seen, else after the same token; at depth d the
// first branching[d] of them; a child's chance its parent's times the prior of its rank (the pair prior or the
// token prior); children too unlikely to draft (chance * row_scale < 0.5) are not grown.  Every path ends with
// the share of the chance its children do not take, and is repeated round(share * row_scale) times (half to even)
// as continuation rows, so the draft tree's prefix counts order the nodes by their chance.
//
// The arithmetic is the Python path's, operation for operation (floating-point contraction switched off), so the
// rows are the same rows in the same order; the Python path stays for machines without a compiler.  Built by
// datastores.native at first use.
#pragma GCC optimize("fp-contract=off")
#ifdef __clang__
#pragma clang fp contract(off)
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

struct Node {
    int64_t path_start;  // into the path pool
    int64_t len;
    int64_t before;
    int64_t token;
    double chance;
};

}  // namespace

extern "C" {

// table (vocab, k) int32 successors per token (-1 unknown); pair_keys (slots,) int64 (-1 empty) and pair_table
// (slots, k) int32 per pair previous * vocab + token, in slot ((key * golden) mod 2^64) >> shift, slots at least
// 2^(64 - shift).  Writes up to max_rows rows of `depth` int64 (-1 after a path's end) into rows (room for
// rows_room values) and info[0] = 1 when the root's successors were the pair's (room for info_room); returns the
// number of rows, or -1 for input it does not take (buffers too small for the shapes given included: nothing is
// written then).
int64_t rest_lab_recycle_grow(const int32_t* table, int64_t vocab, int64_t k, const int64_t* pair_keys,
                              const int32_t* pair_table, int64_t slots, uint64_t golden, int64_t shift,
                              const int64_t* branching, int64_t n_branching, const double* pair_prior,
                              int64_t n_pair_prior, const double* token_prior, int64_t n_token_prior,
                              int64_t previous, int64_t root, int64_t depth, double row_scale, int64_t max_rows,
                              int64_t* rows, int64_t rows_room, int64_t* info, int64_t info_room) {
    if (vocab < 1 || k < 1 || depth < 1 || max_rows < 1 || n_pair_prior < 1 || n_token_prior < 1 || root < 0
        || root >= vocab || shift < 2 || shift > 63 || info_room < 1 || rows_room < 0 || max_rows > rows_room / depth
        || slots < (int64_t{1} << (64 - shift)) || vocab > INT64_MAX / vocab)
        return -1;
    info[0] = 0;
    std::vector<int64_t> pool;  // every path's tokens, one after another
    std::vector<int64_t> path_at, path_len;
    std::vector<double> ends;
    std::vector<Node> frontier{{0, 0, previous, root, 1.0}}, grown;
    for (int64_t d = 0; d < depth; ++d) {
        const int64_t width = d < n_branching ? branching[d] : 1;
        grown.clear();
        for (const Node& node : frontier) {
            const int32_t* row = table + node.token * k;
            bool paired = false;
            if (node.before >= 0 && node.before < vocab) {
                const int64_t key = node.before * vocab + node.token;
                const uint64_t slot = (static_cast<uint64_t>(key) * golden) >> shift;
                if (pair_keys[slot] == key) {
                    row = pair_table + slot * k;
                    paired = true;
                }
            }
            if (d == 0) info[0] = paired ? 1 : 0;
            const double* prior = paired ? pair_prior : token_prior;
            const int64_t n_prior = paired ? n_pair_prior : n_token_prior;
            double taken = 0.0;
            int64_t rank = 0;
            std::vector<Node> children;
            for (int64_t j = 0; j < std::min(width, k); ++j) {
                const int64_t t = row[j];
                if (t < 0) continue;
                if (t >= vocab) return -1;
                const double chance = node.chance * prior[std::min(rank, n_prior - 1)];
                ++rank;
                taken += chance;
                const int64_t start = static_cast<int64_t>(pool.size());
                pool.insert(pool.end(), pool.begin() + node.path_start, pool.begin() + node.path_start + node.len);
                pool.push_back(t);
                children.push_back({start, node.len + 1, node.token, t, chance});
            }
            if (node.len > 0) {
                path_at.push_back(node.path_start);
                path_len.push_back(node.len);
                ends.push_back(node.chance - taken);
            }
            for (const Node& c : children)
                if (c.chance * row_scale >= 0.5) grown.push_back(c);
        }
        frontier.swap(grown);
    }
    for (const Node& node : frontier) {
        path_at.push_back(node.path_start);
        path_len.push_back(node.len);
        ends.push_back(node.chance);
    }
    int64_t written = 0;
    for (size_t p = 0; p < ends.size() && written < max_rows; ++p) {
        const double copies = std::nearbyint(ends[p] * row_scale);  // half to even, as Python's round
        for (int64_t c = 0; c < static_cast<int64_t>(copies) && written < max_rows; ++c, ++written) {
            int64_t* out = rows + written * depth;
            for (int64_t j = 0; j < depth; ++j) out[j] = j < path_len[p] ? pool[path_at[p] + j] : -1;
        }
    }
    return written;
}

}  // extern "C"
