"""The attention backend selector over the whole ``AttnShape`` space (docs/design.md §4).

The candidates are the registered backends plus test-local fakes whose
``supports`` refuse some shapes, the way real kernels do. Properties: auto
selection picks the cheapest backend that supports the shape and never one
that does not; a requested backend is used or refused with its reason, never
replaced. Named regressions come from production failures: kernels that rejected
64 < H < 128 heads and had no page-64 variant. Fakes are passed with
``backends=[...]`` so the global registry is left alone.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.attention import selector
from specdec.attention.backends.torch_ref import TorchRefBackend
from specdec.attention.metadata import plan_step
from specdec.attention.selector import available_backends, get_backend, register_backend, select
from specdec.attention.shapes import YES, AttnShape, Verdict, no
from specdec.config import AttentionConfig
from specdec.errors import ConfigError, UnsupportedShapeError

# --------------------------------------------------------------------------- fakes
# Subclasses of the reference backend, so plan/run work when plan_step uses them.


class NoMidHeads(TorchRefBackend):
    """Like trtllm-gen MLA decode: rejects 64 < H < 128; fast."""

    name = "fake_no_mid_heads"

    def supports(self, shape: AttnShape) -> Verdict:
        if 64 < shape.num_heads < 128:
            return no(f"num_heads must not be in (64, 128), got {shape.num_heads}")
        return YES

    def cost(self, shape: AttnShape) -> float:
        return 1.0


class Page32Only(TorchRefBackend):
    """Like a fallback whose kernels exist only for 32-token pages; fastest on GPU."""

    name = "fake_page32_only"

    def supports(self, shape: AttnShape) -> Verdict:
        if shape.tokens_per_block != 32:
            return no(f"no kernel for tokens_per_block={shape.tokens_per_block} (only 32)")
        return YES

    def cost(self, shape: AttnShape) -> float:
        return 0.8 if shape.device == "cuda" else 3.0


class DecodeOnlyCheap(TorchRefBackend):
    """Cheaper than everything else, but only one query token per request."""

    name = "fake_decode_only"

    def supports(self, shape: AttnShape) -> Verdict:
        if shape.max_q_len != 1:
            return no(f"max_q_len must be 1, got {shape.max_q_len}")
        return YES

    def cost(self, shape: AttnShape) -> float:
        return 0.1


class CudaMlaNoHelix(TorchRefBackend):
    """A GPU MLA kernel: cuda, sm >= 90, kind mla, no Helix, bf16/fp8 cache; cost grows with H."""

    name = "fake_cuda_mla"

    def supports(self, shape: AttnShape) -> Verdict:
        if shape.device != "cuda" or (shape.sm or 0) < 90:
            return no(f"needs cuda sm >= 90, got {shape.device} sm={shape.sm}")
        if shape.kind != "mla":
            return no(f"kind must be 'mla', got {shape.kind!r}")
        if shape.helix_cp != 1:
            return no(f"Helix (cp={shape.helix_cp}) not supported")
        if shape.kv_dtype not in ("bfloat16", "float8_e4m3fn"):
            return no(f"kv_dtype must be bfloat16 or float8_e4m3fn, got {shape.kv_dtype}")
        return YES

    def cost(self, shape: AttnShape) -> float:
        return shape.num_heads / 64


class HelixAny(TorchRefBackend):
    """A correctness-first kernel (like CuTe DSL for Helix): every shape except mixed context phases; slow-ish."""

    name = "fake_helix_any"

    def supports(self, shape: AttnShape) -> Verdict:
        if shape.phase == "context" and shape.helix_cp > 1:
            return no("Helix context phase not supported")
        return YES

    def cost(self, shape: AttnShape) -> float:
        return 5.0


class TieA(TorchRefBackend):
    name = "fake_tie_a"

    def supports(self, shape: AttnShape) -> Verdict:
        return YES if shape.kind == "gqa" else no(f"kind must be 'gqa', got {shape.kind!r}")

    def cost(self, shape: AttnShape) -> float:
        return 2.0


class TieB(TieA):
    name = "fake_tie_b"


FAKES = [NoMidHeads(), Page32Only(), DecodeOnlyCheap(), CudaMlaNoHelix(), HelixAny(), TieA(), TieB()]
REF = get_backend("torch_ref")
HELIX_REF = get_backend("helix_ref")


def all_backends():
    """The real registered backends plus the fakes (registered ones first)."""
    return available_backends() + FAKES


# --------------------------------------------------------------------------- shapes


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


head_counts = st.one_of(
    st.integers(1, 160),
    st.sampled_from([8, 12, 16, 32, 33, 48, 63, 64, 65, 96, 120, 127, 128, 129, 160]),
)
DTYPES = ["float32", "bfloat16", "float16", "float8_e4m3fn"]


@st.composite
def attn_shapes(draw) -> AttnShape:
    phase = draw(st.sampled_from(["context", "generation"]))
    kind = draw(st.sampled_from(["gqa", "mla"]))
    h = draw(head_counts)
    if kind == "mla":
        hkv, head_dim, v_head_dim = 1, draw(st.sampled_from([576, 192, 40])), draw(st.sampled_from([512, 128, 32]))
    else:
        hkv = draw(st.sampled_from(divisors(h)))
        head_dim = draw(st.sampled_from([32, 64, 80, 128, 256]))
        v_head_dim = draw(st.sampled_from([head_dim, 64, 128]))
    if phase == "context":
        max_q_len = draw(st.one_of(st.integers(1, 8), st.integers(9, 8192)))
    else:
        max_q_len = draw(st.integers(1, 9))  # decode (1) or verify (1 + k)
    device = draw(st.sampled_from(["cpu", "cuda"]))
    return AttnShape(
        phase=phase,
        kind=kind,
        num_heads=h,
        num_kv_heads=hkv,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        tokens_per_block=draw(st.sampled_from([1, 4, 8, 16, 32, 64, 128])),
        max_q_len=max_q_len,
        kv_dtype=draw(st.sampled_from(DTYPES)),
        q_dtype=draw(st.sampled_from(DTYPES[:3])),
        device=device,
        sm=draw(st.sampled_from([80, 90, 100, 103, 120])) if device == "cuda" else None,
        helix_cp=draw(st.sampled_from([1, 1, 2, 4, 8])),
        mixed=phase == "generation" and draw(st.booleans()),
    )


# A random subset (possibly without torch_ref, so "nothing supports" happens) in random order.
backend_pools = st.lists(st.sampled_from(all_backends()), min_size=1, unique_by=lambda b: b.name).map(list)

SETTINGS = settings(max_examples=200, deadline=None)


# --------------------------------------------------------------------------- properties


@SETTINGS
@given(shape=attn_shapes(), pool=backend_pools)
def test_auto_picks_the_cheapest_supporting_backend(shape, pool):
    supporting = [b for b in pool if b.supports(shape).ok]
    if not supporting:
        with pytest.raises(UnsupportedShapeError) as err:
            select(shape, backends=pool)
        for b in pool:  # the message gives every candidate's reason
            assert b.name in str(err.value) and b.supports(shape).reason in str(err.value)
        return
    chosen = select(shape, backends=pool)
    assert chosen in pool
    assert chosen.supports(shape).ok, f"auto picked {chosen.name}, which refuses {shape}"
    assert chosen.cost(shape) == min(b.cost(shape) for b in supporting)
    # Deterministic: the order of candidates does not matter.
    assert select(shape, backends=list(reversed(pool))) is chosen


def servable(shape: AttnShape) -> bool:
    """Shapes the reference backends run: every unsharded shape (torch_ref), and Helix MLA whose
    heads split evenly across the ranks (helix_ref)."""
    return shape.helix_cp == 1 or (shape.kind == "mla" and shape.num_heads % shape.helix_cp == 0
                                   and shape.v_head_dim <= shape.head_dim)


@SETTINGS
@given(shape=attn_shapes())
def test_auto_with_the_references_always_finds_one(shape):
    if any(b.supports(shape).ok for b in all_backends()):
        assert select(shape, backends=all_backends()).supports(shape).ok
    if servable(shape):
        chosen = select(shape)  # the global registry
        assert chosen.supports(shape).ok
        assert chosen.name == (HELIX_REF if shape.helix_cp > 1 else REF).name or chosen.cost(shape) < 100
    else:  # GQA under Helix, or heads that do not split across the ranks: refused with both reasons
        with pytest.raises(UnsupportedShapeError) as err:
            select(shape)
        assert REF.supports(shape).reason in str(err.value) and HELIX_REF.supports(shape).reason in str(err.value)


@st.composite
def helix_shapes(draw) -> AttnShape:
    """Helix MLA shapes as Kimi/DeepSeek run them: 16-128 heads per rank (48 and 96 often), decode or
    verify (1-8 query tokens) or context, pages of 16-128 tokens, mixed batches, any cache dtype."""
    cp = draw(st.sampled_from([2, 4, 8]))
    h = draw(st.one_of(st.sampled_from([16, 32, 48, 64, 96, 128]), st.integers(16, 128)))
    phase = draw(st.sampled_from(["generation", "generation", "context"]))
    device = draw(st.sampled_from(["cpu", "cuda"]))
    return AttnShape(phase, "mla", h, 1, 576, 512, draw(st.sampled_from([16, 32, 64, 128])),
                     draw(st.integers(1, 8)) if phase == "generation" else draw(st.integers(1, 4096)),
                     kv_dtype=draw(st.sampled_from(["bfloat16", "float8_e4m3fn", "float32"])),
                     q_dtype=draw(st.sampled_from(["bfloat16", "float32"])), device=device,
                     sm=draw(st.sampled_from([90, 100, 103])) if device == "cuda" else None, helix_cp=cp,
                     mixed=phase == "generation" and draw(st.booleans()))


@SETTINGS
@given(shape=helix_shapes(), pool=backend_pools)
def test_helix_shapes_never_go_to_a_backend_that_refuses_them(shape, pool):
    """The selector never picks a backend outside its supports(), for Helix shapes too; with the
    registry alone an evenly split Helix shape goes to helix_ref or a cheaper Helix kernel that
    supports it (triton_mla where its Helix path is validated), never to torch_ref."""
    supporting = [b for b in pool if b.supports(shape).ok]
    if supporting:
        chosen = select(shape, backends=pool)
        assert chosen.supports(shape).ok and chosen.cost(shape) == min(b.cost(shape) for b in supporting)
    else:
        with pytest.raises(UnsupportedShapeError):
            select(shape, backends=pool)
    assert not REF.supports(shape).ok and "helix_cp must be 1" in REF.supports(shape).reason
    if shape.num_heads % shape.helix_cp == 0:
        chosen = select(shape)
        assert chosen.supports(shape).ok and chosen.name != REF.name
        kernels = [b for b in available_backends() if b.name != HELIX_REF.name and b.supports(shape).ok]
        assert chosen.name == (min(kernels, key=lambda b: b.cost(shape)) if kernels else HELIX_REF).name
        assert chosen.name == HELIX_REF.name or chosen.cost(shape) < HELIX_REF.cost(shape)
    else:
        assert "divisible by helix_cp" in HELIX_REF.supports(shape).reason
        with pytest.raises(UnsupportedShapeError, match="divisible by helix_cp"):
            select(shape)


@SETTINGS
@given(shape=attn_shapes(), pool=backend_pools, data=st.data())
def test_requested_is_used_or_refused_never_replaced(shape, pool, data):
    wanted = data.draw(st.sampled_from(pool))
    verdict = wanted.supports(shape)
    if verdict.ok:
        assert select(shape, requested=wanted.name, backends=pool) is wanted
    else:
        with pytest.raises(UnsupportedShapeError) as err:
            select(shape, requested=wanted.name, backends=pool)
        msg = str(err.value)
        assert repr(wanted.name) in msg and verdict.reason in msg
        assert str(shape) in msg


@settings(max_examples=50, deadline=None)
@given(shape=attn_shapes(), pool=backend_pools, name=st.text(max_size=8))
def test_unknown_requested_name_is_a_config_error(shape, pool, name):
    if name in {b.name for b in pool}:
        name += "_nope"
    with pytest.raises(ConfigError, match="attention_backend") as err:
        select(shape, requested=name, backends=pool)
    assert repr(name) in str(err.value)
    assert not isinstance(err.value, UnsupportedShapeError)


def test_fakes_do_not_leak_into_the_registry():
    names = {b.name for b in available_backends()}
    assert "torch_ref" in names and not names & {b.name for b in FAKES}
    shape = AttnShape("generation", "gqa", 8, 2, 64, 64, 16, 1)
    with pytest.raises(ConfigError, match="fake_decode_only"):
        select(shape, requested="fake_decode_only")
    with pytest.raises(ConfigError, match="nope"):
        get_backend("nope")


def test_cost_ties_break_by_name():
    shape = AttnShape("context", "gqa", 8, 2, 64, 64, 16, 128)
    assert select(shape, backends=[TieB(), TieA(), REF]).name == "fake_tie_a"


def test_every_call_builds_its_own_backends():
    """The registry holds classes: each set of backends is new, so an engine's backends are its own."""
    first, second = available_backends(), available_backends()
    assert [b.name for b in first] == [b.name for b in second] and "torch_ref" in [b.name for b in first]
    assert not {id(b) for b in first} & {id(b) for b in second}
    assert get_backend("torch_ref") is not get_backend("torch_ref")
    shape = AttnShape("generation", "gqa", 8, 2, 64, 64, 16, 1)
    assert select(shape, backends=first) in first and select(shape).name == select(shape, backends=first).name


