"""Real verl-style FSDP checkpoints for tests, written by torch.distributed itself.

Every checkpoint is produced the way verl's ``FSDPCheckpointManager.save_checkpoint`` produces one:
``world_size`` processes join a gloo process group (CPU), build a tiny Qwen2 model (or another of ``FAMILIES``:
VL, Qwen3.5, and MoE families with tests/moe_families.py's configs) with transformers
(``from_pretrained`` of a bf16 "hub" copy, loaded in fp32 as verl's actor does), optionally wrap it
with peft, shard it with FSDP1 (``FullyShardedDataParallel`` + device mesh) or FSDP2 (``fully_shard``
on a ``DeviceMesh``), take one real AdamW step, and then every rank ``torch.save``s

* ``model_world_size_{W}_rank_{R}.pt``: ``model.state_dict()`` (FSDP1 inside
  ``StateDictType.SHARDED_STATE_DICT``), i.e. DTensors (plain tensors for single-rank FSDP1),
* ``optim_world_size_{W}_rank_{R}.pt``: ``optimizer.state_dict()``,
* ``extra_state_world_size_{W}_rank_{R}.pt``: ``{"lr_scheduler": ..., "rng": {...}}``,

after which rank 0 writes ``huggingface/`` (config, generation config, tokenizer), ``fsdp_config.json``,
``lora_train_meta.json`` (LoRA), the dataloader state and ``latest_checkpointed_iteration.txt``.

Before the sharded save, the library's own gather (FSDP1 ``FULL_STATE_DICT`` / FSDP2
``get_model_state_dict(full_state_dict=True)``) is written as ``reference.safetensors`` into
``<run_dir>/_fsdp_factory_reference/step_{step}/`` (outside ``global_step_*`` so that nothing scanning
a checkpoint sees it), with ``reference_base/`` + ``reference_adapter/`` for LoRA runs.

Speed: the heavy imports (torch, transformers, peft) happen once per pytest session in a "zygote"
subprocess that then ``fork``s one process per rank for every checkpoint (a checkpoint takes about
1-3 s after the zygote's ~6 s start). Use it from tests like this::

    from fsdp_factory import cached_fsdp_checkpoint, make_cached

    @pytest.fixture(scope="session")
    def fsdp_checkpoint(tmp_path_factory):
        return make_cached(tmp_path_factory)          # fsdp_checkpoint(fsdp_version=1, world_size=4)

    def test_x(tmp_path_factory):
        info = cached_fsdp_checkpoint(tmp_path_factory, lora=True)   # generated once per session

Cached checkpoints are shared: treat them as read-only, or take a private copy with
``copy_fsdp_checkpoint(info, dest)`` before deleting or editing files.

Command line (for benchmarks / manual testing)::

    python tests/fsdp_factory.py OUT_DIR --fsdp-version 2 --world-size 4 --lora --step 5
"""

from __future__ import annotations

import functools
import json
import re
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# --------------------------------------------------------------------------------------------------
# Model / tokenizer constants
# --------------------------------------------------------------------------------------------------

QWEN_FSDP = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1001,  # odd on purpose: uneven torch.chunk splits (2 ranks: 501 + 500 rows)
    max_position_embeddings=128,
)
TOKENIZER_WORDS = 997  # BPE entries, then the specials below: the tokenizer has 1000 entries < 1001 rows
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PAD_ID, IM_START_ID, EOS_ID = TOKENIZER_WORDS, TOKENIZER_WORDS + 1, TOKENIZER_WORDS + 2
# A generation config with non-default sampling values: a merger must copy it, not rebuild it.
GENERATION_CONFIG = dict(
    bos_token_id=PAD_ID,
    eos_token_id=[EOS_ID, PAD_ID],
    pad_token_id=PAD_ID,
    do_sample=True,
    temperature=0.7,
    top_p=0.8,
    top_k=20,
    repetition_penalty=1.05,
)
LORA_R, LORA_ALPHA = 8, 16
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + ' ' + message['content'] + '<|im_end|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant ' }}{% endif %}"
)
# Persistent buffers registered with buffer=True (names without a peft prefix).
BUFFER_VECTOR = "model.norm.ema_scale"  # [8] float32
BUFFER_SCALAR = "model.layers.0.update_count"  # 0-d float32
SEED = 1234
REFERENCE_DIRNAME = "_fsdp_factory_reference"

_OPTION_DEFAULTS = dict(
    fsdp_version=2,
    world_size=2,
    hsdp=False,
    tied=False,
    critic=False,
    buffer=False,
    lora=False,
    shard_dim1=False,
    write_fsdp_config=True,
    sft_layout=False,
    sharded_tensor=False,
    step=5,
    family="qwen2",
)
FAMILIES = ("qwen2", "qwen2_5_vl", "qwen3_moe", "qwen3_5", "gpt_oss", "qwen3_5_moe") + (
    "mixtral", "qwen2_moe", "deepseek_v3", "glm4_moe", "olmoe", "qwen3_next", "deepseek_v2", "dots1", "ernie4_5_moe", "hunyuan_v1_moe", "flex_olmo", "minimax_m2", "granitemoe",
    "deepseek_v32", "glm_moe_dsa", "granitemoehybrid")
