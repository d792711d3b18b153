"""--keep-quantization on an MXFP4 base (GPT-OSS as released: experts in MXFP4, attention bf16): experts
the adapter does not touch are copied byte for byte, changed ones are quantized again as transformers'
quantize path does (triton_kernels' downcast_to_mxfp with its default ROUND_UP scales, e2m1 ties to
even), checked here against transformers' own MXFP4 dequantization and a brute-force search of the 16
codes; the kept output, loaded with Mxfp4Config(dequantize=True), answers like the unmerged adapter
within MXFP4's rounding; a corrupted output fails verification."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from factory import read_output, verification_checks
from safetensors.torch import load_file, save_file
from test_released_quantized import PROBE, _dequantized_load, gpt_oss_mxfp4  # noqa: F401 - the fixture
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from tui_merger.cli import main
from tui_merger.core.merge.requant_mxfp4 import quantize_mxfp4

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _nearest_by_search(w):
    """The rule, spelled out independently: per group of 32 along ``in`` of [experts, in, out], the scale
    is the power of two at or above amax / 6 (math.frexp, no bit tricks), each value the one of the 16
    codes times the scale nearest to it, a tie going to the even code (mantissa bit clear). Returns the
    dequantized values, [experts, in, out] fp32."""
    experts, cols, rows = w.shape
    x = w.float().transpose(1, 2).reshape(experts, rows, cols // 32, 32)

    def exponent(amax: float) -> int:
        if amax == 0:
            return -127
        mantissa, e = math.frexp(amax / 6)  # amax / 6 = mantissa * 2**e, mantissa in [0.5, 1)
        return max(e - 1 if mantissa == 0.5 else e, -126)

    k = torch.tensor([exponent(a) for a in x.abs().amax(-1).flatten().tolist()], dtype=torch.float32)
    scale = torch.exp2(k).reshape(experts, rows, cols // 32, 1)
    candidates = (E2M1 * scale)[..., None, :]  # [experts, rows, groups, 1, 16]
    distance = (x[..., None] - candidates).abs()
    tied = distance == distance.min(-1, keepdim=True).values
    even = torch.arange(16) % 2 == 0
    choice = (tied.int() * 2 + (tied & even).int()).argmax(-1)  # a nearest code, the even one of a tie
    values = E2M1[choice] * scale
    return values.reshape(experts, rows, cols).transpose(1, 2)


def test_quantize_mxfp4_gives_the_nearest_value_under_round_up_scales():
    torch.manual_seed(0)
    w = (torch.randn(3, 128, 40) * torch.logspace(-3, 1, 40)).to(torch.bfloat16)
    w[0, :32, 0] = 0  # a group of zeros: byte 0, codes 0
    w[1, :32, 1] = -1e-30  # a tiny group: its own small scale
    w[1, 32:64, 1] = -0.0
    # the ties (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4) under scale 1, and
    # amax exactly 6 (no rounding up); a small negative value rounds to -0 (code 8)
    w[2, :32, 2] = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -5, 5.5, 4.5, 2.75, 0.1, -0.1] * 2)
    w[2, 32:64, 2] = 6.25  # just above 6 * 2**0: scale 2, every value 3 * 2
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (3, 40, 4, 16) and scales.shape == (3, 40, 4)
    assert blocks.dtype == scales.dtype == torch.uint8
    got = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # transformers' dequantizing load
    assert torch.equal(got, _nearest_by_search(w))
    assert scales[0, 0, 0] == 0 and not blocks[0, 0, 0].any()
    assert scales[2, 2, 0] == 127 and scales[2, 2, 1] == 128
    want = torch.tensor([6, 0, 1, 1, 2, 2, 4, 4, -0.0, -1, -4, 6, 4, 3, 0, -0.0])
    assert torch.equal(got[2, :16, 2], want)
    codes = torch.stack([blocks[2, 2, 0] & 0x0F, blocks[2, 2, 0] >> 4], -1).flatten()
    assert codes[15].item() == 8 and codes[14].item() == 0  # -0.1 keeps its sign, as triton_kernels does
    assert torch.all(blocks[1, 1, 1] == 0x88)  # -0.0 stays -0.0


def test_values_on_the_mxfp4_grid_come_back_unchanged():
    torch.manual_seed(1)
    w = torch.randn(2, 64, 8).to(torch.bfloat16)
    once = convert_moe_packed_tensors(*quantize_mxfp4(w), dtype=torch.bfloat16)
    twice = convert_moe_packed_tensors(*quantize_mxfp4(once), dtype=torch.bfloat16)
    assert torch.equal(once, twice)


def _expert_adapter(base, folder):
    """LoRA on q_proj and on every expert's gate_up_proj (peft target_parameters); down_proj untouched."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False,
                      target_parameters=["mlp.experts.gate_up_proj"])
    get_peft_model(_dequantized_load(base, "mxfp4"), lora).save_pretrained(folder)
    return folder