def test_register_backend_takes_a_class():
    names = set(selector._BACKENDS)
    with pytest.raises(TypeError, match="AttentionBackend subclass"):
        register_backend(NoMidHeads())  # an instance would be shared by every engine
    with pytest.raises(TypeError, match="AttentionBackend subclass"):
        register_backend(dict)
    assert set(selector._BACKENDS) == names


def test_backends_are_built_with_the_attention_config():
    """``AttentionConfig`` reaches the backends it applies to; the others ignore it."""
    names = {b.name for b in available_backends()}
    if "triton_gqa" not in names:
        pytest.skip("triton is not installed: no backend reads AttentionConfig.pdl")
    for pdl in (None, True, False):
        built = {b.name: b for b in available_backends(AttentionConfig(pdl=pdl))}
        assert built["triton_gqa"].pdl is pdl and get_backend("triton_gqa", AttentionConfig(pdl=pdl)).pdl is pdl
        assert set(built) == names
    with pytest.raises(AttributeError):
        built["triton_gqa"].pdl = True  # fixed at construction
    with pytest.raises(ConfigError, match="AttentionConfig.pdl must be"):
        AttentionConfig(pdl=1)


# --------------------------------------------------------------------------- named regressions


def mla(phase: str, h: int, max_q_len: int, tokens_per_block: int = 32, **kw) -> AttnShape:
    """A Kimi/DeepSeek-like absorbed MLA shape."""
    kw = {"kv_dtype": "bfloat16", "q_dtype": "bfloat16", "device": "cuda", "sm": 100, **kw}
    return AttnShape(phase, "mla", h, 1, 576, 512, tokens_per_block, max_q_len, **kw)