# text, vision-language, MoE, hybrid attention, packed experts, hybrid attention with MoE and a shared expert;
# then more MoE families verl trains through FSDP (HF models, generically), with tests/moe_families.py's
# tiny configs: Mixtral, Qwen2-MoE (shared expert with its gate), DeepSeek-V3 (MLA, a dense first layer,
# a router with a score-correction bias), GLM-4.5 (glm4_moe), OLMoE
MOE_FAMILIES = ("mixtral", "qwen2_moe", "deepseek_v3", "glm4_moe", "olmoe", "qwen3_next", "deepseek_v2", "dots1", "ernie4_5_moe", "hunyuan_v1_moe", "flex_olmo", "minimax_m2", "granitemoe",
    "deepseek_v32", "glm_moe_dsa", "granitemoehybrid")


def _normalise(opts: dict) -> dict:
    unknown = set(opts) - set(_OPTION_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown option(s): {sorted(unknown)}")
    o = {**_OPTION_DEFAULTS, **opts}
    for k in _OPTION_DEFAULTS:
        if k == "family":
            continue
        o[k] = int(o[k]) if k in ("fsdp_version", "world_size", "step") else bool(o[k])
    if o["family"] not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}")
    if o["critic"] and o["family"] != "qwen2":
        raise ValueError("critic=True is a Qwen2 token classification model")
    if o["fsdp_version"] not in (1, 2):
        raise ValueError("fsdp_version must be 1 or 2")
    if o["hsdp"]:
        if o["world_size"] not in (2, 4):
            raise ValueError("hsdp=True uses 4 ranks (mesh [[0,1],[2,3]])")
        o["world_size"] = 4
    if o["world_size"] not in (1, 2, 4):
        raise ValueError("world_size must be 1, 2 or 4")
    if o["shard_dim1"] and o["fsdp_version"] != 2:
        raise ValueError("shard_dim1 exists only for FSDP2 (fully_shard's shard_placement_fn)")
    if o["sharded_tensor"] and (o["fsdp_version"] != 1 or o["hsdp"]):
        raise ValueError("sharded_tensor=True means FSDP1 without a device mesh (no HSDP)")
    return o


def _layout(root: Path, o: dict) -> dict:
    root = Path(root).resolve()
    gdir = root / f"global_step_{o['step']}"
    if o["sft_layout"]:
        ckpt = gdir
    else:
        ckpt = gdir / ("critic" if o["critic"] else "actor")
    ref_dir = root / REFERENCE_DIRNAME / f"step_{o['step']}"
    return dict(run_dir=root, global_step_dir=gdir, checkpoint_dir=ckpt, reference_dir=ref_dir)


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def make_fsdp_checkpoint(
    root: Path,
    *,
    fsdp_version: int = 2,
    world_size: int = 2,
    hsdp: bool = False,
    tied: bool = False,
    critic: bool = False,
    buffer: bool = False,
    lora: bool = False,
    shard_dim1: bool = False,
    write_fsdp_config: bool = True,
    sft_layout: bool = False,
    sharded_tensor: bool = False,
    step: int = 5,
    family: str = "qwen2",
) -> dict:
    """Write one real verl FSDP checkpoint under ``root`` (the run dir) and return where things are.

    Keys of the returned dict: ``checkpoint_dir`` (actor/ or critic/, or global_step_N/ for
    ``sft_layout``), ``run_dir``, ``global_step_dir``, ``reference`` (reference.safetensors: the full fp32
    state dict under the checkpoint's own key names, tied weights present under both names),
    ``reference_dir``, ``hf_dir``, ``world_size``, ``fsdp_version``, ``step``, ``options``,
    ``model_files`` / ``optim_files`` / ``extra_files`` (rank order), ``mesh_shape``,
    ``mesh_dim_names``, ``architecture`` (the model class that was trained), ``config_architecture``
    (what huggingface/config.json names), ``key_prefix`` (``"base_model.model."`` for LoRA),
    ``buffers`` (names of persistent buffers), ``vocab_size`` (1001) / ``tokenizer_size`` (1000),
    ``local_shapes`` (per-rank JSON files: key -> local shard shape), ``lora_r`` / ``lora_alpha`` /
    ``reference_base`` (HF folder of the base weights) / ``reference_adapter`` (peft adapter folder)
    (LoRA only), ``seconds``.

    What verl itself does, and so does this: ``huggingface/config.json`` is the trained model's config
    (``"dtype": "float32"``, ``architectures`` ``["Qwen2ForCausalLM"]`` even for the critic, whose
    state dict has ``score.weight [1, 64]`` and ``score.bias [1]``); the critic gets no
    ``generation_config.json`` (verl writes one only for models that can generate). Loading a rank file
    with ``torch.load(..., weights_only=True)`` needs ``import torch.distributed.tensor`` first; the
    extra_state files hold numpy RNG state (not loadable with ``weights_only=True`` as they are).
    """
    opts = _normalise(
        dict(
            fsdp_version=fsdp_version,
            world_size=world_size,
            hsdp=hsdp,
            tied=tied,
            critic=critic,
            buffer=buffer,
            lora=lora,
            shard_dim1=shard_dim1,
            write_fsdp_config=write_fsdp_config,
            sft_layout=sft_layout,
            sharded_tensor=sharded_tensor,
            step=step,
            family=family,
        )
    )
    lay = _layout(root, opts)
    if lay["checkpoint_dir"].exists() and any(lay["checkpoint_dir"].glob("model_world_size_*")):
        raise FileExistsError(f"{lay['checkpoint_dir']} already holds a checkpoint")
    for d in (lay["checkpoint_dir"], lay["reference_dir"]):
        d.mkdir(parents=True, exist_ok=True)
    request = {"opts": opts, **{k: str(v) for k, v in lay.items()}}
    t0 = time.perf_counter()
    _zygote().run(request)
    info = json.loads((lay["reference_dir"] / "info.json").read_text())
    info["seconds"] = round(time.perf_counter() - t0, 2)
    return info


