"""DYN_POOL (KOG_HOPPER_POOL): a long stage's last rows grabbed at run time by the blocks' producers.
CPU checks of the plan, the copy lists and the unit arithmetic the producer does (stream.cuh
produce_pool), and that the build compiles clean. The GPU tests run it against the reference
(tests/gpu/test_hopper_gpu.py, -k pool)."""
import numpy as np
import pytest

from kog_nvidia_hopper import schedule as S

from test_hopper_compile import _plan_stage  # tests/ is on the path (rootdir import)


def _stage(K, segs, pct, unit, min_rows=1, splitk_d=0):
    st = _plan_stage(K, segs)
    if splitk_d:  # a split-K stage's down_proj transpose: rows = gate/up rows, D columns
        st.segs.append(dict(SEG_N=splitk_d, SEG_W2=0, lanes=1, _splitk=True))
    st.f.update(_pool_pct=pct, _pool_rows=unit, _pool_min=min_rows)
    return st


def _coverage(st, plan, nb, K):
    """Times each (segment, row, column) is in an item (down_proj's transpose: row = gate/up row)."""
    seen = {}
    for si, sg in enumerate(st.segs):
        cols = int(sg["SEG_N"]) if sg.get("_splitk") else K
        rows = int(st.segs[0]["SEG_N"]) if sg.get("_splitk") else int(sg["SEG_N"])
        seen[si] = np.zeros((rows, cols), np.int32)
    for si, _, _, r0, rows, k0, klen, _, _ in S.plan_items(plan, nb):
        seen[si][r0:r0 + rows, k0:k0 + klen] += 1
    return seen


@pytest.mark.parametrize("K,segs,unit,splitk_d,nb", [
    (2048, [(128256, False)], 20, 0, 132),   # bench-2b's LM head
    (2048, [(8192, True)], 7, 2048, 132),    # bench-2b's split-K gate/up + down
    (256, [(1000, False)], 6, 0, 7),
    (128, [(300, True)], 3, 192, 5),
])
def test_pool_plan_covers_every_weight_once_in_equal_units(K, segs, unit, splitk_d, nb):
    """Static shares and pool together hold every weight element once; the pool is a whole number
    of units cut the same way (so the producer can copy unit u from unit 0's entries), each unit's
    first item carries IT_UNIT and its item counts, and every block still deals min_rows rows."""
    st = _stage(K, segs, 15, unit, splitk_d=splitk_d)
    si, n0, n, u = S.pool_rows(st, nb)
    assert (si, u) == (0, unit) and (n - n0) % unit == 0 and 0 < n - n0 <= n * 15 // 100
    plan, _ = S.stream_plan(st, nb, 10, 31744, kalign=32)
    for v in _coverage(st, plan, nb, K).values():
        assert np.all(v == 1)
    start, per, units = S.pool_layout(plan, nb)
    its = S.plan_items(plan, nb)
    assert start == plan[nb] and units * unit == n - n0 and start + per * units == len(its)
    unit0 = its[start:start + per]
    ubytes = sum(int(r[4]) * int(r[6]) * (4 if st.segs[r[0]]["SEG_W2"] else 2) for r in unit0)
    ngu = int((unit0[:, 0] == 0).sum())
    last = S.IT_LAST if ngu == 1 else 0  # one k-slice: the row group's first and last
    assert unit0[0, 7] == (S.IT_FIRST | last | S.IT_UNIT | ngu << 8 | (per - ngu) << 16)
    for k in range(units):
        uk = its[start + k * per:start + (k + 1) * per]
        assert np.array_equal(uk[:, [0, 4, 5, 6, 7]], unit0[:, [0, 4, 5, 6, 7]])
        assert np.array_equal(uk[:, 3], unit0[:, 3] + k * unit)       # rows: the producer's h.z + u * U
        assert np.array_equal(uk[:, 2] * 16, unit0[:, 2] * 16 + k * ubytes)  # bytes: src + u * ubytes
    static = np.diff(plan[:nb + 1])
    assert static.min() > 0
    # without a pool the plan is the one dealt before (pct 0)
    plain, _ = S.stream_plan(_stage(K, segs, 0, unit, splitk_d=splitk_d), nb, 10, 31744, kalign=32)
    assert S.pool_layout(plain, nb) is None and len(S.plan_items(plain, nb)) == plain[nb]


