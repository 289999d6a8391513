"""Compressors one by one: error bounds, exact bit packing, error feedback, residual checkpoints."""

import math

import pytest
import torch

from phalanx.comm.compression import abilities as ab
from phalanx.comm.compression.allreduce import allreduce_compressed, choose_path
from phalanx.comm.compression.codecs import available_compressors, get_compressor
from phalanx.comm.compression.error_feedback import ErrorFeedback
from phalanx.comm.compression.onebit import SignCompressor
from phalanx.comm.compression.paths import pieces
from phalanx.comm.compression.powersgd import PowerSGDCompressor
from phalanx.comm.compression.quantize import QuantizeCompressor, pack_bits, unpack_bits
from phalanx.comm.compression.sparsify import ThresholdCompressor, TopKCompressor, top_indices

pytestmark = pytest.mark.ranks


def test_pack_bits_exact():
    assert pack_bits(torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1]), 1).tolist() == [0b1101, 1]
    assert pack_bits(torch.tensor([3, 0, 2, 1]), 2).tolist() == [3 | 2 << 4 | 1 << 6]
    assert pack_bits(torch.tensor([15, 1, 7]), 4).tolist() == [15 | 1 << 4, 7]
    gen = torch.Generator().manual_seed(0)
    for bits in (1, 2, 4, 8):
        codes = torch.randint(0, 2**bits, (1001,), generator=gen)
        packed = pack_bits(codes, bits)
        assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(1001 * bits / 8)
        assert torch.equal(unpack_bits(packed, bits, 1001), codes.to(torch.uint8))


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quantize_error_bound_and_size(bits):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(bits)) * 3
    q = QuantizeCompressor(bits=bits, chunk=100)
    payload, ctx = q.compress(x)
    assert payload.dtype == torch.uint8 and payload.numel() == q.payload_nbytes(1000)
    y = q.decompress(payload, ctx)
    scale = x.view(10, 100).abs().amax(1, keepdim=True) / q.levels  # one scale per chunk
    assert ((y - x).view(10, 100).abs() <= scale / 2 + 1e-6).all()
    assert x.numel() * 4 / payload.numel() > {8: 3.8, 4: 7.0, 2: 12.0}[bits]


def test_none_and_casts_round_trip():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(6)) * 100
    none = get_compressor("none")
    assert torch.equal(none.decompress(*none.compress(x)), x) and none.summable
    for name, rel in (("fp16", 2.0**-11), ("bf16", 2.0**-8)):  # round to nearest: half an ulp
        c = get_compressor(name)
        payload, ctx = c.compress(x)
        assert c.summable and payload.element_size() == 2
        y = c.decompress(payload, ctx)
        assert y.dtype == x.dtype and ((y - x).abs() <= rel * x.abs() + 1e-30).all(), name
    ints = torch.arange(5)
    assert torch.equal(get_compressor("fp16").compress(ints)[0], ints)  # integer tensors pass through


def test_stochastic_rounding_is_unbiased():
    x = torch.linspace(-1, 1, 64)
    q = QuantizeCompressor(bits=2, chunk=64, stochastic=True, seed=0)  # only -1, 0, +1 levels
    mean = sum(q.decompress(*q.compress(x)) for _ in range(4000)) / 4000
    assert (mean - x).abs().max() < 0.05
    nearest = QuantizeCompressor(bits=2, chunk=64)
    assert (nearest.decompress(*nearest.compress(x)) - x).abs().max() > 0.3  # the bias it removes


def test_sign_packs_eight_per_byte_and_keeps_mean_magnitude():
    x = torch.tensor([0.5, -2.0, 1.5, 0.0, -1.0, 3.0, -0.5, 2.0, 1.0])
    c = SignCompressor(chunk=4, two_level=False)  # EF-SignSGD: one scale, the mean magnitude
    payload, ctx = c.compress(x)
    assert payload.numel() == 2 + 3 * 4  # 9 bits -> 2 bytes, 3 fp32 scales
    assert payload[:2].tolist() == [0b10101101, 1]
    y = c.decompress(payload, ctx)
    assert torch.equal(torch.sign(y), torch.where(x >= 0, 1.0, -1.0))
    torch.testing.assert_close(y.abs(), torch.tensor([1.0] * 4 + [1.625] * 4 + [1.0]))