_CACHE: dict = {}
_CACHE_LOCK = threading.Lock()


def cached_fsdp_checkpoint(tmp_path_factory, **opts) -> dict:
    """``make_fsdp_checkpoint`` once per pytest session and option set (a fresh copy of the dict each call).

    The files are shared by every caller: do not modify them; use ``copy_fsdp_checkpoint`` first.
    """
    o = _normalise(opts)
    base = Path(tmp_path_factory.getbasetemp()).resolve()
    key = (str(base), tuple(sorted(o.items())))
    with _CACHE_LOCK:
        info = _CACHE.get(key)
        if info is None or not Path(info["reference"]).is_file():
            slug = "fsdp{fsdp_version}_w{world_size}".format(**o) + "".join(
                f"_{k}" for k in ("hsdp", "tied", "critic", "buffer", "lora", "shard_dim1", "sft_layout", "sharded_tensor") if o[k]
            )
            if not o["write_fsdp_config"]:
                slug += "_nocfg"
            if o["family"] != "qwen2":
                slug += "_" + o["family"]
            root = tmp_path_factory.mktemp(slug, numbered=True) / "run"
            info = make_fsdp_checkpoint(root, **o)
            _CACHE[key] = info
    return json.loads(json.dumps(info))


def make_cached(tmp_path_factory):
    """A callable ``fsdp_checkpoint(**opts) -> dict`` bound to this session's ``tmp_path_factory``."""
    return functools.partial(cached_fsdp_checkpoint, tmp_path_factory)


def copy_fsdp_checkpoint(info: dict, dest: Path) -> dict:
    """Copy a (cached) checkpoint's whole run dir to ``dest`` and return ``info`` with paths rewritten."""
    src = Path(info["run_dir"])
    dest = Path(dest).resolve()
    shutil.copytree(src, dest)

    def move(v):
        if isinstance(v, str) and (v == str(src) or v.startswith(str(src) + os.sep)):
            return str(dest) + v[len(str(src)) :]
        if isinstance(v, list):
            return [move(x) for x in v]
        return v

    return {k: move(v) for k, v in info.items()}


# --------------------------------------------------------------------------------------------------
# Zygote: imports torch & co once, forks one process per rank for every request
# --------------------------------------------------------------------------------------------------

_HEAVY_MODULES = [
    "numpy",
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.device_mesh",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp.wrap",
    "safetensors.torch",
    "tokenizers",
    "transformers",
    "transformers.models.qwen2.modeling_qwen2",
    "peft",
    "moe_families",
]
_TRANSFORMERS_NAMES = [
    "AutoConfig",
    "GenerationConfig",
    "PreTrainedTokenizerFast",
    "Qwen2Config",
    "Qwen2ForCausalLM",
    "Qwen2ForTokenClassification",
]
_TIMEOUT_S = float(os.environ.get("FSDP_FACTORY_TIMEOUT", "180"))