@pytest.mark.parametrize("mixed", [False, True], ids=["generation_only", "mixed"])
@pytest.mark.parametrize("max_q_len", [4, 1], ids=["verify", "decode"])
def test_h96_generation_avoids_the_backend_that_rejects_mid_heads(mixed, max_q_len):
    """Reference 000/001: H = 96 verify batches went to a kernel rejecting 64 < H < 128."""
    shape = mla("generation", 96, max_q_len, mixed=mixed, helix_cp=1)
    mid = NoMidHeads()
    assert select(shape, backends=[mid, REF]) is REF
    assert select(shape, backends=[mid, HelixAny(), REF]).name == "fake_helix_any"
    with pytest.raises(UnsupportedShapeError, match=r"fake_no_mid_heads.*num_heads must not be in \(64, 128\)"):
        select(shape, requested="fake_no_mid_heads", backends=[mid, REF])
    # Controls: where the fast kernel is legal it is still chosen.
    for h in (12, 64, 128):
        assert select(mla("generation", h, max_q_len, mixed=mixed), backends=[mid, REF]) is mid


def test_h96_mixed_step_chooses_per_phase(monkeypatch):
    """The generation part of a mixed batch is a generation batch: each phase gets its own backend."""
    for fake in (NoMidHeads, DecodeOnlyCheap):
        monkeypatch.setitem(selector._BACKENDS, fake.name, fake)  # restored after the test

    def shape_of(phase, q, mixed):
        return AttnShape(phase, "mla", 96, 1, 40, 32, 4, q, mixed=mixed)

    tables = ((0, 1), (2,), (3, 4))
    slot_mapping = torch.arange(5 + 1 + 1)
    # Context (5 tokens), then two decode requests.
    attn = plan_step([(5, 5, tables[0])], [(1, 3, tables[1]), (1, 6, tables[2])], slot_mapping, shape_of, 4)
    assert attn.backends == {"context": "torch_ref", "generation": "fake_decode_only"}
    assert attn.phases[1].shape.mixed and not attn.phases[0].shape.mixed
    # Verify (1 + 3 tokens): decode-only is refused, 64 < H < 128 is refused, the reference runs it.
    slot_mapping = torch.arange(5 + 4)
    attn = plan_step([(5, 5, tables[0])], [(4, 7, tables[2])], slot_mapping, shape_of, 4)
    assert attn.backends == {"context": "torch_ref", "generation": "torch_ref"}
    with pytest.raises(UnsupportedShapeError, match="fake_decode_only.*max_q_len must be 1"):
        plan_step([], [(4, 7, tables[2])], torch.arange(4), shape_of, 4, requested="fake_decode_only")


