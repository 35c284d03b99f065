"""Warp-level emulation of the second flash backward (`fa2_backward` in
crates/tessera-cuda/src/flash.cu) on a machine without a GPU: `ldmatrix` (plain and `.trans`)
and `mma.m16n8k16` by their PTX fragment layouts, the kernel's loops translated line by line
(one block at a time, warps in turn, barriers as phase boundaries), against an f64 reference of
attention's backward. It checks the kernel's index arithmetic — fragments, tiles, masks, GQA,
ALiBi, partial tiles, S != T — not its timing, its races or the compiler; keep it in step with
the kernel when either changes. Needs numpy:

    python3 scripts/flash-bwd2-emulate.py [64|128]

Prints each case's relative error of dQ, dK, dV (bf16 rounding of P, dS and the outputs puts
it near 2.5e-3) and exits non-zero when one exceeds 1e-2."""
import numpy as np, sys

BC, BR, THREADS = 128, 64, 256
LOG2E = 1.4426950408889634

def bf16(x):
    x = np.asarray(x, dtype=np.float32)
    b = x.view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32)

lanes = np.arange(32)
G, T = lanes // 4, lanes % 4

# ---- fragment primitives ----
_J = np.arange(4)[:, None, None]; _L = lanes[None, :, None]; _H = np.arange(2)[None, None, :]
def ldsm_x4(mem, rows, cols, trans):
    """mem: 2-D array (shared tile, element-indexed). Lane l gives the address (rows[l], cols[l]) of
    row l%8 of matrix l//8. Returns r[4][32][2] (lo, hi). Plain: register j of lane l holds row
    l//4, columns 2(l%4)+h of matrix j; .trans: rows 2(l%4)+h, column l//4."""
    rows = np.broadcast_to(rows, (32,)); cols = np.broadcast_to(cols, (32,))
    if not trans:
        src = 8 * _J + _L // 4 + 0 * _H
        return mem[rows[src], cols[src] + 2 * (_L % 4) + _H].astype(np.float32)
    src = 8 * _J + 2 * (_L % 4) + _H
    return mem[rows[src], cols[src] + _L // 4].astype(np.float32)

def ldsm_a(mem, r0, c0):   # fa_ldsm_a: matrix i rows r0 + 8(i&1), cols c0 + 8(i>>1)
    blk = lanes >> 3
    return ldsm_x4(mem, r0 + (blk & 1) * 8 + (lanes & 7), c0 + (blk >> 1) * 8, False)

def ldsm_b(mem, r0, c0):   # fa_ldsm_b: rows r0 + 8(blk>>1), cols c0 + 8(blk&1)
    blk = lanes >> 3
    return ldsm_x4(mem, r0 + (blk >> 1) * 8 + (lanes & 7), c0 + (blk & 1) * 8, False)

def ldsm_t(mem, r0, c0):   # fa_ldsm_t: rows r0 + 8(blk&1), cols c0 + 8(blk>>1), .trans
    blk = lanes >> 3
    return ldsm_x4(mem, r0 + (blk & 1) * 8 + (lanes & 7), c0 + (blk >> 1) * 8, True)

def ldsm_at(mem, r0, c0):  # fa_ldsm_at: rows r0 + 8(blk>>1), cols c0 + 8(blk&1), .trans
    blk = lanes >> 3
    return ldsm_x4(mem, r0 + (blk >> 1) * 8 + (lanes & 7), c0 + (blk & 1) * 8, True)

_g, _t = lanes // 4, lanes % 4
_AR = np.array([[_g + 8 * (i & 1)] * 2 for i in range(4)]).transpose(0, 2, 1)          # [4][32][2]
_AC = np.array([[2 * _t + h + 8 * (i >> 1) for h in range(2)] for i in range(4)]).transpose(0, 2, 1)
_BR = np.array([[2 * _t + h + 8 * i for h in range(2)] for i in range(2)]).transpose(0, 2, 1)
_BC = np.array([[_g] * 2 for i in range(2)]).transpose(0, 2, 1)
_CR = np.array([_g + 8 * (e >> 1) for e in range(4)]).T                                # [32][4]
_CC = np.array([2 * _t + (e & 1) for e in range(4)]).T
def mma(c, a, b):
    """c[32][4] += A(16x16 from a[4]) . B(16x8 from b[2]) by the m16n8k16 layouts."""
    A = np.zeros((16, 16)); B = np.zeros((16, 8))
    A[_AR, _AC] = np.asarray(a); B[_BR, _BC] = np.asarray(b)
    c += (A @ B)[_CR, _CC]

def pack(x0, x1):  # fa_pack_f: per lane (lo, hi) rounded to bf16
    return np.stack([bf16(x0), bf16(x1)], -1)

# ---- the geometry helpers ----
def attn_visible(a, p):
    h = p + 1 if a['causal'] else a['t']
    h = min(max(h, 0), a['t'])
    l = p - a['window'] + 1 if a['window'] > 0 else 0
    l = min(max(l, 0), a['t'])
    return l, max(h, l)

def fa_range(a, b, i):
    if i >= a['s']:
        return 0, 0, 0
    p = i + a['t'] - a['s']
    lo, hi = attn_visible(a, p)
    return p, lo, hi

def fa2_full(a, b, i0, j0):
    if i0 + BR > a['s'] or j0 + BC > a['t']:
        return False
    _, _, hi_first = fa_range(a, b, i0)
    _, lo_last, _ = fa_range(a, b, i0 + BR - 1)
    return lo_last <= j0 and hi_first >= j0 + BC

# ---- the kernel, one block ----
def block(a, D, q, k, v, dout, lse, delta, slopes, dq_acc, dk, dv, bx, kvh, b):
    LD, LDS, DH, DQ = D + 8, BC + 8, D // 2, D // 4
    j0 = bx * BC
    group = a['h'] // a['hkv']
    sl2 = a['scale'] * LOG2E
    ks = np.zeros((BC, LD), np.float32); vs = np.zeros((BC, LD), np.float32)
    nv = min(a['t'] - j0, BC)
    ks[:nv, :D] = k[b, j0:j0 + nv, kvh]; vs[:nv, :D] = v[b, j0:j0 + nv, kvh]
    ifirst, iend = 0, 0
    for i0 in range(0, a['s'], BR):
        last = min(i0 + BR - 1, a['s'] - 1)
        _, lo_f, _ = fa_range(a, b, i0)
        _, _, hi_l = fa_range(a, b, last)
        if hi_l <= j0 or lo_f >= j0 + BC:
            continue
        if iend == 0:
            ifirst = i0
        iend = i0 + BR
    ntiles = (iend - ifirst) // BR; steps = group * ntiles
    dka = np.zeros((8, 2, DH // 8, 32, 4)); dva = np.zeros((8, 2, DH // 8, 32, 4))
    h0 = kvh * group
    for it in range(steps):
        hh = h0 + it // ntiles; i0 = ifirst + (it % ntiles) * BR
        slope2 = slopes[hh] * LOG2E if slopes is not None else 0.0
        full = slopes is None and fa2_full(a, b, i0, j0)
        # the stage (fa2_q_async)
        qt = np.zeros((BR, LD), np.float32); dot = np.zeros((BR, LD), np.float32)
        qvalid = min(a['s'] - i0, BR)
        qt[:qvalid, :D] = q[b, i0:i0 + qvalid, hh]; dot[:qvalid, :D] = dout[b, i0:i0 + qvalid, hh]
        meta_l = np.zeros(BR); meta_d = np.zeros(BR); qoff = np.zeros(BR); mlo = np.zeros(BR, int); mhi = np.zeros(BR, int)
        for c in range(BR):
            inn = c < qvalid
            if inn:
                meta_l[c] = lse[b, hh, i0 + c]; meta_d[c] = delta[b, hh, i0 + c]
            p, lo, hi = fa_range(a, b, i0 + c)
            qoff[c] = np.float32(j0 - p)
            mlo[c] = int(max(min(lo - j0, BC), 0)); mhi[c] = int(max(min(hi - j0, BC), 0))
        ps = np.zeros((BR, LDS), np.float32); dss = np.zeros((BR, LDS), np.float32)
        scs = {}
        for warp in range(8):
            wq, wk = warp >> 2, warp & 3
            sc = np.zeros((2, 4, 32, 4))
            for kk in range(D // 16):
                qa = [ldsm_a(qt, wq * 32 + m * 16, kk * 16) for m in range(2)]
                for n in range(0, 4, 2):
                    kb = ldsm_b(ks, wk * 32 + n * 8, kk * 16)
                    for m in range(2):
                        mma(sc[m][n], qa[m], kb[0:2]); mma(sc[m][n + 1], qa[m], kb[2:4])
            for m in range(2):
                for h in range(2):
                    c = wq * 32 + m * 16 + G + 8 * h
                    l2 = (meta_l[c] * LOG2E).astype(np.float32)
                    for n in range(4):
                        for e in range(2):
                            j = wk * 32 + n * 8 + 2 * T + e
                            s = sc[m][n][:, 2 * h + e]
                            if full:
                                val = np.exp2(s * sl2 - l2)
                            else:
                                ok = (j >= mlo[c]) & (j < mhi[c])
                                val = np.where(ok, np.exp2(s * sl2 + slope2 * (j + qoff[c]) - l2), 0.0)
                            sc[m][n][:, 2 * h + e] = val
                        pk = pack(sc[m][n][:, 2 * h], sc[m][n][:, 2 * h + 1])
                        cols = wk * 32 + n * 8 + 2 * T
                        ps[c, cols] = pk[:, 0]; ps[c, cols + 1] = pk[:, 1]
            for m in range(2):
                dp = np.zeros((4, 32, 4))
                for kk in range(D // 16):
                    da = ldsm_a(dot, wq * 32 + m * 16, kk * 16)
                    for n in range(0, 4, 2):
                        vb = ldsm_b(vs, wk * 32 + n * 8, kk * 16)
                        mma(dp[n], da, vb[0:2]); mma(dp[n + 1], da, vb[2:4])
                for h in range(2):
                    c = wq * 32 + m * 16 + G + 8 * h
                    dd = meta_d[c]
                    for n in range(4):
                        d0 = sc[m][n][:, 2 * h] * (dp[n][:, 2 * h] - dd)
                        d1 = sc[m][n][:, 2 * h + 1] * (dp[n][:, 2 * h + 1] - dd)
                        pk = pack(d0, d1)
                        cols = wk * 32 + n * 8 + 2 * T
                        dss[c, cols] = pk[:, 0]; dss[c, cols + 1] = pk[:, 1]
        # __syncthreads: P and dS complete
        for warp in range(8):
            wq, wk = warp >> 2, warp & 3
            for kk in range(BR // 16):
                pa = [ldsm_at(ps, kk * 16, wk * 32 + m * 16) for m in range(2)]
                sa = [ldsm_at(dss, kk * 16, wk * 32 + m * 16) for m in range(2)]
                for n in range(0, DH // 8, 2):
                    bd = ldsm_t(dot, kk * 16, wq * DH + n * 8)
                    bq = ldsm_t(qt, kk * 16, wq * DH + n * 8)
                    for m in range(2):
                        mma(dva[warp][m][n], pa[m], bd[0:2]); mma(dva[warp][m][n + 1], pa[m], bd[2:4])
                        mma(dka[warp][m][n], sa[m], bq[0:2]); mma(dka[warp][m][n + 1], sa[m], bq[2:4])
            dqa = np.zeros((2, DQ // 8, 32, 4))
            for kk in range(BC // 16):
                sa2 = [ldsm_a(dss, wq * 32 + m * 16, kk * 16) for m in range(2)]
                for n in range(0, DQ // 8, 2):
                    bk = ldsm_t(ks, kk * 16, wk * DQ + n * 8)
                    for m in range(2):
                        mma(dqa[m][n], sa2[m], bk[0:2]); mma(dqa[m][n + 1], sa2[m], bk[2:4])
            for m in range(2):
                for h in range(2):
                    qa_ = i0 + wq * 32 + m * 16 + G + 8 * h
                    for l in range(32):
                        if qa_[l] >= a['s']:
                            continue
                        for n in range(DQ // 8):
                            col = wk * DQ + n * 8 + 2 * T[l]
                            dq_acc[b, qa_[l], hh, col] += dqa[m][n][l][2 * h]
                            dq_acc[b, qa_[l], hh, col + 1] += dqa[m][n][l][2 * h + 1]
    for warp in range(8):
        wq, wk = warp >> 2, warp & 3
        for m in range(2):
            for h in range(2):
                j = j0 + wk * 32 + m * 16 + G + 8 * h
                for l in range(32):
                    if j[l] >= a['t']:
                        continue
                    for n in range(DH // 8):
                        col = wq * DH + n * 8 + 2 * T[l]
                        dk[b, j[l], kvh, col:col + 2] = bf16(dka[warp][m][n][l][2 * h:2 * h + 2] * a['scale'])
                        dv[b, j[l], kvh, col:col + 2] = bf16(dva[warp][m][n][l][2 * h:2 * h + 2])

def reference(a, q, k, v, dout, slopes):
    B, S, H, D = q.shape; Tt = k.shape[1]; g = H // a['hkv']
    out = np.zeros_like(q, dtype=np.float64); lse = np.zeros((B, H, S))
    dq = np.zeros(q.shape); dk = np.zeros(k.shape); dv = np.zeros(k.shape)
    for b in range(B):
        for hh in range(H):
            kv = hh // g
            sc = q[b, :, hh].astype(np.float64) @ k[b, :, kv].astype(np.float64).T * a['scale']
            mask = np.zeros((S, Tt), bool)
            for i in range(S):
                p = i + Tt - S
                lo, hi = attn_visible(a, p)
                mask[i, lo:hi] = True
                if slopes is not None:
                    sc[i] += slopes[hh] * (np.arange(Tt) - p)
            sc = np.where(mask, sc, -np.inf)
            m = sc.max(1, keepdims=True); m = np.where(np.isfinite(m), m, 0)
            e = np.exp(sc - m); ssum = e.sum(1, keepdims=True)
            P = np.where(ssum > 0, e / np.maximum(ssum, 1e-300), 0)
            lse[b, hh] = np.where(ssum[:, 0] > 0, m[:, 0] + np.log(np.maximum(ssum[:, 0], 1e-300)), -np.inf)
            o = P @ v[b, :, kv]
            out[b, :, hh] = o
            do = dout[b, :, hh].astype(np.float64)
            dP = do @ v[b, :, kv].T
            Dl = (do * o).sum(1, keepdims=True)
            dS = P * (dP - Dl)
            dq[b, :, hh] = dS @ k[b, :, kv] * a['scale']
            dk[b, :, kv] += dS.T @ q[b, :, hh] * a['scale']
            dv[b, :, kv] += P.T @ do
    return out, lse, dq, dk, dv

def run(name, B, S, Tt, H, HKV, D, causal=True, window=0, alibi=False, seed=0):
    rng = np.random.default_rng(seed)
    u = lambda *s: bf16(rng.uniform(-1, 1, s).astype(np.float32))
    q, k, v, dout = u(B, S, H, D), u(B, Tt, HKV, D), u(B, Tt, HKV, D), u(B, S, H, D)
    a = dict(b=B, s=S, t=Tt, h=H, hkv=HKV, d=D, causal=causal, window=window, scale=np.float32(1 / np.sqrt(D)))
    slopes = (2.0 ** (-8.0 * (np.arange(H) + 1) / H)).astype(np.float32) if alibi else None
    out, lse, rdq, rdk, rdv = reference(a, q, k, v, dout, slopes)
    out_b = bf16(out.astype(np.float32))
    delta = np.einsum('bshd,bshd->bhs', out_b.astype(np.float64), dout.astype(np.float64)).astype(np.float32)
    lse32 = lse.astype(np.float32)
    dq_acc = np.zeros((B, S, H, D)); dk = np.zeros((B, Tt, HKV, D), np.float32); dv = np.zeros_like(dk)
    for b in range(B):
        for kvh in range(HKV):
            for bx in range((Tt + BC - 1) // BC):
                block(a, D, q, k, v, dout, lse32, delta, slopes, dq_acc, dk, dv, bx, kvh, b)
    dq = bf16((dq_acc * a['scale']).astype(np.float32))
    rel = lambda x, y: np.sqrt(((x - y) ** 2).sum() / max((y ** 2).sum(), 1e-30))
    errs = (rel(dq, rdq), rel(dk, rdk), rel(dv, rdv))
    ok = all(e < 1e-2 for e in errs)
    print(f"{name}: dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    return ok

if __name__ == "__main__":
    D = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    oks = [
        run("gqa", 1, 100, 130, 4, 2, D),
        run("window", 1, 100, 130, 2, 2, D, window=7),
        run("alibi", 1, 100, 130, 4, 2, D, alibi=True),
        run("bidirectional", 1, 100, 130, 2, 1, D, causal=False),
        run("full-tiles", 1, 192, 256, 2, 2, D, causal=False),
        run("causal-256", 1, 256, 256, 2, 2, D),
    ]
    sys.exit(0 if all(oks) else 1)