def _logits(folder, adapter=None):
    from peft import PeftModel

    model = _dequantized_load(folder, "mxfp4").float()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        return model(PROBE).logits


@pytest.fixture(scope="module")
def kept(gpt_oss_mxfp4, tmp_path_factory):
    """(base, adapter, plain output, kept output, what the kept merge printed)."""
    base, _ = gpt_oss_mxfp4
    root = tmp_path_factory.mktemp("keep_mxfp4")
    adapter = _expert_adapter(base, root / "adapter")
    plain, kept = root / "plain", root / "kept"
    args = ["merge", "--base", str(base), "--adapter", str(adapter), "--plain"]
    assert main([*args, "--out", str(plain), "--no-verify"]) == 0
    assert main([*args, "--out", str(kept), "--keep-quantization"]) == 0
    return base, adapter, plain, kept


def test_dry_run_names_the_kept_mxfp4_output(gpt_oss_mxfp4, kept, tmp_path, capsys):
    base, adapter, _, _ = kept
    assert main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(tmp_path / "o"),
                 "--keep-quantization", "--dry-run"]) == 0
    plan = capsys.readouterr().out
    assert ("output is  MXFP4 (e2m1, a power-of-two scale per 32 values) as the base: 2 weights copied with their "
            "scales, 2 changed by the adapter quantized again; quantization_config kept") in plan, plan
    assert ("MXFP4 keeps one mantissa bit, so a change to an expert smaller than half a step of its group's grid is "
            "rounded away") in " ".join(plan.split()), plan


def test_keep_quantization_on_mxfp4_copies_untouched_experts_and_quantizes_changed_ones_again(kept):
    base, adapter, plain, out = kept
    base_config = json.loads((base / "config.json").read_text())
    assert json.loads((out / "config.json").read_text())["quantization_config"] == base_config["quantization_config"]
    stored, got, bf16 = read_output(base), read_output(out), read_output(plain)
    assert sorted(got) == sorted(stored)
    for name, value in stored.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
    changed = {n for n in stored if n.endswith(("gate_up_proj_blocks", "gate_up_proj_scales", "q_proj.weight"))}
    assert len(changed) == 4 + 2  # blocks and scales of both layers, q_proj's weight of both
    for name in set(stored) - changed:  # down_proj's blocks and scales, attention, router, embeddings: as stored
        assert torch.equal(got[name].view(torch.uint8), stored[name].view(torch.uint8)), name
    for i in (0, 1):
        name = f"model.layers.{i}.mlp.experts.gate_up_proj"
        blocks, scales = quantize_mxfp4(bf16[name])  # the bf16 merge, quantized
        assert torch.equal(got[name + "_blocks"], blocks) and torch.equal(got[name + "_scales"], scales), name
        assert not torch.equal(got[name + "_blocks"], stored[name + "_blocks"]), name  # the adapter moved it
        dequantized = convert_moe_packed_tensors(got[name + "_blocks"], got[name + "_scales"], dtype=torch.float32)
        assert torch.equal(dequantized, _nearest_by_search(bf16[name])), name
        q = f"model.layers.{i}.self_attn.q_proj.weight"
        assert torch.equal(got[q], bf16[q]), q  # bf16 in the release, merged as the plain output
    assert verification_checks(out) == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}


