"""GGUF k-quants (``tui-merger gguf --type q4_k_m`` and the rest; core/ship/kquants.py) against files that
llama.cpp itself made (tests/fixtures/gguf/, written by make_kquant_fixtures.py with llama-cpp-python's
``llama_model_quantize`` and ggml's ``ggml_quantize_chunk``): every tensor's type and bytes equal
llama.cpp's from the same float16 weights, for each mix and tiny model; llama.cpp's choice of types on
models with more layers and with eight experts; hard rows (zeros, constants, spikes, subnormals, ties)
block for block. llama.cpp is not needed here: only its files are."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from kquant_factory import MODELS, make_kquant_model
from tui_merger.core.events import Notice
from tui_merger.core.ship import kquants
from tui_merger.core.ship.gguf import K_MIXES, export_gguf

FIXTURES = Path(__file__).parent / "fixtures" / "gguf"
RECORD = json.loads((FIXTURES / "kquants.json").read_text())


def tensors(path: Path) -> dict:
    """{name: (type name, sha256 prefix of its bytes)} as llama.cpp's own reader (gguf.GGUFReader) reads the file."""
    from gguf import GGUFReader

    return {t.name: (t.tensor_type.name, hashlib.sha256(t.data.tobytes()).hexdigest()[:16]) for t in GGUFReader(path).tensors}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("kquants")
    return {name: make_kquant_model(root / name, name) for name in MODELS}


def test_the_rebuilt_models_are_the_weights_llama_cpp_quantized(folders, tmp_path):
    """Our F16 GGUF of each rebuilt folder is, tensor for tensor, the input the fixtures were made from
    (so that a difference below is the quantizer's, not the factory's)."""
    for name, folder in folders.items():
        got = tensors(export_gguf(folder, "f16", tmp_path / f"{name}.gguf").path)
        assert {k: h for k, (_, h) in got.items()} == RECORD["models"][name]["f16"], name


@pytest.mark.parametrize("mix", K_MIXES)
@pytest.mark.parametrize("name", list(MODELS))
def test_each_tensor_is_llama_cpps_type_and_bytes(folders, name, mix, tmp_path):
    got = tensors(export_gguf(folders[name], mix, tmp_path / f"{name}-{mix}.gguf").path)
    want = {k: tuple(v) for k, v in RECORD["models"][name]["mixes"][mix].items()}
    assert {k: t for k, (t, _) in got.items()} == {k: t for k, (t, _) in want.items()}
    differ = sorted(k for k in want if got[k] != want[k])
    assert not differ, f"{len(differ)} tensor(s) differ from llama.cpp's: {differ}"


def test_the_q4_k_m_file_equals_llama_cpps_but_for_tensor_order(folders, tmp_path):
    """The whole committed file: every tensor's bytes, shape and type, and every metadata key (llama.cpp
    copies ours and sets general.file_type 15, MOSTLY_Q4_K_M)."""
    from gguf import GGUFReader

    ours = GGUFReader(export_gguf(folders["llama"], "q4_k_m", tmp_path / "q.gguf").path)
    theirs = GGUFReader(FIXTURES / "llama-Q4_K_M.gguf")
    kinds = {"Q4_K", "Q6_K", "Q5_0"}
    assert {t.tensor_type.name for t in theirs.tensors} >= kinds
    a = {t.name: t for t in ours.tensors}
    for t in theirs.tensors:
        mine = a.pop(t.name)
        assert (mine.tensor_type, list(mine.shape)) == (t.tensor_type, list(t.shape)), t.name
        assert np.array_equal(mine.data.view(np.uint8), t.data.view(np.uint8)), t.name
    assert not a
    fields = lambda r: {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}  # noqa: E731
    assert fields(ours) == fields(theirs)
    assert fields(ours)["general.file_type"] == 15