class _Zygote:
    def __init__(self):
        import subprocess

        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_VERBOSITY", "error")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        env["PYTHONUNBUFFERED"] = "1"
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            bufsize=1,
        )
        self.lock = threading.Lock()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, request: dict) -> None:
        import selectors

        with self.lock:
            try:
                self.proc.stdin.write(json.dumps(request) + "\n")
                self.proc.stdin.flush()
                with selectors.DefaultSelector() as sel:
                    sel.register(self.proc.stdout, selectors.EVENT_READ)
                    # the first request also waits for the zygote's imports
                    if not sel.select(timeout=_TIMEOUT_S + 120):
                        raise TimeoutError("fsdp_factory zygote did not answer")
                line = self.proc.stdout.readline()
            except BaseException:  # timeout, Ctrl-C, broken pipe: never reuse a zygote in an unknown state
                self.proc.kill()
                raise
        if not line:
            raise RuntimeError(f"fsdp_factory zygote died (exit code {self.proc.wait()})")
        reply = json.loads(line)
        if not reply["ok"]:
            raise RuntimeError("FSDP checkpoint generation failed:\n" + reply["error"])

    def close(self):
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except Exception:
            self.proc.kill()


_ZYGOTE: _Zygote | None = None
_ZYGOTE_LOCK = threading.Lock()


def _zygote() -> _Zygote:
    global _ZYGOTE
    with _ZYGOTE_LOCK:
        if _ZYGOTE is None or not _ZYGOTE.alive():
            _ZYGOTE = _Zygote()
            import atexit

            atexit.register(_ZYGOTE.close)
        return _ZYGOTE


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _zygote_main() -> None:
    """Runs in the zygote process: never touches torch itself (so that forking stays safe)."""
    import importlib
    import signal
    import traceback
    import warnings

    reply_fd = os.dup(1)
    os.dup2(2, 1)  # anything printed goes to stderr; replies go to the saved stdout
    reply = os.fdopen(reply_fd, "w", buffering=1)
    warnings.filterwarnings("ignore")
    for name in _HEAVY_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # pragma: no cover - optional (peft) or broken installs show up in the rank
            pass
    try:  # transformers imports lazily: resolve what the ranks use
        import transformers

        for attr in _TRANSFORMERS_NAMES:
            getattr(transformers, attr)
        transformers.utils.logging.disable_progress_bar()
    except Exception:  # pragma: no cover
        pass
    while True:
        line = sys.stdin.readline()
        if not line:
            break
        if not line.strip():
            continue
        request = json.loads(line)
        error = None
        for _attempt in range(3):
            error = _fork_ranks(request, signal, traceback)
            if error is None or "address already in use" not in error.lower():
                break
        reply.write(json.dumps({"ok": error is None, "error": error}) + "\n")
        reply.flush()


