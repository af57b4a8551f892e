"""Every native entry point is told how large the buffers it writes are, and refuses (writing nothing) where the
shapes it is given do not fit them; the Python wrappers refuse a wrong shape before the call.  Each test fills an
output buffer with a sentinel, asks for more than it holds, and checks the sentinel is untouched."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from rest_core import native

SENTINEL = -12345.0


def _needs(lib):
    if lib is None:
        pytest.skip("no C++ compiler for the native code")
    return lib


def test_the_linear_kernel_refuses_an_input_of_another_width_before_the_call():
    _needs(native.library())
    torch.manual_seed(0)
    weight, bias = torch.randn(40, 24), torch.randn(40)
    panels, padded = native.pack(weight, bias)
    x = torch.randn(3, 24)
    assert torch.allclose(native.linear(x, panels, padded, 40), x @ weight.T + bias, atol=1e-5)
    for wrong in (torch.randn(3, 20), torch.randn(2, 30), torch.randn(24)[:20]):
        with pytest.raises(ValueError, match="rows of 24 values"):
            native.linear(wrong, panels, padded, 40)
    with pytest.raises(ValueError, match="bias of 39"):
        native.pack(weight, torch.randn(39))


@pytest.mark.parametrize("entry", ["rest_lab_panel_linear", "rest_lab_panel_linear_tall"])
def test_the_linear_kernel_writes_nothing_past_the_lengths_it_is_given(entry):
    lib = _needs(native.library())
    torch.manual_seed(1)
    m, k, n = 5, 24, 40
    panels, padded = native.pack(torch.randn(n, k), torch.randn(n))
    x = torch.randn(m, k)
    out = torch.full((m * n + 64,), SENTINEL)
    fn = getattr(lib, entry)
    threads = torch.get_num_threads()
    lengths = dict(x=x.numel(), panels=panels.numel(), bias=padded.numel(), out=m * n)
    for short in lengths:  # one buffer a little too small for the shapes given: refused, nothing written
        given = {**lengths, short: lengths[short] - 1}
        assert fn(x.data_ptr(), given["x"], panels.data_ptr(), given["panels"], padded.data_ptr(), given["bias"],
                  out.data_ptr(), given["out"], m, k, n, threads) == 1
        assert (out == SENTINEL).all()
    assert fn(x.data_ptr(), x.numel(), panels.data_ptr(), panels.numel(), padded.data_ptr(), padded.numel(),
              out.data_ptr(), m * n, m, k, n, threads) == 0
    assert (out[m * n:] == SENTINEL).all() and not (out[:m * n] == SENTINEL).any()


def test_packing_refuses_a_panel_buffer_too_small():
    lib = _needs(native.library())
    w = torch.randn(20, 8)
    panels = torch.full((2 * 8 * 16,), SENTINEL)
    assert lib.rest_lab_pack_panels(w.data_ptr(), w.numel(), panels.data_ptr(), panels.numel() - 1, 8, 20, 1) == 1
    assert (panels == SENTINEL).all()
    assert lib.rest_lab_pack_panels(w.data_ptr(), w.numel() - 1, panels.data_ptr(), panels.numel(), 8, 20, 1) == 1
    assert lib.rest_lab_pack_panels(w.data_ptr(), w.numel(), panels.data_ptr(), panels.numel(), 8, 20, 1) == 0


def test_top_k_writes_nothing_past_its_output():
    lib = _needs(native.top_k_library())
    x = torch.randn(3, 1000)
    out = np.full(3 * 8 + 4, -7, dtype=np.int64)
    assert lib.rest_lab_row_top_k(x.data_ptr(), x.numel(), 3, 1000, 8, out.ctypes.data, 3 * 8 - 1, 2) == 2
    assert (out == -7).all()
    assert lib.rest_lab_row_top_k(x.data_ptr(), x.numel() - 1, 3, 1000, 8, out.ctypes.data, 3 * 8, 2) == 2
    assert lib.rest_lab_row_top_k(x.data_ptr(), x.numel(), 3, 1000, 8, out.ctypes.data, 3 * 8, 2) == 0
    assert (out[24:] == -7).all() and out[:24].tolist() == native.row_top_k(x, 8).ravel().tolist()


def test_attention_writes_nothing_past_its_output():
    lib = _needs(native.attention_library())
    b, h, kvh, q, t, d = 1, 4, 2, 3, 40, 64
    query, key, value = torch.randn(b, h, q, d), torch.randn(b, kvh, t, d), torch.randn(b, kvh, t, d)
    out = torch.full((b * q * h * d + 16,), SENTINEL)
    s3 = ctypes.c_int64 * 3
    args = lambda out_len: (query.data_ptr(), s3(*query.stride()[:3]), key.data_ptr(), s3(*key.stride()[:3]),
                            value.data_ptr(), s3(*value.stride()[:3]), None, (ctypes.c_int64 * 2)(0, 0), 0,
                            out.data_ptr(), out_len, b, h, kvh, q, t, d, 0.125, 2)
    assert lib.rest_lab_attention(*args(b * q * h * d - 1)) == 1
    assert (out == SENTINEL).all()
    assert lib.rest_lab_attention(*args(b * q * h * d)) == 0
    assert (out[b * q * h * d:] == SENTINEL).all()
    assert torch.allclose(out[:b * q * h * d].view(b, q, h, d), native.attention(query, key, value, None, 0.125),
                          atol=1e-6)


def test_the_cache_compaction_refuses_rows_outside_its_buffers():
    lib = _needs(native.cache_rows_library())
    buf = torch.arange(2 * 10 * 4, dtype=torch.float32).view(1, 2, 10, 4)
    before = buf.clone()
    ptrs = (ctypes.c_void_p * 1)(buf.data_ptr())
    nodes = np.array([0, 2, 5], dtype=np.int64)
    nbytes = buf.numel() * 4
    assert lib.rest_lab_keep_rows(ptrs, 1, nbytes - 4, 2, 10, 4, 4, 3, nodes.ctypes.data, 3) == 1  # buffer too small
    assert lib.rest_lab_keep_rows(ptrs, 1, nbytes, 2, 10, 4, 4, 5, nodes.ctypes.data, 3) == 1  # start + 5 >= 10
    assert torch.equal(buf, before)
    assert not native.keep_rows([buf], 5, nodes)  # the wrapper: refused, nothing moved
    assert torch.equal(buf, before)
    assert native.keep_rows([buf], 3, nodes) and torch.equal(buf[0, :, 4], before[0, :, 5])


def test_the_draft_tree_and_the_ranking_refuse_output_room_too_small():
    lib = _needs(native.draft_tree_library())
    rows = np.array([[5, 6, 7], [5, 6, 8], [9, -1, -1]], dtype=np.int64)
    src, unit = np.zeros(3, dtype=np.int64), np.ones(1, dtype=np.float64)
    budget = 4
    ints = np.full((5, budget + 1), -9, dtype=np.int64)
    floats = np.full((3, budget + 1), SENTINEL, dtype=np.float64)
    room = 8 * (budget + 1)
    outs = [ints.ctypes.data + i * room for i in range(3)] + [floats.ctypes.data] + [ints.ctypes.data + 3 * room] + \
        [floats.ctypes.data + room, floats.ctypes.data + 2 * room, ints.ctypes.data + 4 * room]
    assert lib.rest_lab_draft_tree(rows.ctypes.data, 3, 3, src.ctypes.data, unit.ctypes.data, 1, budget, 1, 3.0,
                                   *outs, budget) < 0
    assert (ints == -9).all() and (floats == SENTINEL).all()
    assert lib.rest_lab_draft_tree(rows.ctypes.data, 3, 3, src.ctypes.data, unit.ctypes.data, 1, budget, 1, 3.0,
                                   *outs, budget + 1) == budget + 1

    rank = _needs(native.rank_tree_library())
    n = 3
    i64 = lambda *v: np.array(v, dtype=np.int64)
    f64 = lambda *v: np.array(v, dtype=np.float64)
    parents, depths, source = i64(0, 1, 1), i64(1, 2, 2), i64(-1, 0, 0, 0)
    shares, support = f64(1, 1, 0.5, 0.5), f64(4, 2, 2)
    counts = np.zeros((2, 4 * 4 * 4), dtype=np.float64)
    cells = (ctypes.c_void_p * 1)(counts.ctypes.data)
    factors, levels = f64(1), f64(1, 1, 1)
    bins, edges = f64(0, 0.25, 0.5, 0.75, 1.01), f64(1, 2, 4, 16)
    out = np.full(2 * n + 1, -9, dtype=np.int64)

    def call(room):
        return rank.rest_lab_rank_tree(n, parents.ctypes.data, depths.ctypes.data, shares.ctypes.data,
                                       support.ctypes.data, source.ctypes.data, None, cells, 1, factors.ctypes.data,
                                       0, levels.ctypes.data, 3, 0, bins.ctypes.data, bins.size, edges.ctypes.data,
                                       edges.size, 4, 0.4, 1.0, 0.99, None, None, 0, out.ctypes.data,
                                       out.ctypes.data + 8 * n, out.ctypes.data + 16 * n, room)

    assert call(n - 1) == -1 and (out == -9).all()
    assert call(n) == 0 and sorted(out[:n].tolist()) == [1, 2, 3]


def test_the_static_lookup_writes_nothing_past_its_rows(tmp_path):
    from datastores import build_from_token_documents
    from datastores.native import static_lookup_library
    lib = _needs(static_lookup_library())
    store = build_from_token_documents(tmp_path / "s", [[1, 2, 3, 1, 2, 4, 1, 2, 3]], tokenizer_info={"name": "t"})
    ext = np.array([1, 2], dtype=np.int64)
    rows = np.full(3 * 4 + 4, -9, dtype=np.int64)
    info = np.full(2, -9, dtype=np.int64)

    def call(rows_room, info_room):
        return lib.rest_lab_static_lookup(store._tokens.ctypes.data, store.n_tokens, store._sa.ctypes.data,
                                          store._ends.ctypes.data, store._ends.size, store._sa_item, None, 0,
                                          ext.ctypes.data, ext.size, 2, 2, 3, 4, rows.ctypes.data, rows_room,
                                          info.ctypes.data, info_room)
    assert call(3 * 4 - 1, 2) == -1 and call(3 * 4, 1) == -1
    assert (rows == -9).all() and (info == -9).all()
    assert call(3 * 4, 2) == 3 and info.tolist() == [2, 3] and (rows[3 * 4:] == -9).all()


def test_the_request_scan_writes_nothing_past_its_buffers():
    from datastores.native import request_scan_library
    lib = _needs(request_scan_library())
    toks = np.array([5, 6, 7, 5, 6, 8, 5, 6, 9, 5, 6], dtype=np.int64)
    newest = np.array([6, 5], dtype=np.int64)
    chosen = np.full(4, -9, dtype=np.int64)
    info = np.full(2, -9, dtype=np.int64)

    def call(max_matches, room, info_room):
        return lib.rest_lab_request_scan(toks.ctypes.data, toks.size, 0, newest.ctypes.data, newest.size, 2,
                                         max_matches, chosen.ctypes.data, room, info.ctypes.data, info_room)
    assert call(3, 2, 2) == -1 and call(3, 3, 1) == -1
    assert (chosen == -9).all() and (info == -9).all()
    assert call(3, 3, 2) == 3 and info.tolist() == [2, 3] and chosen.tolist() == [7, 4, 1, -9]


def test_the_model_sources_draft_writes_nothing_past_its_rows_and_reads_no_pair_slot_past_its_table():
    from datastores import RecycleStore, recycle
    from datastores.native import recycle_grow_library
    lib = _needs(recycle_grow_library())
    store = RecycleStore(vocab_size=8, k=2, branching=(2, 1))
    store.observe(np.array([1, 2, 3]), np.array([[2, 3], [3, 4], [4, 5]]))
    depth, max_rows = 3, 6
    rows = np.full(max_rows * depth + 4, -9, dtype=np.int64)
    info = np.full(1, -9, dtype=np.int64)

    def call(slots, rows_room, info_room):
        return lib.rest_lab_recycle_grow(store.table.ctypes.data, 8, 2, store.pair_keys.ctypes.data,
                                         store.pair_table.ctypes.data, slots, recycle.GOLDEN, recycle._SHIFT,
                                         store._branching_c, len(store.branching), recycle._PAIR_PRIOR_C,
                                         len(recycle.PAIR_PRIOR), recycle._TOKEN_PRIOR_C, len(recycle.TOKEN_PRIOR),
                                         -1, 1, depth, float(store.row_scale), max_rows, rows.ctypes.data, rows_room,
                                         info.ctypes.data, info_room)
    slots = len(store.pair_keys)
    assert call(slots, max_rows * depth - 1, 1) == -1 and call(slots - 1, max_rows * depth, 1) == -1
    assert call(slots, max_rows * depth, 0) == -1
    assert (rows == -9).all() and (info == -9).all()
    assert call(slots, max_rows * depth, 1) > 0 and (rows[max_rows * depth:] == -9).all()
    store.table = np.zeros((4, 2), dtype=np.int32)  # a table of another shape: the wrapper leaves the library alone
    assert store._grow_native(-1, 1, depth, max_rows) is None