def test_the_kept_mxfp4_output_answers_like_the_unmerged_adapter_within_mxfp4_rounding(kept):
    """Loaded with Mxfp4Config(dequantize=True), the kept output's logits are within e2m1's rounding (1
    mantissa bit: 2**-2 relatively) of the unmerged adapter on transformers' dequantized base, and far
    closer to it than the base without the adapter; the behaviour check says how far apart, against the
    MXFP4 limit."""
    base, adapter, plain, out = kept
    want = _logits(base, adapter)
    got = _logits(out)
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(plain).float()
    with torch.no_grad():
        plain_logits = bf16(PROBE).logits
    gap, plain_gap, effect = ((x - want).norm().item() / want.norm().item() for x in (got, plain_logits, _logits(base)))
    # measured: kept 0.127, the bf16 output 0.0019, the base without the adapter 0.907: re-quantizing the
    # two changed expert projections moves the logits of this tiny model by 13%
    assert gap < 2.0**-2 and gap < 0.25 * effect, (gap, effect)
    assert plain_gap < gap
    manifest = json.loads((out / "merge_manifest.json").read_text())
    check = next(c for c in manifest["verification"]["checks"] if c["name"] == "behaviour")
    assert check["status"] == "pass" and check["metrics"]["dtype"] == "mxfp4", check
    assert check["metrics"]["output_limit"] == pytest.approx(8 * 2.0**-2 * math.sqrt(2))  # 2 bf16 q_proj merged
    assert "logits" in check["summary"] and f"{check['metrics']['output_rel_diff']:.2e} apart" in check["summary"]


def _broken_copy(out, tmp_path, name, steps):
    """A copy of the kept output with every scale of ``name`` ``steps`` powers of two larger."""
    import shutil

    broken = tmp_path / f"broken-{steps}"
    shutil.copytree(out, broken)
    path = next(broken.glob("*.safetensors"))
    tensors = load_file(str(path))
    tensors[name] = tensors[name] + steps
    save_file(tensors, str(path), metadata={"format": "pt"})
    return broken


@pytest.mark.parametrize("steps,behaviour", [(1, "pass"), (2, "fail")])
def test_a_kept_mxfp4_output_with_a_wrong_scale_fails_verification(kept, tmp_path, capsys, steps, behaviour):
    """A scale one power of two off is within what MXFP4's rounding explains for the behaviour check
    (the scale of a group moves its values by up to 2x, rounding by up to 2**-2 of its norm); the
    recompute check finds it, bit for bit. Four times too large shows in the layer's output as well."""
    _, _, _, out = kept
    name = "model.layers.0.mlp.experts.gate_up_proj_scales"
    broken = _broken_copy(out, tmp_path, name, steps)
    code = main(["verify", str(broken)])
    said = capsys.readouterr().out
    assert code != 0
    assert f"{name}: differs from the merged weight quantized again" in said, said
    checks = verification_checks(broken)
    assert checks["recompute"] == "fail" and checks["behaviour"] == behaviour, said
    if behaviour == "fail":
        assert "layer 0's output differs from the unmerged model" in said, said


def test_an_adapter_on_the_attention_only_keeps_every_expert_as_released(gpt_oss_mxfp4, tmp_path, capsys):
    base, adapter = gpt_oss_mxfp4  # LoRA on q, k, v and o_proj: bf16 in the release
    out = tmp_path / "kept"
    code = main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--plain", "--keep-quantization"])
    said = capsys.readouterr()
    assert code == 0, said.out + said.err
    stored, got = read_output(base), read_output(out)
    assert sorted(got) == sorted(stored)
    experts = [n for n in stored if n.endswith(("_blocks", "_scales"))]
    assert len(experts) == 8
    for name in experts:
        assert torch.equal(got[name], stored[name]), name
    assert verification_checks(out) == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}


def test_a_merged_expert_holding_nan_is_refused_in_one_sentence():
    from tui_merger.core.errors import MergeError

    w = torch.ones(1, 32, 2, dtype=torch.bfloat16)
    w[0, 3, 1] = float("nan")
    with pytest.raises(MergeError, match=r"^The merged model.layers.0.mlp.experts.down_proj holds NaN or Inf values, "
                                         r"which MXFP4 cannot store"):
        quantize_mxfp4(w, "model.layers.0.mlp.experts.down_proj")
