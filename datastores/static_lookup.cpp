// REST Lab: a static store's lookup in one call (datastores/static.py's `TokenDatastore.lookup`, for the CPU).
//
// The store is a token stream and the suffix array of the reversed stream (forward end positions, ranked by the
// backward strings tokens[i], tokens[i-1], ..., tokens[0], unsigned, a string that runs off the start before any
// longer one it begins), plus the sorted ranks of positions without a continuation ("ends").  A lookup finds the
// longest suffix of the context (n_max down to n_min tokens) that occurs with a continuation, takes its
// occurrences (past max_matches, those whose earlier tokens agree longest with the context's, nearest the
// context's place in rank order, half on each side), and copies the tokens after each, cut at a separator.
//
// Every step is the Python path's, probe for probe (the same binary searches, gallops and tie rules), so the
// answer is the same rows in the same order; the Python path stays for machines without a compiler.  Built by
// datastores.native at first use.

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr uint32_t SEP = 0xFFFFFFFFu;

template <typename Index>
struct Store {
    const uint32_t* tokens;
    int64_t n;
    const Index* sa;
    const Index* ends;
    int64_t n_ends;

    // sign of (backward string at rank, at most m tokens) compared with q (m tokens)
    int compare(int64_t rank, const uint32_t* q, int64_t m) const {
        const int64_t i = static_cast<int64_t>(sa[rank]);
        const int64_t len = std::min(m, i + 1);
        for (int64_t j = 0; j < len; ++j) {
            const uint32_t t = tokens[i - j];
            if (t != q[j]) return t < q[j] ? -1 : 1;
        }
        return len < m ? -1 : 0;
    }

    bool equal(int64_t rank, const uint32_t* q, int64_t m) const { return compare(rank, q, m) == 0; }

    // tokens the backward string at rank (at most m) shares with q (m tokens)
    int64_t lcp(int64_t rank, const uint32_t* q, int64_t m) const {
        const int64_t i = static_cast<int64_t>(sa[rank]);
        const int64_t len = std::min(m, i + 1);
        int64_t j = 0;
        while (j < len && tokens[i - j] == q[j]) ++j;
        return j;
    }

    // the longest lcp with q of the ranks next to insertion point p (p - 1 and p) that lie in [lo, hi); 0 if none
    int64_t lcp_around(int64_t p, const uint32_t* q, int64_t m, int64_t lo, int64_t hi) const {
        int64_t best = 0;
        for (int64_t r : {p - 1, p})
            if (lo <= r && r < hi) best = std::max(best, lcp(r, q, m));
        return best;
    }

    // first rank in [lo, hi) whose m-token backward string is >= q
    int64_t lower_bound(const uint32_t* q, int64_t m, int64_t lo, int64_t hi) const {
        while (lo < hi) {
            const int64_t mid = (lo + hi) >> 1;
            if (compare(mid, q, m) < 0) lo = mid + 1;
            else hi = mid;
        }
        return lo;
    }

    // grow [lo, hi) to the whole block of ranks whose n-token backward string equals q
    void gallop(const uint32_t* q, int64_t n_tok, int64_t& lo, int64_t& hi) const {
        int64_t step = 1;
        while (lo - step >= 0 && equal(lo - step, q, n_tok)) step <<= 1;
        lo = lower_bound(q, n_tok, std::max<int64_t>(0, lo - step), lo);
        step = 1;
        while (hi + step - 1 < n && equal(hi + step - 1, q, n_tok)) step <<= 1;
        int64_t a = hi, b = std::min(n, hi + step - 1);
        while (a < b) {
            const int64_t mid = (a + b) >> 1;
            if (equal(mid, q, n_tok)) a = mid + 1;
            else b = mid;
        }
        hi = a;
    }

    int64_t ends_before(int64_t rank) const {
        return std::lower_bound(ends, ends + n_ends, static_cast<Index>(rank)) - ends;
    }

    // ranks in [lo, hi) without a continuation
    int64_t dead(int64_t lo, int64_t hi) const { return ends_before(hi) - ends_before(lo); }

    // end positions at ranks [a, b) that have a continuation, in rank order
    void live_ranks(int64_t a, int64_t b, std::vector<int64_t>& out) const {
        int64_t e = ends_before(a);
        for (int64_t r = a; r < b; ++r) {
            while (e < n_ends && static_cast<int64_t>(ends[e]) < r) ++e;
            if (e < n_ends && static_cast<int64_t>(ends[e]) == r) continue;
            out.push_back(static_cast<int64_t>(sa[r]));
        }
    }