@pytest.mark.parametrize("max_q_len", [1, 3])
@pytest.mark.parametrize("mixed", [False, True])
def test_h48_helix_on_64_token_pages_avoids_the_page32_only_backend(max_q_len, mixed):
    """Reference 003: Helix MLA, 48 heads, 64-token pages fell to a fallback with no page-64 kernel."""
    shape = mla("generation", 48, max_q_len, tokens_per_block=64, helix_cp=4, mixed=mixed, kv_dtype="float8_e4m3fn")
    fallback, cute, cuda_mla = Page32Only(), HelixAny(), CudaMlaNoHelix()
    pool = [fallback, cuda_mla, cute, REF, HELIX_REF]
    assert select(shape, backends=pool) is cute
    # Without the correctness-first kernel the Helix reference runs it, never the page-32 fallback,
    # and never torch_ref (it would attend this rank's pages only).
    assert select(shape, backends=[fallback, REF, HELIX_REF]) is HELIX_REF
    assert select(shape).name == "helix_ref"
    with pytest.raises(UnsupportedShapeError, match=r"fake_page32_only.*tokens_per_block=64"):
        select(shape, requested="fake_page32_only", backends=pool)
    with pytest.raises(UnsupportedShapeError, match=r"fake_cuda_mla.*Helix"):
        select(shape, requested="fake_cuda_mla", backends=pool)
    with pytest.raises(UnsupportedShapeError, match=r"'torch_ref'.*helix_cp must be 1"):
        select(shape, requested="torch_ref", backends=pool)
    with pytest.raises(UnsupportedShapeError, match=r"fake_page32_only.*tokens_per_block=64"):
        select(shape, backends=[fallback, REF])  # nothing left that runs it: refused, not downgraded
    # Control: on 32-token pages the cheap fallback is legal and chosen.
    ok = mla("generation", 48, max_q_len, tokens_per_block=32, helix_cp=4, mixed=mixed)
    assert select(ok, backends=pool) is fallback


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("mixed", [False, True], ids=["generation_only", "mixed"])
@pytest.mark.parametrize("max_q_len", [4, 1], ids=["verify", "decode"])
def test_h96_helix_verify_group_avoids_the_backend_that_rejects_mid_heads(max_q_len, mixed, cp):
    """Reference 000/001 under Helix: 96 heads per rank, a verify group (1 + k rows per request)."""
    shape = mla("generation", 96, max_q_len, mixed=mixed, helix_cp=cp)
    mid = NoMidHeads()
    assert select(shape, backends=[mid, REF, HELIX_REF]) is HELIX_REF
    assert select(shape).name == "helix_ref"
    with pytest.raises(UnsupportedShapeError, match=r"fake_no_mid_heads.*num_heads must not be in \(64, 128\)"):
        select(shape, requested="fake_no_mid_heads", backends=[mid, HELIX_REF])
    # Control: at 128 heads the fast kernel is legal and still chosen.
    assert select(mla("generation", 128, max_q_len, mixed=mixed, helix_cp=cp), backends=[mid, HELIX_REF]) is mid


