"""How fast the selected K / V rows of a reuse step can be gathered on sm_90, with nothing else in the kernel:

    python -m scripts.probe_gather_sm90      (a GPU; prints ms and TB/s of gathered rows; writes nothing)

Each program (one per query group and head, head-major as the gather kernel's tiles) copies its n_keep selected
K and V rows (BN = 128 a block) into a two-stage shared-memory ring and does nothing with them: by cp.async
(16 bytes a thread; TPR threads a row: 4 = the gather kernel's 64-byte segments, 8, 16; and in the gather kernel's
producer order, K_j landed before V_j is issued), and by one TMA box of
[1, 64] per half row issued from one warp. The TMA variant lands in an unswizzled layout, which wgmma cannot read:
Gluon 3.6 refuses a one-row box into the 128-byte-swizzled layout (it needs >= [8, 64]), so it times the copy
engine only. S = 32760 / 75600, s = 0.15, H = 40, D = 128, random sorted selections. docs/sparse_notes.md has
the H100 figures and what they say about the gather kernel.
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def _gather_cp(K, V, IDX, n_gc, N_KEEP, sks, skh, sih, sig, TPR: gl.constexpr, BN: gl.constexpr,
               D: gl.constexpr, CHAIN: gl.constexpr = False):
    NW: gl.constexpr = gl.num_warps()
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPR, TPR], [NW, 1], [1, 0])
    sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], gl.bfloat16)
    ks = gl.allocate_shared_memory(gl.bfloat16, [2, BN, D], sl)
    vs = gl.allocate_shared_memory(gl.bfloat16, [2, BN, D], sl)
    t = gl.program_id(0)
    g = t % n_gc
    h = (t // n_gc).to(gl.int64)
    kb = K + h * skh
    vb = V + h * skh
    ib = IDX + h * sih + g.to(gl.int64) * sig
    offs = gl.arange(0, BN, layout=gl.SliceLayout(1, lay))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, lay))
    nb = N_KEEP // BN
    for j in range(0, nb):
        kid = gl.load(ib + j * BN + offs)
        s = j % 2
        if CHAIN:  # the gather kernel's producer order: K_j, wait for V_{j-1} and K_j to land, then V_j
            async_copy.async_copy_global_to_shared(ks.index(s), kb + kid[:, None] * sks + d[None, :])
            async_copy.commit_group()
            async_copy.wait_group(0)
            async_copy.async_copy_global_to_shared(vs.index(s), vb + kid[:, None] * sks + d[None, :])
            async_copy.commit_group()
        else:  # K_j and V_j together, one block in flight while the next is issued
            async_copy.async_copy_global_to_shared(ks.index(s), kb + kid[:, None] * sks + d[None, :])
            async_copy.async_copy_global_to_shared(vs.index(s), vb + kid[:, None] * sks + d[None, :])
            async_copy.commit_group()
            async_copy.wait_group(1)
    async_copy.wait_group(0)


@gluon.jit
def _gather_tma(kdesc, vdesc, IDX, n_gc, N_KEEP, S, sih, sig, BN: gl.constexpr, D: gl.constexpr,
                DH: gl.constexpr):
    # D / DH boxes of [1, DH] per row and tensor, issued from one warp (num_warps=1)
    l3: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    ks = gl.allocate_shared_memory(gl.bfloat16, [2 * (D // DH) * BN, 1, DH], l3)
    vs = gl.allocate_shared_memory(gl.bfloat16, [2 * (D // DH) * BN, 1, DH], l3)
    bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    mbarrier.init(bar.index(1), count=1)
    t = gl.program_id(0)
    g = t % n_gc
    h = t // n_gc
    ib = IDX + h.to(gl.int64) * sih + g.to(gl.int64) * sig
    nb = N_KEEP // BN
    for j in range(0, nb):
        s = j % 2
        if j >= 2:
            mbarrier.wait(bar.index(s), ((j - 2) // 2) & 1)
        mbarrier.expect(bar.index(s), 2 * BN * D * 2)
        for r in gl.static_range(BN):
            kid = gl.load(ib + j * BN + r) + h * S
            for c in gl.static_range(D // DH):
                tma.async_copy_global_to_shared(kdesc, [kid, c * DH], bar.index(s),
                                                ks.index((s * (D // DH) + c) * BN + r))
                tma.async_copy_global_to_shared(vdesc, [kid, c * DH], bar.index(s),
                                                vs.index((s * (D // DH) + c) * BN + r))
    if nb >= 2:
        mbarrier.wait(bar.index((nb - 2) % 2), ((nb - 2) // 2) & 1)
    mbarrier.wait(bar.index((nb - 1) % 2), ((nb - 1) // 2) & 1)


def bench(fn):
    return triton.testing.do_bench(fn, warmup=20, rep=100)


def main():
    print(torch.cuda.get_device_name(), flush=True)
    H, D, BN, C = 40, 128, 128, 128
    for S, s in ((32760, 0.15), (75600, 0.15)):
        n_keep = (int(s * S) // BN) * BN
        G = S // C
        k = torch.randn(H, S, D, device="cuda").to(torch.bfloat16)
        v = torch.randn(H, S, D, device="cuda").to(torch.bfloat16)
        idx = torch.empty(H, G, n_keep, device="cuda", dtype=torch.int32)
        for hh in range(H):
            idx[hh] = torch.rand(G, S, device="cuda").topk(n_keep, dim=-1, sorted=False).indices.sort(-1).values.int()
        nbytes = H * G * n_keep * 2 * D * 2
        rows = []
        for tpr, chain in ((4, False), (8, False), (16, False), (4, True)):
            f = lambda: _gather_cp[(H * G,)](k, v, idx, G, n_keep, k.stride(1), k.stride(0), idx.stride(0),
                                             idx.stride(1), TPR=tpr, BN=BN, D=D, CHAIN=chain, num_warps=4)
            try:
                ms = bench(f)
                rows.append((f"cp.async TPR{tpr} 4w" + (", K landed before V (the kernel's order)" if chain else ""),
                             ms))
            except Exception as e:  # noqa: BLE001
                print("cp", tpr, type(e).__name__, str(e)[:300])
        k2 = k.view(H * S, D)
        v2 = v.view(H * S, D)
        for DH in (64,):
            lay = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
            kd = TensorDescriptor.from_tensor(k2, [1, DH], lay)
            vd = TensorDescriptor.from_tensor(v2, [1, DH], lay)
            for nw in (1,):
                f = lambda: _gather_tma[(H * G,)](kd, vd, idx, G, n_keep, S, idx.stride(0), idx.stride(1), BN=BN,
                                                  D=D, DH=DH, num_warps=nw)
                try:
                    ms = bench(f)
                    rows.append((f"TMA rows box[1,{DH}] {nw}w", ms))
                except Exception as e:  # noqa: BLE001
                    print("tma", type(e).__name__, str(e)[:600])
        for name, ms in rows:
            print(f"S={S} s={s} {name}: {ms:.3f} ms  {nbytes / ms / 1e9:.2f} TB/s gathered", flush=True)
        del k, v, idx


if __name__ == "__main__":
    main()
