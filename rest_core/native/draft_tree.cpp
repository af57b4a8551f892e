// REST Lab: the draft tree's best prefixes in one call (rest_core/tree.py's `_prefix_candidates` and the cut
// that follows it in `build_draft_tree`, for the CPU).
//
// Every store's continuations are rows of token ids (-1 after a row's end).  Sorted lexicographically, every
// distinct prefix of depth d is a run of rows that agree in columns 0..d; its score is the mixture weight of
// those rows (per source: rows * that source's weight of one row, the sources added in order).  The tree keeps
// the `budget` best prefixes (score descending, then shallower, then earlier in sorted order), flattened by
// depth with siblings in token order, each with its parent's index.
//
// The arithmetic is numpy's, step for step (a product per source, then the sources added one after another),
// so the scores are bit for bit those of the numpy path; floating-point contraction is switched off for that.
// Built by rest_core.native at first use; the numpy path stays for machines without a compiler.
#pragma GCC optimize("fp-contract=off")
#ifdef __clang__
#pragma clang fp contract(off)
#endif

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

namespace {

struct Candidate {
    double score;
    int32_t depth;  // 0-based column
    int32_t start;  // first sorted row
    int32_t end;    // one past its last sorted row
};

}  // namespace

extern "C" {

// rows (k, L) int64 token ids, -1 after a row's end; src (k,) each row's source index in 0..S-1; unit (S,) the
// weight of one row per source; total the whole weight (the root's score).  Writes the root and up to budget
// nodes into the out arrays (each of room out_room >= budget + 1): token, parent (-1 at the root), depth, score, source
// index (-1 at the root), share of the dominant source's weight, rows of the dominant source, and how many
// sources have rows through the node (0 at the root).  Returns the number of nodes written (1 + kept), or a
// negative number when the input is not of that kind.
int64_t rest_lab_draft_tree(const int64_t* rows, int64_t k, int64_t L, const int64_t* src, const double* unit,
                            int64_t S, int64_t budget, int64_t root, double total, int64_t* out_token,
                            int64_t* out_parent, int64_t* out_depth, double* out_score, int64_t* out_source,
                            double* out_share, double* out_support, int64_t* out_agree, int64_t out_room) {
    if (k < 0 || L < 1 || S < 1 || budget < 0 || k > INT32_MAX || L > INT32_MAX || out_room < budget + 1) return -1;
    for (int64_t i = 0; i < k; ++i)
        if (src[i] < 0 || src[i] >= S) return -2;
    out_token[0] = root;
    out_parent[0] = -1;
    out_depth[0] = 0;
    out_score[0] = total;
    out_source[0] = -1;
    out_share[0] = 1.0;
    out_support[0] = 0.0;
    out_agree[0] = 0;
    if (k == 0 || budget == 0) return 1;

    // the stable lexicographic order of the rows
    std::vector<int32_t> order(k);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
        const int64_t* ra = rows + a * L;
        const int64_t* rb = rows + b * L;
        for (int64_t j = 0; j < L; ++j)
            if (ra[j] != rb[j]) return ra[j] < rb[j];
        return false;
    });
    // per sorted row: its real length, the first column where it differs from the row before, and the
    // running count of rows per source
    std::vector<int32_t> real(k), differs(k);
    std::vector<int64_t> cum(static_cast<size_t>(S) * (k + 1), 0);  // cum[s * (k + 1) + i]: rows < i of source s
    for (int64_t i = 0; i < k; ++i) {
        const int64_t* r = rows + static_cast<int64_t>(order[i]) * L;
        int32_t n = 0;
        while (n < L && r[n] >= 0) ++n;
        real[i] = n;
        int32_t d = 0;
        if (i > 0) {
            const int64_t* p = rows + static_cast<int64_t>(order[i - 1]) * L;
            while (d < L && r[d] == p[d]) ++d;
        }
        differs[i] = d;
        for (int64_t s = 0; s < S; ++s) cum[s * (k + 1) + i + 1] = cum[s * (k + 1) + i] + (src[order[i]] == s);
    }
    auto score_of = [&](int32_t a, int32_t b) {
        double acc = static_cast<double>(cum[b] - cum[a]) * unit[0];
        for (int64_t s = 1; s < S; ++s) {
            const int64_t* c = cum.data() + s * (k + 1);
            double part = static_cast<double>(c[b] - c[a]) * unit[s];
            acc = acc + part;
        }
        return acc;
    };

    // every real prefix: at depth d a run opens at row i when i == 0 or row i differs from row i-1 at or
    // before column d
    std::vector<Candidate> cands;
    cands.reserve(static_cast<size_t>(std::min<int64_t>(k * L, 1 << 16)));
    std::vector<int32_t> opens;  // rows opening a run at the current depth, ascending
    opens.reserve(k);
    for (int32_t d = 0; d < L; ++d) {
        opens.clear();
        for (int32_t i = 0; i < k; ++i)
            if (i == 0 || differs[i] <= d) opens.push_back(i);
        for (size_t g = 0; g < opens.size(); ++g) {
            int32_t a = opens[g];
            int32_t b = g + 1 < opens.size() ? opens[g + 1] : static_cast<int32_t>(k);
            if (d < real[a]) cands.push_back({score_of(a, b), d, a, b});
        }
    }
    if (cands.empty()) return 1;

    // the best `budget`: score descending, then shallower, then earlier rows
    auto better = [](const Candidate& x, const Candidate& y) {
        if (x.score != y.score) return x.score > y.score;
        if (x.depth != y.depth) return x.depth < y.depth;
        return x.start < y.start;
    };
    size_t n = std::min(cands.size(), static_cast<size_t>(budget));
    std::partial_sort(cands.begin(), cands.begin() + n, cands.end(), better);
    cands.resize(n);
    std::sort(cands.begin(), cands.end(), [](const Candidate& x, const Candidate& y) {
        return x.depth != y.depth ? x.depth < y.depth : x.start < y.start;
    });

    for (size_t j = 0; j < n; ++j) {
        const Candidate& c = cands[j];
        int64_t node = static_cast<int64_t>(j) + 1;
        out_token[node] = rows[static_cast<int64_t>(order[c.start]) * L + c.depth];
        out_depth[node] = c.depth + 1;
        out_score[node] = c.score;
        if (c.depth == 0) {
            out_parent[node] = 0;
        } else {
            // the kept prefix one shorter that holds this one's first row: the last at depth - 1 starting at or
            // before it (kept prefixes are closed under parents, so it is there)
            int64_t parent = -1;
            for (size_t p = j; p-- > 0;) {
                if (cands[p].depth < c.depth - 1) break;
                if (cands[p].depth == c.depth - 1 && cands[p].start <= c.start) {
                    parent = static_cast<int64_t>(p) + 1;
                    break;
                }
            }
            if (parent < 0 || cands[parent - 1].end < c.end) return -3;  // not a tree: never for these scores
            out_parent[node] = parent;
        }
        int64_t dominant = 0, agree = 0;
        double best = -1.0;
        for (int64_t s = 0; s < S; ++s) {
            const int64_t* cs = cum.data() + s * (k + 1);
            agree += cs[c.end] > cs[c.start];
            double w = static_cast<double>(cs[c.end] - cs[c.start]) * unit[s];
            if (w > best) {
                best = w;
                dominant = s;
            }
        }
        const int64_t* cd = cum.data() + dominant * (k + 1);
        double whole = static_cast<double>(cd[k]) * unit[dominant];
        out_source[node] = dominant;
        out_share[node] = best / std::max(whole, 1e-300);
        out_support[node] = static_cast<double>(cd[c.end] - cd[c.start]);
        out_agree[node] = agree;
    }
    return static_cast<int64_t>(n) + 1;
}

}  // extern "C"
