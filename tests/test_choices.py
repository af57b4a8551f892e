"""The model's choices read fast from logits: the argmax of every row and each row's top-k, the same as torch's."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rest_core.sampling import TOPK_BLOCK, greedy_choices, top_successors


@pytest.mark.parametrize("vocab", [49152, 49157, 1000, 40])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_argmax_and_top_k_equal_torchs(vocab, rows):
    gen = torch.Generator().manual_seed(vocab + rows)
    with torch.inference_mode():  # as the decoder calls them
        logits = torch.randn(rows, vocab, generator=gen) * 4
        assert greedy_choices(logits) == logits.argmax(dim=-1).tolist()
        for k in (1, 5, 8):
            got = top_successors(logits, k)
            assert got.dtype == np.int64 and got.shape == (rows, min(k, vocab))
            assert (got == logits.topk(k, dim=-1).indices.numpy()).all()


def test_ties_pick_the_first_largest_and_the_top_values_stay_exact():
    logits = torch.zeros(3, 49152)
    logits[0, 700] = logits[0, 9] = 5.0  # two equal maxima: the first one, as torch.argmax and generate()
    logits[1, 49151] = 1.0  # the largest in the very last column
    logits[2, :] = -1.0  # a row of equal values
    assert greedy_choices(logits) == [9, 49151, 0] == logits.argmax(dim=-1).tolist()
    got = top_successors(logits, 4)
    want = logits.topk(4, dim=-1).values
    assert torch.equal(logits.gather(1, torch.from_numpy(got)), want)  # the same values, largest first
    assert set(got[0, :2]) == {9, 700}


def test_the_largest_logits_in_one_block_are_all_found():
    """Every one of the top k may sit in the same block, and the rest of the row in the tail past the last
    whole block: the block maxima must not lose any of them."""
    vocab = 50 * TOPK_BLOCK + 7
    logits = torch.randn(2, vocab) * 0.1
    logits[0, 3 * TOPK_BLOCK: 3 * TOPK_BLOCK + 8] = torch.arange(10.0, 18.0)  # the top 8 all in block 3
    logits[1, -7:] = torch.arange(20.0, 27.0)  # seven of the top 8 in the tail
    got = top_successors(logits, 8)
    assert (got == logits.topk(8, dim=-1).indices.numpy()).all()


def test_other_dtypes_give_torchs_choices():
    logits = torch.randn(2, 5000, dtype=torch.float64)
    assert greedy_choices(logits) == logits.argmax(dim=-1).tolist()
    assert (top_successors(logits, 3) == logits.topk(3, dim=-1).indices.numpy()).all()
    half = torch.randn(2, 5000).to(torch.bfloat16)
    assert greedy_choices(half) == half.argmax(dim=-1).tolist()


def test_the_native_top_k_answers_where_it_is_built_and_torch_where_it_cannot():
    from rest_core import native
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 49157, generator=gen)
    want = logits.topk(8, dim=-1).indices.numpy()
    assert native.top_k_library() is not None  # a machine with a C++ compiler builds it
    found = native.row_top_k(logits, 8)
    assert found is not None and (found == want).all()
    assert (native.row_top_k(logits, 1)[:, 0] == logits.numpy().argmax(-1)).all()
    tied = torch.zeros(2, 3000)
    tied[0, [2999, 40, 1700]] = 3.0  # equal maxima: the lower id first, as argmax picks it
    assert native.row_top_k(tied, 3)[0].tolist() == [40, 1700, 2999]
    assert native.row_top_k(tied, 2)[1].tolist() == [0, 1]  # a row of equal values
    # what it does not take, the caller answers with torch: a NaN, k past its range, another dtype
    nan = logits.clone()
    nan[2, 30000] = float("nan")
    assert native.row_top_k(nan, 8) is None
    assert (top_successors(nan, 8) == nan.topk(8, dim=-1).indices.numpy()).all()
    assert native.row_top_k(logits, native.MAX_TOP_K + 1) is None
    assert native.row_top_k(logits.double(), 8) is None
    assert (top_successors(logits, 70) == logits.topk(70, dim=-1).indices.numpy()).all()


@pytest.mark.parametrize("why", ["switched off", "no compiler"])
def test_without_the_native_top_k_the_choices_are_the_same(monkeypatch, tmp_path, why):
    from rest_core import native
    logits = torch.randn(4, 49152, generator=torch.Generator().manual_seed(3))
    with_native = top_successors(logits, 8)
    monkeypatch.setattr(native, "_optional", {})  # as in a new process, on a machine where it cannot be had
    if why == "switched off":
        monkeypatch.setenv("REST_LAB_NATIVE", "0")
    else:  # an empty cache and no compiler
        monkeypatch.setattr(native.native_build, "cache_dir", lambda: tmp_path)  # where every library is built
        monkeypatch.setattr(native, "_compiler", lambda: (_ for _ in ()).throw(OSError("no C++ compiler found")))
    assert native.top_k_library() is None and native.row_top_k(logits, 8) is None
    assert (top_successors(logits, 8) == with_native).all()


def test_a_step_reads_its_choices_and_successors_in_one_pass(monkeypatch):
    """The decoder takes each node's argmax from the native top-k's first column: the same as greedy_choices, ties
    included; where only the fallback answers it gives no choices and the decoder asks greedy_choices."""
    from rest_core import native
    from rest_core.sampling import successors_and_choices
    logits = torch.randn(6, 49152, generator=torch.Generator().manual_seed(3))
    logits[1, 700] = logits[1, 9] = 50.0  # two equal maxima: the first one
    logits[2, :] = -1.0  # a row of equal values
    top, choices = successors_and_choices(logits, 8)
    assert choices == greedy_choices(logits) and choices[1] == 9 and choices[2] == 0
    assert (top == top_successors(logits, 8)).all()
    monkeypatch.setattr(native, "_optional", {"row-top-k": None})  # no library on this machine
    top, choices = successors_and_choices(logits, 8)
    assert choices is None and (logits.gather(1, torch.from_numpy(top)) == logits.topk(8, dim=-1).values).all()


def test_rows_read_in_stretches_on_several_threads_give_one_pass_answer():
    """The native top-k reads each row in one stretch per thread and merges them: equal values on either side of
    a stretch boundary still come lower id first, and a NaN in any stretch is refused."""
    from rest_core import native
    lib = native.top_k_library()
    assert lib is not None
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 49152, generator=gen)
    logits[:, ::5] = logits[:, ::5].round()  # many equal values
    logits[0, [30000, 12, 24575, 24576]] = 9.0  # equal maxima in both halves and at the boundary
    logits[1, 40000] = 9.0  # the largest only in the second half

    def read(x, k, threads):
        out = np.empty((x.shape[0], k), dtype=np.int64)
        failed = lib.rest_lab_row_top_k(x.data_ptr(), x.numel(), x.shape[0], x.shape[1], k, out.ctypes.data, out.size,
                                        threads)
        return None if failed else out

    one = read(logits, 16, 1)
    assert one[0, :4].tolist() == [12, 24575, 24576, 30000] and one[1, 0] == 40000
    for threads in (2, 3, 4, 16):  # 16 asks more stretches than a 49k row holds: fewer are used
        assert (read(logits, 16, threads) == one).all()
    want = np.stack([np.lexsort((np.arange(r.size), -r))[:16] for r in logits.numpy()])
    assert (one == want).all()
    short = torch.tensor([[1.0, 3.0, 3.0, 2.0]])  # shorter than a stretch: one pass
    assert read(short, 4, 2).tolist() == [[1, 2, 3, 0]]
    nan = logits.clone()
    nan[2, 45000] = float("nan")  # in the last stretch
    assert read(nan, 8, 2) is None and read(nan, 8, 1) is None