def test_helix_mixed_step_plans_generation_rows_past_the_context_rows():
    """Reference 003: in a mixed Helix batch the generation phase's rows start after the context
    rows; each phase is planned on its own, with its own rows, positions and rank-local pages."""
    from specdec.parallel import HelixKVManager, HelixLayout, HelixShard

    layout = HelixLayout(2, 4)
    shard = HelixShard(layout, 1)
    m = HelixKVManager(layout, 1, 16)
    m.allocate("ctx", 11)  # prompt of 11: rank 1 owns positions 4-7
    m.allocate("gen", 14)  # 10 cached + a verify of 4 rows: positions 10..13, rank 1 owns 12, 13

    def shape_of(phase, q, mixed):
        return AttnShape(phase, "mla", 48, 1, 40, 32, 4, q, helix_cp=2, mixed=mixed)

    slots = [-1] * 4 + [m.slot("ctx", p) for p in range(4, 8)] + [-1] * 3 + [-1, -1] + [m.slot("gen", p) for p in (12, 13)]
    attn = plan_step([(11, 11, tuple(m.page_table("ctx")))], [(4, 14, tuple(m.page_table("gen")))],
                     torch.tensor(slots), shape_of, 4, shard=shard)
    assert attn.backends == {"context": "helix_ref", "generation": "helix_ref"}
    ctx, gen = attn.phases
    assert (ctx.start, ctx.stop, gen.start, gen.stop) == (0, 11, 11, 15) and gen.shape.mixed
    assert attn.write_rows.tolist() == [4, 5, 6, 7, 13, 14]  # the rows rank 1 owns, nothing else
    g = gen.plan.plan  # relative to the generation slice: rows 0..3 at positions 10..13
    assert g.num_tokens == 4 and g.q_index.tolist() == [[0, 1, 2, 3]] and g.q_pos.tolist() == [[10, 11, 12, 13]]
    assert g.kv_pos[0, :6].tolist() == [4, 5, 6, 7, 12, 13]
    pages = m.page_table("gen")
    assert g.gather[0, :6].tolist() == [pages[0] * 4 + i for i in range(4)] + [pages[1] * 4, pages[1] * 4 + 1]
    with pytest.raises(UnsupportedShapeError, match="helix_cp must be 1"):
        plan_step([], [(4, 14, tuple(m.page_table("gen")))], torch.tensor(slots[11:]), shape_of, 4,
                  requested="torch_ref", shard=shard)


