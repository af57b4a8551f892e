// REST Lab: the request store's lookup as one scan (datastores/dynamic.py's `_NgramIndex.match`, for the CPU).
//
// The request store holds one request's tokens (the prompt and the answer so far, a few thousand at most).  Its
// lookup is the longest suffix of the context (up to m tokens, at least n_min) that occurs in the stream with a
// next token that is not a separator, not counting the occurrence that is the stream's own end; the matches
// most recent first, at most max_matches of them, and how many there are.  Comparing the context backwards at
// every position is a few thousand integer comparisons, less than hashing a step's new n-grams costs in Python;
// the hashed index (the same answers, `_NgramIndex`) stays for large streams and machines without a compiler.

#include <cstdint>

namespace {
constexpr int64_t SEP = 0xFFFFFFFFLL;
}

extern "C" {

// toks (size,) the stream (SEP between documents); positions below live_start do not count; newest (m,) the
// context's newest tokens, newest first.  Writes the chosen end positions (most recent first, at most
// max_matches) into chosen (room for chosen_room), info[0] the match length (0: none), info[1] how many positions
// match that long (room for info_room); returns the number written, or -1 for input it does not take (buffers too
// small for the shapes asked included: nothing is written then).
int64_t rest_lab_request_scan(const int64_t* toks, int64_t size, int64_t live_start, const int64_t* newest,
                              int64_t m, int64_t n_min, int64_t max_matches, int64_t* chosen, int64_t chosen_room,
                              int64_t* info, int64_t info_room) {
    if (info_room < 2 || chosen_room < max_matches) return -1;
    info[0] = info[1] = 0;
    if (size < 0 || m < 0 || n_min < 1 || max_matches < 1 || live_start < 0) return -1;
    if (m < n_min) return 0;
    const int64_t first = newest[0];
    int64_t best = 0, total = 0, written = 0;
    for (int64_t pos = size - 2; pos >= live_start; --pos) {  // the stream's last position has nothing after it
        if (toks[pos] != first || toks[pos + 1] == SEP) continue;
        int64_t len = 1;
        while (len < m && pos - len >= 0 && toks[pos - len] == newest[len]) ++len;
        if (len < n_min || len < best) continue;
        if (len > best) {
            best = len;
            total = 0;
            written = 0;
        }
        ++total;
        if (written < max_matches) chosen[written++] = pos;
    }
    info[0] = best;
    info[1] = total;
    return written;
}

}  // extern "C"
