// REST Lab: the cost model's ranking of a candidate draft tree in one call (rest_core/cost.py's
// `CostModel.ranked`: `_cells`, `_from_cells`, the request and agreement corrections, the product along each
// path and the order), for the CPU.
//
// Per draft node: its ratio (its share of its parent's rows when the parent has the same source, else its own
// share; clipped to [0, 1]), its cell (depth, support, ratio bin), the cell's calibrated chance
// (accepted + prior * ratio) / (drafted + prior weight) from its source's counts, scaled by its source's
// correction in this request and by its agreement level's correction, capped; then the chance of its whole
// path (the product of the conditional chances from the root), and the nodes ordered by chance descending,
// then shallower, then earlier.
//
// The arithmetic is numpy's, operation for operation, so the chances are bit for bit those of the numpy path
// (floating-point contraction switched off for that).  Built by rest_core.native at first use; the numpy path
// stays for machines without a compiler.
#pragma GCC optimize("fp-contract=off")
#ifdef __clang__
#pragma clang fp contract(off)
#endif

#include <algorithm>
#include <cstdint>
#include <vector>

extern "C" {

// n draft nodes (node i here is tree node i + 1): parents (n,) tree indices of each node's parent (0 = root),
// depths (n,) >= 1, shares_all (n + 1,) the tree's shares, root first, support (n,), source (n,) index into
// the per-source tables and source_all (n + 1,) with the root's (-1), agree_all (n + 1,) how many sources have
// rows through each node, root first (null: one source each; level = sources - 1, clipped to 0..levels-1).
// counts: one pointer per source to its flattened (2, cells) float64 counts (drafted, accepted); factor (S,)
// each source's request correction (applied where apply_request is set); level_factor (levels,) the agreement
// corrections (applied where apply_agreement is set).  bins (n_bins,) ratio bin edges, support_edges
// (n_support,); depths_cells the number of depth cells; prior_scaled = prior weight * prior scale; max_chance
// the cap.  Writes order (n,) 1-based tree nodes best first and chance (n,) their path chances, in that order.
// With n_budgets > 0 also the best draft size (`CostModel._best_budget`): of the candidate sizes budgets
// (n_budgets,) increasing, those <= n, the first with the most tokens per ms, (1 + the chances of its top
// nodes summed in order) / budget_ms (the pass's time for each size plus the root), into *best_budget.
// order and chance each have room for out_room values.  Returns 0, or -1 for input it does not take.
int rest_lab_rank_tree(int64_t n, const int64_t* parents, const int64_t* depths, const double* shares_all,
                       const double* support, const int64_t* source_all, const int64_t* agree_all,
                       const double* const* counts, int64_t n_sources, const double* factor, int apply_request,
                       const double* level_factor, int64_t levels, int apply_agreement, const double* bins,
                       int64_t n_bins, const double* support_edges, int64_t n_support, int64_t depth_cells,
                       double prior_scaled, double prior_weight, double max_chance, const int64_t* budgets,
                       const double* budget_ms, int64_t n_budgets, int64_t* order, double* chance,
                       int64_t* best_budget, int64_t out_room) {
    if (n < 0 || n_bins < 2 || n_support < 1 || depth_cells < 1 || levels < 1 || out_room < n) return -1;
    const int64_t ratio_bins = n_bins - 1;
    const int64_t cells = depth_cells * n_support * ratio_bins;
    std::vector<double> path(n);
    for (int64_t i = 0; i < n; ++i) {
        const int64_t parent = parents[i];
        const int64_t src = source_all[i + 1];
        if (parent < 0 || parent > i || src < 0 || src >= n_sources) return -1;
        const double share = shares_all[i + 1];
        const double parent_share = shares_all[parent];
        double ratio = share;
        if (source_all[parent] == src && parent_share > 0) ratio = share / std::max(parent_share, 1e-12);
        ratio = std::min(std::max(ratio, 0.0), 1.0);
        const int64_t depth = std::min<int64_t>(depths[i] - 1, depth_cells - 1);
        if (depth < 0) return -1;
        // searchsorted(edges, x, "right") - 1: the last edge <= x
        const int64_t sup = std::min<int64_t>(
            (std::upper_bound(support_edges, support_edges + n_support, support[i]) - support_edges) - 1,
            n_support - 1);
        const int64_t rbin = std::min<int64_t>((std::upper_bound(bins, bins + n_bins, ratio) - bins) - 1,
                                               n_bins - 2);
        if (sup < 0 || rbin < 0) return -1;
        const int64_t cell = (depth * n_support + sup) * ratio_bins + rbin;
        const double drafted = counts[src][cell];
        const double accepted = counts[src][cells + cell];
        double c = (accepted + prior_scaled * ratio) / (drafted + prior_weight);
        if (apply_request) c *= factor[src];
        if (apply_agreement) {
            const int64_t level = agree_all ? std::min(std::max<int64_t>(agree_all[i + 1] - 1, 0), levels - 1) : 0;
            c *= level_factor[level];
        }
        c = std::min(c, max_chance);
        path[i] = parent > 0 ? c * path[parent - 1] : c;  // parents come first
    }
    std::vector<int64_t> idx(n);
    for (int64_t i = 0; i < n; ++i) idx[i] = i;
    std::sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) {
        if (path[a] != path[b]) return path[a] > path[b];
        if (depths[a] != depths[b]) return depths[a] < depths[b];
        return a < b;
    });
    for (int64_t j = 0; j < n; ++j) {
        order[j] = idx[j] + 1;
        chance[j] = path[idx[j]];
    }
    if (n_budgets > 0) {
        // np.cumsum adds in order, so gain[b] is the same sum; the first maximum wins, as argmax's does
        double gain = 0.0, best_rate = 0.0;
        int64_t taken = 0, best = -1;
        for (int64_t j = 0; j < n_budgets && budgets[j] <= n; ++j) {
            while (taken < budgets[j]) gain += chance[taken++];
            const double rate = (1.0 + gain) / budget_ms[j];
            if (best < 0 || rate > best_rate) {
                best = budgets[j];
                best_rate = rate;
            }
        }
        if (best < 0) return -1;
        *best_budget = best;
    }
    return 0;
}

}  // extern "C"