@pytest.mark.parametrize("qtype", ["q3_k", "q4_k", "q5_k", "q6_k"])
def test_hard_rows_quantize_block_for_block_as_ggml(qtype):
    with np.load(FIXTURES / "blocks.npz") as made:
        rows, want = made["rows"].astype(np.float32), made[qtype]
    t = getattr(kquants, qtype.upper())
    got, size = kquants.quantize(rows, t), kquants.K_TYPES[t]
    differ = [(r, b) for r in range(rows.shape[0]) for b in range(rows.shape[1] // 256)
              if not np.array_equal(got[r, b * size:(b + 1) * size], want[r, b * size:(b + 1) * size])]
    assert not differ, f"blocks (row, block) unlike ggml's: {differ}"


@pytest.mark.parametrize("mix", K_MIXES)
@pytest.mark.parametrize("name", ["llama20", "moe8"])
def test_the_mix_rules_choose_llama_cpps_types(name, mix):
    """20 layers (use_more_bits' pattern, Q4_K_S's first four attn_v, Q3_K_M's first sixteenth) and 8
    experts (attn_k and attn_v Q8_0, attn_output Q5_K): names and shapes as llama.cpp saw them."""
    entry = RECORD["types_only"][name]
    model = kquants.Model(**entry["model"])
    shapes = entry["shapes"]
    types, _ = kquants.tensor_types(list(shapes.items()), mix, model)
    import gguf

    got = {n: gguf.GGMLQuantizationType(types[n]).name if n in types else "kept" for n in shapes}
    want = {n: t if kquants.quantizable(n, shapes[n]) else "kept" for n, t in entry["mixes"][mix].items()}
    assert got == want


def test_sums_follow_cs_order():
    """_seqsum adds row after row as C's loop does (a pairwise sum gives other float32 bits)."""
    rng = np.random.default_rng(0)
    for shape in ((32, 4099), (32, 4096), (16, 7), (32, 2), (16, 3), (32, 17), (32, 1), (16, 1)):
        a = (rng.standard_normal(shape) * rng.standard_normal((shape[0], 1)) * 1e3).astype(np.float32)
        loop = a[0].copy()
        for row in a[1:]:
            loop += row
        assert np.array_equal(kquants._seqsum(a), loop)


def test_nearest_int_is_ggmls_trick_even_out_of_range():
    v = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 4194303.0, -4194303.0, 1e7, -1e7, np.inf, np.nan], dtype=np.float32)
    want = []
    for x in v:  # ggml: float val = x + 12582912.f; int i = bits(val); (i & 0x7fffff) - 0x400000
        bits = int(np.array([x + np.float32(12582912.0)], dtype=np.float32).view(np.int32)[0])
        want.append((bits & 0x7FFFFF) - 0x400000)
    assert kquants._nearest_int(v).tolist() == want
    assert want[:5] == [0, 2, 2, 0, -2]  # half to even


def test_fallbacks_are_said_and_the_cli_takes_the_types(folders, tmp_path, capsys):
    from tui_merger.cli import main

    events = []
    export_gguf(folders["llama"], "q4_k_m", tmp_path / "a.gguf", on_event=events.append)
    said = [e.message for e in events if isinstance(e, Notice)]
    assert any("2 tensor(s) have rows that are not a multiple of 256 values (blk.0.attn_output.weight" in s
               and "Q5_0" in s for s in said), said
    assert main(["gguf", str(folders["qwen3"]), "--type", "q6_k", "--out", str(tmp_path / "b.gguf"), "--plain"]) == 0
    assert "Q6_K" in capsys.readouterr().out
    assert tensors(tmp_path / "b.gguf")["token_embd.weight"][0] == "Q6_K"


def test_chunks_and_threads_change_nothing(monkeypatch):
    """The hard rows cut into chunks of one to a few super-blocks, on three threads: ggml's bytes still."""
    with np.load(FIXTURES / "blocks.npz") as made:
        rows, want = made["rows"].astype(np.float32), {k: made[k] for k in ("q4_k", "q6_k")}
    monkeypatch.setattr(kquants, "_COLUMNS", 24)  # 3 super-blocks of Q4_K, 1.5 -> 1 of Q6_K per step
    for name, t in (("q4_k", kquants.Q4_K), ("q6_k", kquants.Q6_K)):
        assert np.array_equal(kquants.quantize(rows, t, threads=3), want[name]), name


@pytest.mark.parametrize("shape, want", [((1, 512), False), ((1, 1, 512), False), ((2, 512), True),
                                         ((4, 1, 512), True), ((512,), False)])
def test_what_llama_quantize_counts_as_a_matrix(shape, want):
    """llama-quantize quantizes a weight when ggml_n_dims(tensor) >= 2, and ggml does not count outer
    dimensions of size 1: Qwen2-MoE's (1, hidden) shared-expert gate stays as it is (found by llama.cpp
    itself loading our file)."""
    assert kquants.quantizable("blk.0.ffn_gate_inp_shexp_x.weight", shape) is want


# -- numba's compiled loops (kquants_jit.py) against the same ggml-made blocks ----------------------------


def _hard_rows():
    with np.load(FIXTURES / "blocks.npz") as made:
        return made["rows"].astype(np.float32), {k: made[k] for k in ("q3_k", "q4_k", "q5_k", "q6_k")}


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("qtype", ["q3_k", "q4_k", "q5_k", "q6_k"])
def test_both_backends_give_ggmls_bytes(qtype, backend):
    """Each backend alone (not the mix of both that a first export uses while numba compiles)."""
    if backend == "numba":
        pytest.importorskip("numba")
    rows, want = _hard_rows()
    assert np.array_equal(kquants.quantize(rows, getattr(kquants, qtype.upper()), backend=backend), want[qtype])