def _fork_ranks(request: dict, signal, traceback) -> str | None:
    world = request["opts"]["world_size"]
    request = {**request, "port": _free_port(), "pretrained": tempfile.mkdtemp(prefix="fsdp_factory_hub_")}
    errdir = Path(tempfile.mkdtemp(prefix="fsdp_factory_err_"))
    pids = []
    try:
        for rank in range(world):
            pid = os.fork()
            if pid == 0:  # child
                code = 1
                try:
                    _rank_main(rank, world, request)
                    code = 0
                except BaseException:
                    (errdir / f"rank_{rank}.txt").write_text(traceback.format_exc())
                finally:
                    try:
                        sys.stdout.flush()
                        sys.stderr.flush()
                    finally:
                        os._exit(code)
            pids.append(pid)
        deadline = time.monotonic() + _TIMEOUT_S
        codes: dict[int, int] = {}
        failed = False
        while len(codes) < len(pids):
            for pid in pids:
                if pid in codes:
                    continue
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
                    failed = failed or codes[pid] != 0
            if len(codes) < len(pids) and (failed or time.monotonic() > deadline):
                time.sleep(0.5 if failed else 0)  # let the failing rank's peers write their own error
                for pid in pids:
                    if pid not in codes:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                for pid in pids:
                    if pid not in codes:
                        codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                if not failed:
                    return f"timed out after {_TIMEOUT_S:.0f} s (FSDP_FACTORY_TIMEOUT)"
            time.sleep(0.02)
        if not any(codes.values()):
            return None
        msgs = [f"exit codes by rank: {[codes[p] for p in pids]}"]
        for f in sorted(errdir.glob("rank_*.txt")):
            msgs.append(f"--- {f.stem} ---\n{f.read_text()}")
        return "\n".join(msgs)
    finally:
        shutil.rmtree(errdir, ignore_errors=True)
        shutil.rmtree(request["pretrained"], ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# What every rank runs
# --------------------------------------------------------------------------------------------------


def _rank_main(rank: int, world: int, request: dict) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(request["port"]),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        _generate(rank, world, request)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _build_tokenizer():
    """A small byte-level BPE tokenizer shaped like Qwen2's (trained here, offline, deterministically):
    997 BPE entries, then <|endoftext|> 997, <|im_start|> 998, <|im_end|> 999; a chat template. It
    reloads with AutoTokenizer (Qwen2Tokenizer) and PreTrainedTokenizerFast alike."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(SEED)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    words = ["".join(rng.choice(letters[: rng.randint(6, 26)]) for _ in range(rng.randint(1, 9))) for _ in range(3000)]
    corpus = [" ".join(rng.choice(words) for _ in range(20)) for _ in range(400)]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_WORDS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator(corpus, trainer)
    assert backend.get_vocab_size() == TOKENIZER_WORDS, backend.get_vocab_size()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=QWEN_FSDP["max_position_embeddings"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _family_class(family: str, critic: bool = False):
    import transformers

    if critic:
        return transformers.Qwen2ForTokenClassification
    if family in MOE_FAMILIES:
        from moe_families import FAMILIES as TINY

        return getattr(transformers, TINY[family][0])
    return getattr(transformers, {"qwen2": "Qwen2ForCausalLM", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                                  "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM",
                                  "gpt_oss": "GptOssForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}[family])


def _family_config(family: str, tied: bool):
    import transformers

    ids = dict(tie_word_embeddings=tied, bos_token_id=None, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    if family == "qwen2":
        return transformers.Qwen2Config(**QWEN_FSDP, **ids)
    if family in MOE_FAMILIES:  # tests/moe_families.py's tiny config, with this tokenizer's vocabulary
        from moe_families import FAMILIES as TINY

        cls_name, kwargs = TINY[family]
        kwargs = {**kwargs, "vocab_size": QWEN_FSDP["vocab_size"], "max_position_embeddings": QWEN_FSDP["max_position_embeddings"],
                  **ids}
        return getattr(transformers, cls_name).config_class(**kwargs)
    if family == "qwen3_5":  # linear-attention layers, then a full-attention one
        return transformers.Qwen3_5TextConfig(**{**QWEN_FSDP, "num_hidden_layers": 2}, **ids, head_dim=16,
                                              linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
                                              linear_value_head_dim=16, full_attention_interval=2)
    if family == "qwen3_5_moe":  # Qwen3.5's layers with packed experts (split on saving) and a gated shared expert
        return transformers.Qwen3_5MoeTextConfig(**{**QWEN_FSDP, "num_hidden_layers": 2}, **ids, head_dim=16,
                                                 linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
                                                 linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"],
                                                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                 shared_expert_intermediate_size=32)
    if family == "gpt_oss":  # experts packed [experts, in, out] with biases, attention sinks
        return transformers.GptOssConfig(**{**QWEN_FSDP, "intermediate_size": 32}, **ids, head_dim=16,
                                         num_local_experts=4, num_experts_per_tok=2,
                                         layer_types=["sliding_attention", "full_attention"])
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**QWEN_FSDP, **ids, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32, decoder_sparse_step=1, norm_topk_prob=True)
    # the vision tokens lie above the tokenizer's entries, so random text never holds one
    vocab = QWEN_FSDP["vocab_size"] + 4
    return transformers.Qwen2_5_VLConfig(
        text_config=dict(QWEN_FSDP, vocab_size=vocab, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[1]),
        image_token_id=vocab - 4, video_token_id=vocab - 3, vision_start_token_id=vocab - 2, vision_end_token_id=vocab - 1,
        **ids,
    )


def _write_pretrained(path: Path, tied: bool, family: str = "qwen2") -> None:
    """The "hub model" verl starts from: bf16 weights, config, generation config, tokenizer."""
    import torch
    from transformers import GenerationConfig

    config = _family_config(family, tied)
    torch.manual_seed(SEED)
    model = _family_class(family)(config).to(torch.bfloat16)
    model.save_pretrained(path)
    GenerationConfig(**GENERATION_CONFIG).save_pretrained(path)
    _build_tokenizer().save_pretrained(path)


def _generate(rank: int, world: int, request: dict) -> None:
    import random
    import warnings

    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, GenerationConfig, PreTrainedTokenizerFast

    warnings.filterwarnings("ignore")
    o = request["opts"]
    ckpt_dir = Path(request["checkpoint_dir"])
    gdir = Path(request["global_step_dir"])
    run_dir = Path(request["run_dir"])
    ref_dir = Path(request["reference_dir"])
    pretrained = Path(request["pretrained"])
    fsdp_v, step = o["fsdp_version"], o["step"]

    # --- the hub model (rank 0), then every rank loads it the way verl's workers do
    if rank == 0:
        _write_pretrained(pretrained, o["tied"], o["family"])
    dist.barrier()

    tokenizer = PreTrainedTokenizerFast.from_pretrained(pretrained)
    config = AutoConfig.from_pretrained(pretrained)
    # verl: override_config_kwargs = bos/eos/pad ids of the tokenizer
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    if o["critic"]:
        config.num_labels = 1  # verl's critic: AutoModelForTokenClassification, num_labels = 1
    model_cls = _family_class(o["family"], o["critic"])
    torch.manual_seed(SEED + 1)  # the critic's score head is newly initialised
    model = model_cls.from_pretrained(pretrained, dtype=torch.float32, config=config)
    # verl saves the *model's* config (unwrap_model.config): transformers copied ours and set dtype=float32
    config = model.config

    buffers = []
    if o["buffer"]:
        model.get_submodule(BUFFER_VECTOR.rsplit(".", 1)[0]).register_buffer(
            BUFFER_VECTOR.rsplit(".", 1)[1], torch.linspace(0.5, 1.5, 8), persistent=True
        )
        model.get_submodule(BUFFER_SCALAR.rsplit(".", 1)[0]).register_buffer(
            BUFFER_SCALAR.rsplit(".", 1)[1], torch.tensor(7.0), persistent=True
        )
        buffers = [BUFFER_VECTOR, BUFFER_SCALAR]

    lora_config = None
    if o["lora"]:
        from peft import LoraConfig, TaskType, get_peft_model

        lora_config = dict(
            task_type=TaskType.TOKEN_CLS if o["critic"] else TaskType.CAUSAL_LM,
            r=LORA_R,
            lora_alpha=LORA_ALPHA,
            target_modules="all-linear",
            exclude_modules=None,
            bias="none",
            init_lora_weights=False,  # random A and B, so that the adapter visibly matters
        )
        torch.manual_seed(SEED + 2)
        model = get_peft_model(model, LoraConfig(**lora_config))
    prefix = "base_model.model." if o["lora"] else ""

    # every rank starts from rank 0's weights (verl: sync_module_states / fsdp2_load_full_state_dict)
    with torch.no_grad():
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)

    # --- device mesh, as verl's create_device_mesh
    if o["hsdp"]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ddp", "fsdp"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))

    if fsdp_v == 1:
        fsdp_model = _wrap_fsdp1(model, mesh, o)
    else:
        fsdp_model = _wrap_fsdp2(model, mesh, o)

    # --- one real optimisation step (data parallel: every rank its own batch)
    optimizer = torch.optim.AdamW(
        [p for p in fsdp_model.parameters() if p.requires_grad], lr=1e-3, betas=(0.9, 0.999), weight_decay=1e-2
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    gen = torch.Generator().manual_seed(SEED + 10 + rank)
    input_ids = torch.randint(0, TOKENIZER_WORDS, (2, 12), generator=gen)
    if o["critic"]:
        values = fsdp_model(input_ids=input_ids).logits.squeeze(-1)
        loss = (values - torch.randn(values.shape, generator=gen)).pow(2).mean()
    else:
        loss = fsdp_model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)

    # --- the reference: the library's own full gather, before the sharded save
    full = _full_state_dict(fsdp_model, fsdp_v)
    if rank == 0:
        _write_reference(full, ref_dir, model_cls, config, lora_config, o)

    # --- the sharded save, as FSDPCheckpointManager.save_checkpoint
    model_path = ckpt_dir / f"model_world_size_{world}_rank_{rank}.pt"
    optim_path = ckpt_dir / f"optim_world_size_{world}_rank_{rank}.pt"
    extra_path = ckpt_dir / f"extra_state_world_size_{world}_rank_{rank}.pt"
    with _sharded_ctx(fsdp_model, fsdp_v):
        model_sd = fsdp_model.state_dict()
        torch.save(model_sd, model_path)
        torch.save(optimizer.state_dict(), optim_path)
        extra = {
            "lr_scheduler": scheduler.state_dict(),
            "rng": {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()},
        }
        torch.save(extra, extra_path)
    local_shapes = {
        k: list((v.to_local() if hasattr(v, "to_local") else v).shape) for k, v in model_sd.items()
    }
    (ref_dir / f"local_shapes_rank_{rank}.json").write_text(json.dumps(local_shapes))
    dist.barrier()

    if rank == 0:
        hf_dir = ckpt_dir / "huggingface"
        hf_dir.mkdir(exist_ok=True)
        can_generate = model_cls.can_generate()
        if can_generate:  # verl: GenerationConfig.from_pretrained(name_or_path) when the model can generate
            GenerationConfig.from_pretrained(pretrained).save_pretrained(hf_dir)
        config.save_pretrained(hf_dir)
        tokenizer.save_pretrained(hf_dir)
        if o["write_fsdp_config"]:
            (ckpt_dir / "fsdp_config.json").write_text(json.dumps({"FSDP_version": fsdp_v, "world_size": world}, indent=4))
        if o["lora"]:
            meta = {"r": LORA_R, "lora_alpha": LORA_ALPHA, "task_type": "TOKEN_CLS" if o["critic"] else "CAUSAL_LM"}
            (ckpt_dir / "lora_train_meta.json").write_text(json.dumps(meta, indent=4))
        dl_state = {
            "_num_yielded": step,
            "_sampler_iter_yielded": step,
            "_iterator_finished": False,
            "_index_sampler_state": None,
            "_sampler_iter_state": {"samples_yielded": step * 2},
            "_shared_seed": None,
            "fetcher_state": None,
            "dataset_state": None,
        }
        if o["sft_layout"]:  # verl's CheckpointHandler: one data_{dp_rank}.pt per data-parallel rank
            for dp_rank in range(world):
                torch.save(dl_state, gdir / f"data_{dp_rank}.pt")
        else:
            torch.save(dl_state, gdir / "data.pt")
        tracker = run_dir / "latest_checkpointed_iteration.txt"
        tmp = run_dir / "latest_checkpointed_iteration.txt.tmp"
        tmp.write_text(str(step))
        os.replace(tmp, tracker)

        info = {
            "checkpoint_dir": str(ckpt_dir),
            "run_dir": str(run_dir),
            "global_step_dir": str(gdir),
            "reference": str(ref_dir / "reference.safetensors"),
            "reference_dir": str(ref_dir),
            "hf_dir": str(hf_dir),
            "world_size": world,
            "fsdp_version": fsdp_v,
            "step": step,
            "options": o,
            "model_files": [str(ckpt_dir / f"model_world_size_{world}_rank_{r}.pt") for r in range(world)],
            "optim_files": [str(ckpt_dir / f"optim_world_size_{world}_rank_{r}.pt") for r in range(world)],
            "extra_files": [str(ckpt_dir / f"extra_state_world_size_{world}_rank_{r}.pt") for r in range(world)],
            "mesh_shape": list(mesh.shape),
            "mesh_dim_names": list(mesh.mesh_dim_names),
            "architecture": model_cls.__name__,
            "config_architecture": (config.architectures or [None])[0],
            "key_prefix": prefix,
            "buffers": [prefix + b for b in buffers],
            "tied": o["tied"],
            "vocab_size": QWEN_FSDP["vocab_size"],
            "tokenizer_size": len(tokenizer),
            "local_shapes": [str(ref_dir / f"local_shapes_rank_{r}.json") for r in range(world)],
            "family": o["family"],
        }
        if not o["lora"] and not o["buffer"]:
            info["reference_hf"] = str(ref_dir / "reference_hf")
        if o["lora"]:
            info.update(
                lora_r=LORA_R,
                lora_alpha=LORA_ALPHA,
                reference_base=str(ref_dir / "reference_base"),
                reference_adapter=str(ref_dir / "reference_adapter"),
            )
        (ref_dir / "info.json").write_text(json.dumps(info, indent=2))


def _wrap_fsdp1(model, mesh, o):
    import functools as ft

    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import _or_policy, lambda_auto_wrap_policy, transformer_auto_wrap_policy

    # verl's get_fsdp_wrap_policy: decoder layers, plus (LoRA) every leaf module with a trainable weight
    policies = []
    if o["lora"]:

        def trainable_leaf(module):
            return bool(
                len(list(module.named_children())) == 0
                and getattr(module, "weight", None) is not None
                and module.weight.requires_grad
            )

        policies.append(ft.partial(lambda_auto_wrap_policy, lambda_fn=trainable_leaf))
    no_split = set(getattr(model, "_no_split_modules", None) or ["Qwen2DecoderLayer"])
    layers = {type(m) for m in model.modules() if type(m).__name__ in no_split}
    policies.append(ft.partial(transformer_auto_wrap_policy, transformer_layer_cls=layers))
    return FSDP(
        model,
        auto_wrap_policy=ft.partial(_or_policy, policies=policies),
        device_id=torch.device("cpu"),
        sharding_strategy=ShardingStrategy.HYBRID_SHARD if mesh.ndim == 2 else ShardingStrategy.FULL_SHARD,
        # verl runs bf16 compute (MixedPrecision); on CPU peft's LoRA layers then mix fp32 and bf16
        # inputs, so FSDP1 computes in fp32 here. The saved fp32 master weights are the same either way.
        mixed_precision=None,
        # verl passes sync_module_states=True; FSDP1 refuses it for CPU modules, and every rank already
        # holds rank 0's weights (broadcast above), so it would be a no-op here
        sync_module_states=False,
        # without a device mesh FSDP1's sharded state dict holds ShardedTensors instead of DTensors
        device_mesh=None if o["sharded_tensor"] else mesh,
        use_orig_params=False,
    )


def _wrap_fsdp2(model, mesh, o):
    import torch
    import torch.nn as nn
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    kwargs = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True),
        reshard_after_forward=True,
    )
    if o["shard_dim1"]:
        fsdp_size = mesh.shape[-1]

        def placement(param):  # verl's legacy get_shard_placement_fn: first dim divisible by the FSDP size
            for i, n in enumerate(param.shape):
                if n % fsdp_size == 0:
                    return Shard(i)
            return Shard(0)

        kwargs["shard_placement_fn"] = placement
    # verl's apply_fsdp2: decoder layers and (untied) embeddings first, then the root
    no_split = set(getattr(model, "_no_split_modules", None) or ["Qwen2DecoderLayer"])
    tied = model.config.tie_word_embeddings
    for module in [m for m in model.modules() if type(m).__name__ in no_split or (isinstance(m, nn.Embedding) and not tied)]:
        fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _sharded_ctx(fsdp_model, fsdp_v):
    import contextlib

    if fsdp_v != 1:
        return contextlib.nullcontext()
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType

    return FSDP.state_dict_type(
        fsdp_model,
        StateDictType.SHARDED_STATE_DICT,
        ShardedStateDictConfig(offload_to_cpu=False),
        ShardedOptimStateDictConfig(offload_to_cpu=False),
    )


def _full_state_dict(fsdp_model, fsdp_v) -> dict:
    if fsdp_v == 1:
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # offload_to_cpu=True (verl's choice) frees the unsharded storage of a CPU-resident FSDP1 model
        # (pytorch/pytorch#188989), so the gather stays "on device", which is the CPU here
        cfg = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
        with FSDP.state_dict_type(fsdp_model, StateDictType.FULL_STATE_DICT, cfg):
            return fsdp_model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(fsdp_model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _write_reference(full: dict, ref_dir: Path, model_cls, config, lora_config, o) -> None:
    import torch
    from safetensors.torch import save_file

    tensors = {k: v.detach().clone().contiguous() for k, v in full.items()}
    for v in tensors.values():
        assert not hasattr(v, "to_local") and v.dtype == torch.float32, type(v)
    save_file(tensors, str(ref_dir / "reference.safetensors"), metadata={"format": "pt"})
    if lora_config is None:
        if o["buffer"]:
            return  # the extra buffers are not part of the model class: no save_pretrained reference
        # what save_pretrained writes for the trained model (on-disk names, experts one by one)
        model = model_cls(config)
        model.load_state_dict(tensors, strict=True)
        model.save_pretrained(ref_dir / "reference_hf")
        return
    from peft import LoraConfig, get_peft_model

    base_sd = {}
    for k, v in tensors.items():
        if ".lora_" in k:
            continue
        # nested wrappers (peft's parameter LoRA on experts: experts.base_layer.base_layer.gate_up_proj) too
        base_sd[re.sub(r"\.base_layer(?=\.)", "", k.removeprefix("base_model.model."))] = v
    base = model_cls(config)
    for name in (BUFFER_VECTOR, BUFFER_SCALAR) if o["buffer"] else ():
        mod, attr = name.rsplit(".", 1)
        base.get_submodule(mod).register_buffer(attr, torch.zeros_like(base_sd[name]), persistent=True)
    base.load_state_dict(base_sd, strict=True)
    base.save_pretrained(ref_dir / "reference_base")
    peft_model = get_peft_model(model_cls(config), LoraConfig(**lora_config))
    if o["buffer"]:
        for name in (BUFFER_VECTOR, BUFFER_SCALAR):
            mod, attr = name.rsplit(".", 1)
            peft_model.base_model.model.get_submodule(mod).register_buffer(attr, torch.zeros(base_sd[name].shape), persistent=True)
    peft_model.load_state_dict(tensors, strict=True)
    peft_model.peft_config["default"].base_model_name_or_path = str(ref_dir / "reference_base")
    peft_model.save_pretrained(ref_dir / "reference_adapter")


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def _cli(argv=None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="Write a real verl FSDP checkpoint (tiny Qwen2, or --family) into RUN_DIR.")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--fsdp-version", type=int, default=2, choices=(1, 2))
    p.add_argument("--world-size", type=int, default=2, choices=(1, 2, 4))
    p.add_argument("--step", type=int, default=5)
    p.add_argument("--family", default="qwen2", choices=FAMILIES)
    for flag in ("hsdp", "tied", "critic", "buffer", "lora", "shard-dim1", "sft-layout"):
        p.add_argument(f"--{flag}", action="store_true")
    p.add_argument("--no-fsdp-config", action="store_true", help="omit fsdp_config.json (verl < 0.4.1)")
    a = p.parse_args(argv)
    info = make_fsdp_checkpoint(
        a.run_dir,
        fsdp_version=a.fsdp_version,
        world_size=a.world_size,
        hsdp=a.hsdp,
        tied=a.tied,
        critic=a.critic,
        buffer=a.buffer,
        lora=a.lora,
        shard_dim1=a.shard_dim1,
        write_fsdp_config=not a.no_fsdp_config,
        sft_layout=a.sft_layout,
        step=a.step,
        family=a.family,
    )
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    if sys.argv[1:] == ["--zygote"]:
        _zygote_main()
    else:
        _cli()