def test_no_backend_supports_names_every_reason():
    shape = AttnShape("generation", "gqa", 96, 8, 128, 128, 64, 4)
    with pytest.raises(UnsupportedShapeError) as err:
        select(shape, backends=[NoMidHeads(), Page32Only(), DecodeOnlyCheap()])
    msg = str(err.value)
    for part in ("fake_no_mid_heads", "(64, 128)", "fake_page32_only", "tokens_per_block=64", "fake_decode_only",
                 "max_q_len must be 1"):
        assert part in msg
    with pytest.raises(UnsupportedShapeError):
        select(shape, backends=[])


# --------------------------------------------------------------------------- AttnShape validation


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(num_heads=12, num_kv_heads=5), r"num_heads \(12\) must be a multiple of num_kv_heads \(5\)"),
        (dict(num_heads=96, num_kv_heads=64), r"num_heads \(96\) must be a multiple of num_kv_heads \(64\)"),
        (dict(phase="prefill"), r"AttnShape\.phase.*'prefill'"),
        (dict(phase="verify"), r"AttnShape\.phase.*'verify'"),
        (dict(kind="mha"), r"AttnShape\.kind.*'mha'"),
        (dict(num_heads=0), r"AttnShape\.num_heads must be >= 1"),
        (dict(num_kv_heads=0), r"AttnShape\.num_kv_heads must be >= 1"),
        (dict(head_dim=0), r"AttnShape\.head_dim must be >= 1"),
        (dict(v_head_dim=-1), r"AttnShape\.v_head_dim must be >= 1"),
        (dict(tokens_per_block=0), r"AttnShape\.tokens_per_block must be >= 1"),
        (dict(max_q_len=0), r"AttnShape\.max_q_len must be >= 1"),
        (dict(helix_cp=0), r"AttnShape\.helix_cp must be >= 1"),
    ],
)
def test_attn_shape_validation_names_the_field(overrides, match):
    base = dict(phase="generation", kind="gqa", num_heads=32, num_kv_heads=8, head_dim=64, v_head_dim=64,
                tokens_per_block=16, max_q_len=1)
    with pytest.raises(ConfigError, match=match):
        AttnShape(**{**base, **overrides})


def test_verdict_truthiness():
    assert YES and YES.ok and YES.reason == ""
    refusal = no("because")
    assert not refusal and refusal == Verdict(False, "because")