def test_pool_needs_rows_left_to_deal():
    """No pool where the blocks' own shares would fall under the minimum, or with lanes, or with
    several dealt segments (q/k/v)."""
    assert S.pool_rows(_stage(2048, [(8192, True)], 15, 7, min_rows=62, splitk_d=2048), 132) is None
    assert S.pool_rows(_stage(2048, [(8192, True)], 15, 7, min_rows=52, splitk_d=2048), 132) is not None
    assert S.pool_rows(_stage(2048, [(2048, False), (512, False)], 15, 20), 132) is None
    st = _stage(384, [(4096, False)], 15, 20)
    st.segs[0]["lanes"] = 8
    assert S.pool_rows(st, 132) is None


def test_stream_list_puts_the_pool_marker_and_template_after_each_blocks_items():
    """Each block's list: its own items of the stage, then the pool's marker (units, items a
    unit, unit bytes, flags | SE_POOL; pool index, rows a unit) and unit 0's entries flagged
    SE_TEMPLATE. Expanding the template as produce_pool does gives the plan's every unit."""
    nb, K = 3, 64
    a = _stage(K, [(200, False)], 20, 8, min_rows=4)
    b = _stage(K, [(120, True)], 25, 3, min_rows=4, splitk_d=48)
    b.segs[0]["SEG_W2"] = "@u"
    plans = [S.stream_plan(st, nb, 12, 2048)[0] for st in (a, b)]
    bases = [1 << 33, (1 << 34) + 4096]
    stages = [(0, plans[0], a.segs, bases[0], 0), (2, plans[1], b.segs, bases[1], 2 | 1)]
    assert all(S.pool_layout(plan, nb) for plan in plans)
    lst, binfo = S.stream_list(stages, nb, 4)
    head = ((nb + 4) >> 2) * 4
    offs = lst[:nb + 1]
    ent = lst[head:].reshape(-1, S.SE_WORDS)
    for blk in range(nb):
        mine = ent[offs[blk]:offs[blk + 1]]
        at = 0
        for pid, (si, plan, segs, base, fl) in enumerate(stages):
            own = plan[blk + 1] - plan[blk]
            assert binfo[si, blk, 0] == own
            flags = (1 if fl & 2 else 0) | (2 if fl & 1 else 0) | (si << 8)
            assert all(int(e[3]) == flags for e in mine[at:at + own])
            at += own
            marker = mine[at]
            start, per, units = S.pool_layout(plan, nb)
            its = S.plan_items(plan, nb)
            raw = plan[(3 * nb + 4) & ~3:].reshape(-1, 8)
            unit_rows = int(its[start][4])
            assert int(marker[3]) == flags | S.SE_POOL
            assert [int(v) for v in marker[:2]] == [units, per] and [int(v) for v in marker[4:6]] == [pid, unit_rows]
            tmpl = mine[at + 1:at + 1 + per]
            assert all(int(e[3]) == flags | S.SE_TEMPLATE for e in tmpl)
            ubytes = int(marker[2])
            for u in range(units):  # produce_pool's arithmetic
                for i, e in enumerate(tmpl):
                    j = start + u * per + i
                    src = (int(e[0]) | int(e[1]) << 32) + u * ubytes
                    hdr = e[4:].view(np.int32).copy()
                    hdr[2] += u * unit_rows
                    assert src == base + int(its[j][2]) * 16
                    want = raw[j].copy()
                    assert np.array_equal(np.delete(hdr, 1), np.delete(want, 1))  # (h.y, the offset, unused)
            at += 1 + per
        assert at == len(mine)


def test_pool_build_compiles_without_spills():
    """The DYN_POOL build (bench-2b's default build with the pool) compiles clean."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-python (NVRTC) is not installed")
    from kog_nvidia_hopper.cuda_util import compile_cubin, ptxas_report, source
    from kog_nvidia_hopper.sass_report import DEFAULT_BUILD
    cubin, log = compile_cubin(source(S.header(dict(DEFAULT_BUILD, DYN_POOL=1, POOL_ACC_OFF=22912))), use_cache=False)
    rep = ptxas_report(log)
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0 and rep["registers"] <= 168
    with pytest.raises(Exception, match="POOL_ACC_OFF"):
        compile_cubin(source(S.header(dict(DEFAULT_BUILD, DYN_POOL=1))), use_cache=False)
