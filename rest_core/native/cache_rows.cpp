// REST's compaction after a verify pass, for every layer of the key/value cache in one call: the accepted tree
// nodes' rows move down to the positions right after the prefix, in path order, in every keys and values buffer.
//
// A buffer is (outer, capacity, row) contiguous elements of `elem` bytes (outer = batch x key/value heads).
// Node n of the pass sits at position start + n; the j-th kept node goes to start + j.  Kept nodes come in
// increasing order and nodes[j] >= j, so moving them in order never overwrites a row still to be moved.
// Returns 1 (nothing moved) when the nodes are not increasing or a row lies outside the buffers
// (buffer_bytes: each buffer's size in bytes).
#include <cstdint>
#include <cstring>

extern "C" int rest_lab_keep_rows(char* const* buffers, int64_t n_buffers, int64_t buffer_bytes, int64_t outer,
                                  int64_t capacity, int64_t row, int64_t elem, int64_t start, const int64_t* nodes,
                                  int64_t n) {
    if (outer < 0 || capacity < 0 || row < 0 || elem < 0 || start < 0 || outer * capacity * row * elem > buffer_bytes)
        return 1;
    for (int64_t j = 0; j < n; ++j)
        if (nodes[j] < j || (j > 0 && nodes[j] <= nodes[j - 1]) || start + nodes[j] >= capacity) return 1;
    const int64_t row_bytes = row * elem, block = capacity * row_bytes;
    for (int64_t b = 0; b < n_buffers; ++b) {
        char* buf = buffers[b];
        for (int64_t o = 0; o < outer; ++o) {
            char* base = buf + o * block + start * row_bytes;
            for (int64_t j = 0; j < n; ++j)
                if (nodes[j] != j) std::memcpy(base + j * row_bytes, base + nodes[j] * row_bytes, row_bytes);
        }
    }
    return 0;
}