@pytest.mark.parametrize("qtype", ["q4_k", "q5_k", "q6_k"])
def test_the_lanes_and_the_exact_loop_each_give_ggmls_bytes(qtype):
    """The vector path (many sub-blocks side by side) hands a group back to the one-block-at-a-time loop
    when a value rounds outside nearest_int's easy range; the hard rows take both roads, and each road
    alone gives ggml's bytes. On smooth random rows no group is handed back."""
    pytest.importorskip("numba")
    from tui_merger.core.ship import kquants_jit as J

    rows, want = _hard_rows()
    blocks, size = rows.reshape(-1, 256), kquants.K_TYPES[getattr(kquants, qtype.upper())]
    exact, lanes = np.zeros((len(blocks), size), np.uint8), np.zeros((len(blocks), size), np.uint8)
    getattr(J, qtype + "_exact")(blocks, exact)
    assert np.array_equal(exact, want[qtype].reshape(-1, size))
    assert getattr(J, qtype)(blocks, lanes) == 0  # ggml's hard rows stay in the easy range
    assert np.array_equal(lanes, want[qtype].reshape(-1, size))
    if qtype == "q6_k":
        return  # |iscale * x| <= 32.9 whenever the sub-block is not all zero: only inf or NaN input leaves it
    # a sub-block spanning one subnormal step: iscale is inf, the rounding leaves the easy range, and the
    # group is redone by the exact loop, which does what numpy's bits trick does
    odd = (np.random.default_rng(1).standard_normal((3 * J.G, 256)) * 0.02).astype(np.float32)
    odd[J.G + 1, 32:64] = np.where(np.arange(32) % 2, np.float32(1e-45), np.float32(0))
    out = np.zeros((len(odd), size), np.uint8)
    assert getattr(J, qtype)(odd, out) == 1
    assert np.array_equal(out, kquants.quantize(odd, getattr(kquants, qtype.upper()), backend="numpy"))
    smooth = (np.random.default_rng(0).standard_normal((4 * J.G, 256)) * 0.02).astype(np.float32)
    out = np.zeros((len(smooth), size), np.uint8)
    assert getattr(J, qtype)(smooth, out) == 0
    assert np.array_equal(out, kquants.quantize(smooth, getattr(kquants, qtype.upper()), backend="numpy"))


def test_without_numba_numpy_writes_the_same_bytes(monkeypatch):
    """numba not importable: the compile thread records why, and numpy writes ggml's bytes; asking for
    numba then is an error that says why."""
    import sys

    monkeypatch.setitem(sys.modules, "numba", None)  # import numba -> ImportError
    monkeypatch.delitem(sys.modules, "tui_merger.core.ship.kquants_jit", raising=False)
    monkeypatch.setattr(kquants, "jit_error", None)
    monkeypatch.setattr(kquants, "_jit_state", {})
    rows, want = _hard_rows()
    assert np.array_equal(kquants.quantize(rows, kquants.Q4_K), want["q4_k"])
    assert kquants.Q4_K not in kquants._jit_state  # 11k values: too few to start a compile
    monkeypatch.setattr(kquants, "_JIT_CALL_VALUES", 1)
    assert np.array_equal(kquants.quantize(rows, kquants.Q4_K), want["q4_k"])
    state = kquants._jit_state[kquants.Q4_K]  # the compile thread, or already what it left
    if hasattr(state, "join"):
        state.join()
    assert kquants._jit_state[kquants.Q4_K] is None and "numba" in kquants.jit_error
    assert np.array_equal(kquants.quantize(rows, kquants.Q4_K), want["q4_k"])
    from tui_merger.core.errors import MergeError

    with pytest.raises(MergeError, match=r"numba's k-quant loops were asked for .* not available \(.*numba.*\); install numba"):
        kquants.quantize(rows, kquants.Q4_K, backend="numba")


def test_a_mistyped_backend_is_refused_in_one_sentence(monkeypatch):
    from tui_merger.core.errors import MergeError

    monkeypatch.setenv("TUI_MERGER_KQUANTS", "numbaa")
    entry = RECORD["types_only"]["llama20"]
    with pytest.raises(MergeError, match=r"^TUI_MERGER_KQUANTS is 'numbaa', which is not a k-quant backend; .*numpy or numba"):
        kquants.tensor_types(list(entry["shapes"].items()), "q4_k_m", kquants.Model(**entry["model"]))