def test_sign_two_level_keeps_each_chunk_sum():
    x = torch.tensor([0.5, -2.0, 1.5, 0.0, -1.0, 3.0, -0.5, 2.0, 1.0])
    c = SignCompressor(chunk=4)  # 1-bit SGD: mean of the non-negative / of the negative entries
    payload, ctx = c.compress(x)
    assert payload.numel() == c.payload_nbytes(9) == 2 + 3 * 2 * 4 and payload[:2].tolist() == [0b10101101, 1]
    y = c.decompress(payload, ctx)
    torch.testing.assert_close(y, torch.tensor([2 / 3, -2.0, 2 / 3, 2 / 3, -0.75, 2.5, -0.75, 2.5, 1.0]))
    torch.testing.assert_close(y.view(-1)[:8].view(2, 4).sum(1), x[:8].view(2, 4).sum(1))
    z = torch.randn(1000, generator=torch.Generator().manual_seed(4))  # padded last chunk, odd size
    c64 = SignCompressor(chunk=64)
    zz = c64.decompress(*c64.compress(z))
    torch.testing.assert_close(zz.view(-1)[:960].view(15, 64).sum(1), z[:960].view(15, 64).sum(1))
    torch.testing.assert_close(zz[960:].sum(), z[960:].sum())


def test_sampled_top_indices_are_the_exact_top_k():
    gen = torch.Generator().manual_seed(5)
    for mag in (torch.randn(300_000, generator=gen).abs(), torch.rand(100_000, generator=gen) ** 8):
        for k in (1, 300, 3000):
            got = top_indices(mag, k)
            assert got.numel() == k and torch.equal(got.sort().values, mag.topk(k).indices.sort().values)
    mag = torch.rand(100_000, generator=gen)
    mag[:: 100_000 // 8192] = 2.0  # the sample sees only these: too few candidates, the full topk runs
    assert torch.equal(top_indices(mag, 9000).sort().values, mag.topk(9000).indices.sort().values)
    flat = torch.zeros(100_000)
    flat[::7] = 1.0  # the sample sees only ties: candidates outnumber k, any k of the ties are right
    assert (flat[top_indices(flat, 500)] == 1.0).all()


def test_topk_and_threshold_keep_exactly_the_right_entries():
    x = torch.randn(500, generator=torch.Generator().manual_seed(1))
    c = TopKCompressor(ratio=0.02)
    payload, ctx = c.compress(x)
    y = c.decompress(payload, ctx)
    keep = x.abs().topk(10).indices
    assert payload.numel() == 80 and (y != 0).sum() == 10 and torch.equal(y[keep], x[keep])
    t = ThresholdCompressor(threshold=2.0)
    y = t.decompress(*t.compress(x))
    assert torch.equal(y, torch.where(x.abs() >= 2.0, x, torch.zeros_like(x)))


@pytest.mark.parametrize("name,kw", [("sign", {"chunk": 16}), ("topk", {"ratio": 0.05}), ("2bit", {}), ("threshold", {"threshold": 0.5})])
def test_error_feedback_makes_accumulated_update_unbiased(name, kw):
    gen = torch.Generator().manual_seed(2)
    g_mean = torch.randn(200, generator=gen)
    with_ef, without = get_compressor(name, **kw), get_compressor(name, error_feedback=False, **kw)
    sent_ef = sent_plain = total = 0
    steps = 400
    for _ in range(steps):
        g = g_mean + 0.1 * torch.randn(200, generator=gen)
        total = total + g
        sent_ef = sent_ef + with_ef.decompress(*with_ef.compress(g, name="w"))
        sent_plain = sent_plain + without.decompress(*without.compress(g, name="w"))
    # the exact identity: what was sent + what is still held back == what was computed
    torch.testing.assert_close(sent_ef + with_ef.memory.residuals["w"], total, atol=1e-3, rtol=1e-4)
    err_ef = ((sent_ef - total) / steps).abs().max()
    err_plain = ((sent_plain - total) / steps).abs().max()
    assert err_ef < 0.05, err_ef
    assert err_plain > 5 * err_ef, (err_plain, err_ef)


def test_residual_state_dict_round_trip():
    a = get_compressor("topk", ratio=0.1, warmup_steps=1)
    xs = [torch.randn(100, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    for x in xs[:3]:
        a.tick("b0")
        a.compress(x, name="b0")
    b = get_compressor("topk", ratio=0.1, warmup_steps=1)
    b.load_state_dict(a.state_dict())
    assert b.steps == {"b0": 3} and not b.in_warmup("b0")
    pa, _ = a.compress(xs[3], name="b0")
    pb, _ = b.compress(xs[3], name="b0")
    assert torch.equal(pa, pb) and torch.equal(a.memory.residuals["b0"], b.memory.residuals["b0"])
    fresh = get_compressor("topk", ratio=0.1)
    assert not torch.equal(fresh.compress(xs[3], name="b0")[0], pa)  # the residual mattered


def test_powersgd_exact_on_low_rank_and_state_round_trip():
    gen = torch.Generator().manual_seed(3)
    m = torch.randn(30, 2, generator=gen) @ torch.randn(2, 20, generator=gen)
    c = PowerSGDCompressor(rank=2)
    out, sent = c.reduce(m, name="w")  # world of one: no communication
    torch.testing.assert_close(out, m, atol=1e-4, rtol=1e-4)
    assert sent == 0 and c.payload_nbytes(m) == (30 + 20) * 2 * 4
    full = torch.randn(30, 20, generator=gen)
    c2 = PowerSGDCompressor(rank=1)
    for _ in range(3):
        c2.reduce(full, name="w")
    c3 = PowerSGDCompressor(rank=1)
    c3.load_state_dict(c2.state_dict())
    torch.testing.assert_close(c2.reduce(full, name="w")[0], c3.reduce(full, name="w")[0])
    flat = torch.randn(1000, generator=gen)  # a flat bucket becomes a near-square matrix
    assert c.reduce(flat, name="flat")[0].shape == flat.shape


def test_registry_and_errors():
    assert {"none", "fp16", "bf16", "int8", "int4", "2bit", "topk", "threshold", "sign", "powersgd"} <= set(
        available_compressors()
    )
    assert isinstance(get_compressor("sign"), ErrorFeedback) and get_compressor("sign").enabled
    assert not get_compressor("int8", error_feedback=False).enabled
    assert get_compressor("int8", stochastic=True).inner.stochastic
    with pytest.raises(ValueError, match="unknown compression 'int9'"):
        get_compressor("int9")
    with pytest.raises(TypeError, match="'topk': bad option"):
        get_compressor("topk", ration=0.1)
    with pytest.raises(ValueError, match="topk ratio"):
        get_compressor("topk", ratio=2.0)
    with pytest.raises(ValueError, match="algorithm"):
        allreduce_compressed(torch.ones(3), "int8", algorithm="ring")
    x = torch.randn(10)
    assert torch.equal(allreduce_compressed(x, "sign"), x)  # a world of one sends nothing


def test_fused_error_feedback_and_decode_match_the_plain_forms():
    # compress_ef / decompress_add (what allreduce_compressed uses) against compress / decompress,
    # on sizes with whole 32-bit sign words, a partial last chunk and tiny chunks (amax ~1e-38)
    gen = torch.Generator().manual_seed(7)
    for n in (3000, 2 * 256 + 37):
        x = torch.randn(n, generator=gen)
        x[:256] = torch.randn(256, generator=gen) * 1e-38  # L / amax overflows: sent as zeros, kept
        x[300:310] = 0.0
        x[311] = -0.0
        for c in (QuantizeCompressor(bits=8), QuantizeCompressor(bits=4), SignCompressor(),
                  SignCompressor(two_level=False), SignCompressor(chunk=100), TopKCompressor(ratio=0.05)):
            payload, ctx = c.compress(x)
            y = c.decompress(payload, ctx)
            assert torch.isfinite(y).all(), c
            r = x.clone()
            payload2, _ = c.compress_ef(r)
            assert torch.equal(payload, payload2), c
            torch.testing.assert_close(r, x - y, atol=1e-6, rtol=0)  # the residual, in place
            out = torch.full((n,), 2.0)
            c.decompress_add(payload, ctx, out, 0.25)
            torch.testing.assert_close(out, 2.0 + 0.25 * y, atol=1e-6, rtol=0)
            c.decompress_add(payload, ctx, out, 0.5, add=False)
            torch.testing.assert_close(out, 0.5 * y, atol=1e-6, rtol=0)
        # sign bits: the float's sign bit, 8 to a byte low bit first (the 32-bit words give the same bytes)
        sign_bits = SignCompressor().compress(x)[0][: math.ceil(n / 8)]
        assert torch.equal(sign_bits, pack_bits(x.view(torch.int32) >= 0, 1))


def test_codec_abilities_are_what_the_collectives_dispatch_on():
    # the registry's codecs declare (or define) exactly the abilities the paths rely on
    def abilities(c):
        return {a.__name__ for a in (ab.Warmup, ab.CollectiveCodec, ab.ChunkedCodec, ab.FixedSizePayload,
                                     ab.FusedResidual, ab.FusedDecode, ab.ResidualFeedback, ab.Stateful,
                                     ab.Resettable) if isinstance(c, a)}

    codec = {name: ab.codec_of(get_compressor(name, **({"threshold": 0.01} if name == "threshold" else {})))
             for name in ("none", "fp16", "int8", "sign", "topk", "threshold", "powersgd")}
    assert abilities(codec["none"][1]) == abilities(codec["fp16"][1]) == set()
    for name in ("int8", "sign"):
        assert abilities(codec[name][1]) == {"ChunkedCodec", "FixedSizePayload", "FusedResidual", "FusedDecode"}
    assert abilities(codec["topk"][1]) == {"FixedSizePayload", "FusedResidual", "FusedDecode"}
    assert abilities(codec["threshold"][1]) == {"FusedDecode"}  # data-dependent size: sizes are exchanged
    assert abilities(codec["powersgd"][1]) == {"Warmup", "CollectiveCodec", "FixedSizePayload", "Stateful",
                                               "Resettable"}
    assert codec["powersgd"][0] is None and isinstance(codec["int8"][0], ErrorFeedback)
    assert ab.codec_of(get_compressor("int8", error_feedback=False))[0] is None  # feedback off: plain codec

    # a user's compressor needs only the four members; a method is an ability, with no registration
    class Plain:
        name, summable = "plain", False

        def compress(self, t):
            return t.clone(), None

        def decompress(self, p, ctx):
            return p

    class Counting(Plain):
        def tick(self, name):
            return name == "first"

    assert abilities(Plain()) == set() and abilities(Counting()) == {"Warmup"}
    x = torch.arange(10.0)
    assert torch.equal(allreduce_compressed(x, Plain(), name="u"), x)  # one rank: "local"

    # path selection, on its own
    int8, psgd = get_compressor("int8"), get_compressor("powersgd")
    assert choose_path(int8, 1, warm=False, many=False, numel=10) == "local"
    assert choose_path(get_compressor("fp16"), 4, warm=False, many=False, numel=10) == "summable"
    assert choose_path(int8, 4, warm=True, many=False, numel=10) == "summable"
    assert choose_path(psgd, 2, warm=False, many=True, numel=10) == "reduce_many"
    assert choose_path(psgd, 2, warm=False, many=False, numel=10) == "reduce"
    assert choose_path(int8, 2, warm=False, many=False, numel=10**6) == "allgather"
    assert choose_path(int8, 4, warm=False, many=False, numel=10**6) == "two_phase"
    assert choose_path(int8, 4, warm=False, many=False, numel=10**6, algorithm="allgather") == "allgather"
    assert choose_path(Plain(), 2, warm=False, many=False, numel=10) == "allgather"
    # pieces of whole chunks only for a ChunkedCodec
    assert pieces(codec["int8"][1], 2000, 512) == [(0, 512), (512, 1024), (1024, 1536), (1536, 2000)]
    assert pieces(codec["topk"][1], 2000, 512) == [(0, 2000)]


# ---------------------------------------------------------------- convergence at a constant learning rate

CONSTANT_LR = ["none", "sign", "topk", "powersgd"]


def _digits_constant_lr(names, epochs=10, lr=0.1, seed=0):
    """DataParallel SGD + momentum 0.9 at a fixed lr on digits, 2 ranks, global batch 64: test accuracy per epoch."""
    import phalanx as px
    from phalanx.demo import load_digits

    r, n = px.rank(), px.size()
    x_train, y_train, x_test, y_test = (t.to(px.topology().device) for t in load_digits())
    out = {}
    for name in names:
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
        model = px.DataParallel(net, compression=name)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        batch, local = 64, 64 // n
        accs = []
        for epoch in range(epochs):
            order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
            for step in range(len(x_train) // batch):
                idx = order[step * batch + r * local:][:local]
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
                opt.step()
            with torch.no_grad():
                accs.append((net(x_test).argmax(1) == y_test).float().mean().item())
        model._engine.remove_hooks()
        out[name] = accs
    return out


def test_every_compressor_within_1_5_points_at_constant_lr():
    """No decaying lr to hide the compression error at the end (issue 27): the last 3 epochs' mean
    test accuracy (at a fixed lr 0.1 the uncompressed run itself swings ~3 points from epoch to epoch)
    of each registry default within 1.5 points of uncompressed. Sign at the old default chunk of 256
    values failed this by 4.5 to 20 points in simulation, top-k at the old ratio 0.02 by up to 2.4
    points through real ranks (docs/compression.md)."""
    from phalanx.testing import distributed

    accs = distributed(_digits_constant_lr, np=2, args=(CONSTANT_LR,))[0]
    base = sum(accs["none"][-3:]) / 3
    assert base > 0.9, accs["none"]
    low = [f"{name}: {100 * sum(accs[name][-3:]) / 3:.1f}% vs uncompressed {100 * base:.1f}% ({accs[name]})"
           for name in CONSTANT_LR[1:] if sum(accs[name][-3:]) / 3 < base - 0.015]
    assert not low, low


@pytest.mark.parametrize("make", [lambda: QuantizeCompressor(bits=8), lambda: QuantizeCompressor(bits=4),
                                  lambda: QuantizeCompressor(bits=2), lambda: SignCompressor(),
                                  lambda: SignCompressor(two_level=False)], ids=["int8", "int4", "2bit", "sign", "sign1"])
def test_fused_kernels_match_the_cpu_codec(make):
    """The codecs' fused paths (comm/compression/kernels.py: one compiled call on CUDA), run eagerly
    here under ``kernels.everywhere()``, give the CPU codec's payload byte for byte (the padding of
    a partial last chunk included), its residual and its decoded values; a whole-chunk size too."""
    from phalanx.comm.compression import kernels

    gen = torch.Generator().manual_seed(11)
    for n in (40 * 256 + 77, 8 * 256):
        x = torch.randn(n, generator=gen) * 2
        x[256:512] = 0
        x[600:856] = x[600:856].abs()  # a chunk with no "down" value
        x[900:910] = torch.randn(10, generator=gen) * 1e-39
        c = make()
        payload, ctx = c.compress(x)
        kept = x.clone()
        c.compress_ef(kept)
        out = torch.full((n,), 2.0)
        c.decompress_add(payload, ctx, out, 0.25)
        with kernels.everywhere():
            fused_payload, fused_ctx = c.compress(x)
            fused_kept = x.clone()
            ef_payload, _ = c.compress_ef(fused_kept)
            fused_out = torch.full((n,), 2.0)
            c.decompress_add(payload, ctx, fused_out, 0.25)
            y = c.decompress(payload, ctx)
        assert torch.equal(fused_payload, payload) and torch.equal(ef_payload, payload), (c, n)
        assert fused_ctx == ctx
        torch.testing.assert_close(fused_kept, kept, rtol=0, atol=1e-6)
        torch.testing.assert_close(fused_out, out, rtol=0, atol=1e-6)
        torch.testing.assert_close(y, c.decompress(payload, ctx), rtol=0, atol=1e-6)


def test_fused_threshold_selection_matches_the_cpu_codec():
    from phalanx.comm.compression import kernels
    from phalanx.comm.compression.sparsify import ThresholdCompressor

    c = ThresholdCompressor(0.5)
    x = torch.randn(3000, generator=torch.Generator().manual_seed(2))
    with kernels.everywhere():
        fused, _ = c.compress(x)
    assert torch.equal(fused, c.compress(x)[0])


def test_powersgd_gram_schmidt_on_the_fused_path_matches_qr():
    """On CUDA PowerSGD orthogonalises P by the compiled Gram-Schmidt of kernels.py instead of a
    QR: the same span, so the same approximations P Q^T (compress / decompress, and ``reduce``
    with its warm start and residual over three steps), a zero column included."""
    from phalanx.comm.compression import kernels

    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(60, 40, generator=gen) for _ in range(3)]
    grads[1][:, :] = torch.outer(torch.randn(60, generator=gen), torch.randn(40, generator=gen))  # rank 1
    plain, fused = get_compressor("powersgd"), get_compressor("powersgd")
    for g in grads:
        want = plain.decompress(*plain.compress(g))
        a, _ = plain.reduce(g.clone(), name="w")
        with kernels.everywhere():
            got = fused.decompress(*fused.compress(g))
            b, _ = fused.reduce(g.clone(), name="w")
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    q = kernels.orthonormal_columns(torch.cat([torch.randn(50, 3, generator=gen), torch.zeros(50, 1)], 1))
    torch.testing.assert_close(q.t() @ q, torch.diag(torch.tensor([1.0, 1.0, 1.0, 0.0])), rtol=0, atol=1e-5)


def test_powersgd_reduce_keeps_its_residual():
    """PowerSGD's ``reduce`` (the path of ``allreduce_compressed`` on a bare tensor) computed the
    error-feedback residual into a temporary and dropped it, so it ran without error feedback;
    it now keeps ``corrected - approximation`` for the next call, as ``reduce_many`` does."""
    c = get_compressor("powersgd")
    x = torch.randn(40, 30, generator=torch.Generator().manual_seed(1))
    first, _ = c.reduce(x, name="g")
    torch.testing.assert_close(c.memory.residuals["g"], x - first)
    second, _ = c.reduce(x, name="g")
    torch.testing.assert_close(c.memory.residuals["g"], 2 * x - first - second)


@pytest.mark.parametrize("make", [lambda: QuantizeCompressor(bits=8), lambda: QuantizeCompressor(bits=4),
                                  lambda: QuantizeCompressor(bits=2), lambda: SignCompressor(),
                                  lambda: SignCompressor(two_level=False)], ids=["int8", "int4", "2bit", "sign", "sign1"])
def test_error_feedback_add_fused_into_the_compress(make):
    """Error feedback hands its gradient to the fused compress as an addend (``res + g`` formed
    inside the one compiled call on CUDA; run eagerly here under ``kernels.everywhere()``): over
    4 steps, the payload and the residual bit for bit those of adding into the residual first and
    compressing that (``compress_ef``), and the first payload that of the CPU codec; a partial last
    chunk, whole chunks, fewer values than a chunk, and an empty tensor. Off the fused path
    (CPU) the codec says it takes no addend and error feedback adds first."""
    from phalanx.comm.compression import kernels
    from phalanx.comm.compression.error_feedback import takes_addend

    gen = torch.Generator().manual_seed(5)
    for n in (12 * 256 + 77, 8 * 256, 77, 0):
        c = make()
        assert isinstance(c, ab.AddendResidual) and not takes_addend(c, torch.zeros(n))
        fused, cpu = ErrorFeedback(make()), ErrorFeedback(make())
        calls = []
        plain_add = fused.inner.compress_ef_add
        fused.inner.compress_ef_add = lambda x, g, calls=calls, plain_add=plain_add: calls.append(1) or plain_add(x, g)
        res = None
        for step in range(4):
            g = torch.randn(n, generator=gen) * (1 + step)
            if n > 600:
                g[256:512] = 0
                g[600:610] = torch.randn(10, generator=gen) * 1e-39
            cpu_payload, _ = cpu.compress(g, name="b")
            with kernels.everywhere():
                assert takes_addend(c, g)
                payload, ctx = fused.compress(g, name="b")
                if res is None:
                    res = g.clone()
                else:
                    res.add_(g)
                ref_payload, _ = c.compress_ef(res)  # the unfused path: accumulate, then compress
            assert torch.equal(payload, ref_payload), (c, n, step)
            assert torch.equal(fused.memory.residuals["b"], res), (c, n, step)
            assert ctx == (n, torch.float32, (n,))
            if step == 0:  # later steps: the CPU codec's residual is within 1e-6, so a code may round apart
                assert torch.equal(payload, cpu_payload), (c, n)
                torch.testing.assert_close(fused.memory.residuals["b"], cpu.memory.residuals["b"], rtol=0, atol=1e-6)
        assert len(calls) == 3, (c, n, len(calls))  # every step after the first (which copies g)
    # a bf16 gradient: promoted inside the fused add as by the add it replaces
    g = torch.randn(1000, generator=gen).to(torch.bfloat16)
    fused, ref = ErrorFeedback(QuantizeCompressor()), QuantizeCompressor()
    with kernels.everywhere():
        fused.compress(g, name="h")
        p2, _ = fused.compress(g, name="h")
        r = g.float()
        ref.compress_ef(r)
        r.add_(g)
        q2, _ = ref.compress_ef(r)
    assert torch.equal(p2, q2) and torch.equal(fused.memory.residuals["h"], r)