    // k live end positions in [lo, hi) sharing the longest reversed context ext (e tokens)
    void select_by_left_context(const uint32_t* ext, int64_t e, int64_t lo, int64_t hi, int64_t k,
                                std::vector<int64_t>& out) const {
        const int64_t pe = lower_bound(ext, e, lo, hi);
        const int64_t top = lcp_around(pe, ext, e, lo, hi);
        int64_t in_lo = pe, in_hi = pe, blo = pe, bhi = pe, agree = top;
        while (true) {
            gallop(ext, agree, blo, bhi);
            if ((bhi - blo) - dead(blo, bhi) >= k) break;
            in_lo = blo;
            in_hi = bhi;
            agree = std::max(blo > lo ? lcp(blo - 1, ext, e) : -1, bhi < hi ? lcp(bhi, ext, e) : -1);
        }
        std::vector<int64_t> got;
        live_ranks(in_lo, in_hi, got);
        const int64_t need = k - static_cast<int64_t>(got.size());
        const int64_t avail_l = (in_lo - blo) - dead(blo, in_lo);
        const int64_t avail_r = (bhi - in_hi) - dead(in_hi, bhi);
        int64_t take_l = (need + 1) / 2, take_r = need / 2;
        if (avail_l < take_l) {
            take_l = avail_l;
            take_r = need - avail_l;
        } else if (avail_r < take_r) {
            take_l = need - avail_r;
            take_r = avail_r;
        }
        int64_t a = in_lo - take_l;
        while ((in_lo - a) - dead(a, in_lo) < take_l) a -= take_l - ((in_lo - a) - dead(a, in_lo));
        int64_t b = in_hi + take_r;
        while ((b - in_hi) - dead(in_hi, b) < take_r) b += take_r - ((b - in_hi) - dead(in_hi, b));
        live_ranks(a, in_lo, out);
        out.insert(out.end(), got.begin(), got.end());
        live_ranks(in_hi, b, out);
    }

    int64_t lookup(const int64_t* ext_ids, int64_t n_ext, const int64_t* first, int64_t n_first, int64_t n_max,
                   int64_t n_min, int64_t max_matches, int64_t length, int64_t* rows, int64_t* info) const {
        info[0] = info[1] = 0;
        const int64_t m = std::min(n_max, n_ext);
        if (m < n_min) return 0;
        std::vector<uint32_t> ext(n_ext);  // the context reversed: newest token first
        for (int64_t j = 0; j < n_ext; ++j) ext[j] = static_cast<uint32_t>(ext_ids[n_ext - 1 - j]);
        const uint32_t* q = ext.data();
        int64_t a = 0, b = n;
        if (first != nullptr) {
            const int64_t t = ext_ids[n_ext - 1];
            if (t + 1 >= n_first) return 0;  // a token id the store never holds
            a = first[t];
            b = first[t + 1];
        }
        const int64_t p = lower_bound(q, m, a, b);
        const int64_t best = lcp_around(p, q, m, a, b);
        int64_t lo = p, hi = p, n_tok = best, live = 0;
        while (true) {
            if (n_tok < n_min) return 0;
            gallop(q, n_tok, lo, hi);
            live = (hi - lo) - dead(lo, hi);
            if (live > 0) break;
            --n_tok;  // only dead ends matched this long: try shorter
        }
        std::vector<int64_t> found;
        found.reserve(std::min(live, max_matches));
        if (live <= max_matches) live_ranks(lo, hi, found);
        else select_by_left_context(q, n_ext, lo, hi, max_matches, found);
        int64_t k = 0;
        for (int64_t end : found) {  // the tokens after each end, -1 from a separator or the stream's end on
            int64_t* row = rows + k * length;
            bool cut = false;
            for (int64_t j = 0; j < length; ++j) {
                const int64_t at = end + 1 + j;
                if (!cut && (at >= n || tokens[at] == SEP)) cut = true;
                row[j] = cut ? -1 : static_cast<int64_t>(tokens[at]);
            }
            if (row[0] != -1) ++k;  // a row without any token is dropped
        }
        info[0] = n_tok;
        info[1] = live;
        return k;
    }
};

}  // namespace

extern "C" {

// tokens (n,) the stream; sa (n,) and ends (n_ends,) of index_bytes (4 or 8) each; first (n_first,) the
// first-token table or null; ext (n_ext,) the context's newest tokens, oldest first, each in [0, 2^32 - 1).
// Writes up to max_matches rows of `length` int64 into rows (room for rows_room values; -1 after a row's cut) and
// info[0] the matched length, info[1] the occurrences with a continuation (room for info_room values); returns the
// number of rows, or -1 for input it does not take (buffers too small for the shapes asked included: nothing is
// written then).
int64_t rest_lab_static_lookup(const uint32_t* tokens, int64_t n, const void* sa, const void* ends, int64_t n_ends,
                               int index_bytes, const int64_t* first, int64_t n_first, const int64_t* ext,
                               int64_t n_ext, int64_t n_max, int64_t n_min, int64_t max_matches, int64_t length,
                               int64_t* rows, int64_t rows_room, int64_t* info, int64_t info_room) {
    if (n < 1 || n_ext < 0 || n_min < 1 || n_max < n_min || max_matches < 1 || length < 1) return -1;
    if (info_room < 2 || rows_room < 0 || max_matches > rows_room / length) return -1;
    if (index_bytes == 4) {
        const Store<uint32_t> s{tokens, n, static_cast<const uint32_t*>(sa), static_cast<const uint32_t*>(ends),
                                n_ends};
        return s.lookup(ext, n_ext, first, n_first, n_max, n_min, max_matches, length, rows, info);
    }
    if (index_bytes == 8) {
        const Store<uint64_t> s{tokens, n, static_cast<const uint64_t*>(sa), static_cast<const uint64_t*>(ends),
                                n_ends};
        return s.lookup(ext, n_ext, first, n_first, n_max, n_min, max_matches, length, rows, info);
    }
    return -1;
}

}  // extern "C"
