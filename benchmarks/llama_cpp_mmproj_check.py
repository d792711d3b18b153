#!/usr/bin/env python
"""Does llama.cpp itself see an image as transformers does, through the mmproj file `tui-merger gguf` writes?
Not part of CI (llama.cpp must be built; a prebuilt wheel with libmtmd is in ../shared/tools).

    PYTHONPATH=$PWD /work/venvs/llama-sys/bin/python benchmarks/llama_cpp_mmproj_check.py [gemma3 gemma4 qwen2_vl ...] [--seed 0]
    (--control: write wrong files on purpose, Gemma 3's soft-embedding norm without + 1, Gemma 4's patch pixels in
    (3, p, p) order, Qwen's second patch frame as the first and Pixtral's q / k rows unpermuted: every row must FAIL; gemma4:clipped: Gemma 4 with its
    clipped linears' bounds set to +-0.3)

For a tiny random vision-language model of each tower (tests/test_gguf_mmproj.py's builder: one-layer towers, random
norms and biases, saved by transformers, with the released checkpoints' image mean/std) it writes the mmproj file with
tui-merger (``plan_mmproj`` + ``write_gguf``), loads it in llama.cpp's libmtmd (``mtmd_init_from_file`` with a text
GGUF of the same width: Gemma 3 and 4 the folder's own language model, exported by tui-merger; the Qwen towers a Qwen2 text
GGUF of the same width, as tui-merger does not write qwen2vl / qwen3vl language models on this branch: the image
encoder does not use the language model), gives it one random RGB image (``mtmd_bitmap_init``), tokenizes a prompt
with the media marker (``mtmd_tokenize``), encodes the image chunk (``mtmd_encode_chunk``) and reads the embeddings
(``mtmd_get_output_embd``). transformers gets the same pixels preprocessed as llama.cpp does for an image whose size
needs no resize (Gemma 3: image_size x image_size; Gemma 4: 27 x 27 patches; Qwen: a multiple of patch x merge inside
the pixel limits), i.e. (x / 255 - mean) / std in float32, laid out as the model's image processor lays it out (Qwen,
Gemma 4: its patch order), and
returns ``get_image_features``. Compared: the number of image tokens, and the embeddings' largest difference relative
to their largest value (limit 5e-3, Gemma 4 1e-2, as gguf_mmproj.CHECK_LIMITS: measured 5e-5 to 8e-4, Gemma 4 3e-3;
the --control files 2.8e-2 to 0.49).
Prints a Markdown table.
"""

from __future__ import annotations

import ctypes
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

LIMIT = 5e-3
LIMITS = {"gemma4": 1e-2, "gemma4:clipped": 1e-2}  # gguf_mmproj.CHECK_LIMITS: Gemma 4's llama.cpp differs by 3e-3 on tiny towers, wrong files by 4e-2
TOWERS = ("gemma3", "gemma4", "gemma4:clipped", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "mistral3", "llava")
SIZES = {"mistral3": (128, 128), "llava": (128, 128), "gemma3": (28, 28), "gemma4": (108, 108), "gemma4:clipped": (108, 108), "qwen2_vl": (112, 84), "qwen2_5_vl": (112, 112), "qwen3_vl": (96, 96)}  # (width, height)


def main(argv: list[str]) -> int:
    import numpy as np
    import torch

    seed = int(argv[argv.index("--seed") + 1]) if "--seed" in argv else 0
    if "--control" in argv:  # a wrong file must FAIL: Gemma 3's norm without its + 1, Qwen's two frames both frame 0
        from tui_merger.core.ship import gguf_mmproj

        gguf_mmproj._plus_one = lambda w: w
        gguf_mmproj._frame = lambda i: (lambda w: w[:, :, 0, ...])
        gguf_mmproj._hwc = lambda p: (lambda w: w.reshape(w.shape[0], 3, p, p))  # Gemma 4's patch pixels in C, p, p order
        import dataclasses  # Pixtral's q / k rows left in HF's order (no LlamaModel.permute)

        for key in ("mistral3", "llava"):
            gguf_mmproj.TOWERS[key] = dataclasses.replace(gguf_mmproj.TOWERS[key], permute_qk=False)
    names = [a for a in argv if a in TOWERS] or list(TOWERS)
    rows = []
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"mmproj-{name}-") as tmp:
            try:
                rows.append(check(name, Path(tmp), seed, np, torch))
            except Exception as err:  # a row that says why, the others still run
                rows.append((name, "no", "-", "-", f"{type(err).__name__}: {str(err)[:160]}", "-", "FAILED"))
    print("| tower | loads | image tokens llama.cpp / transformers | embeddings max rel. diff | note | tui-merger's check | result |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")
    return 0 if all(r[-1] == "PASSED" for r in rows) else 1


def check(name: str, tmp: Path, seed: int, np, torch):
    import json

    import transformers

    from test_gguf_families import make_family
    from test_gguf_mmproj import make_tower, randomize_zero_tensors
    from test_gguf_vl_text import make_vl
    from tui_merger.core.ship.gguf import export_gguf, write_gguf
    from tui_merger.core.ship.gguf_mmproj import plan_mmproj

    if name == "gemma3":
        folder = make_vl(tmp / name, "gemma3", seed=seed)
        randomize_zero_tensors(folder, seed)  # its input projection starts at zero
        (folder / "preprocessor_config.json").write_text(json.dumps({"image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
        (folder / "processor_config.json").write_text(json.dumps({"image_seq_length": 4}))
        text_gguf = export_gguf(folder, "f16", tmp / "text.gguf").path
    elif name in ("mistral3", "llava"):  # the folder's own language model (mistral3; Llava's llama), exported by tui-merger
        folder = make_tower(tmp / name, name, seed=seed)
        text_gguf = export_gguf(folder, "f16", tmp / "text.gguf").path
    elif name.startswith("gemma4"):  # with its audio tower (E2B / E4B), which the mmproj leaves out
        folder = make_tower(tmp / name, name, seed=seed)
        if name.endswith(":clipped"):  # the clipped linears' bounds made finite (transformers starts them at +-inf)
            from safetensors.torch import load_file, save_file

            state = load_file(folder / "model.safetensors")
            for key in state:
                if "vision_tower" in key and key.endswith(("_max", "_min")):
                    state[key] = torch.tensor(0.3 if key.endswith("_max") else -0.3, dtype=state[key].dtype)
            save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
        text_gguf = export_gguf(folder, "f16", tmp / "text.gguf").path
    else:
        folder = make_tower(tmp / name, name, seed=seed)
        # Qwen3-VL: llama.cpp's image embedding is the merger's output and each deepstack merger's side by side, and
        # it wants a text model that wide (qwen3vl's n_embd x (1 + deepstack layers)); a Qwen2 text model of that width
        config = json.loads((folder / "config.json").read_text())
        wide = config["text_config"]["hidden_size"] * (1 + len(config["vision_config"].get("deepstack_visual_indexes") or []))
        text = make_family(tmp / "text", "qwen2", seed=seed, hidden_size=wide, intermediate_size=2 * wide)
        text_gguf = export_gguf(text, "f16", tmp / "text.gguf").path
    mmproj = write_gguf(plan_mmproj(folder, tmp / "mmproj.gguf")).path
    width, height = SIZES[name]
    rng = np.random.default_rng(seed)
    rgb = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    got = llama_cpp_embeddings(text_gguf, mmproj, rgb)
    model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    want = transformers_embeddings(model, name, rgb, pre, np, torch)
    tokens = f"{got.shape[0]} / {want.shape[0]}"
    app = "-"
    if name in ("mistral3", "llava"):  # the in-app check (gguf_mmproj.check_mmproj: llama.cpp in a child process)
        from tui_merger.core.ship.gguf_mmproj import check_mmproj

        verdict = check_mmproj(folder, text_gguf, mmproj)
        app = f"{verdict.status} ({verdict.details.get('embeddings_rel', float('nan')):.1e})" if verdict.details else verdict.status
    if got.shape != want.shape:
        return (name, "yes", tokens, "-", f"shapes {tuple(got.shape)} vs {tuple(want.shape)}", app, "FAILED")
    rel = float(np.abs(got - want).max() / np.abs(want).max())
    return (name, "yes", tokens, f"{rel:.1e}", f"{width}x{height} image, {model.config.vision_config.model_type}", app,
            "PASSED" if rel <= LIMITS.get(name, LIMIT) else "FAILED")


def llama_cpp_embeddings(text_gguf: Path, mmproj: Path, rgb):
    """llama.cpp's embeddings of the image: (tokens, width) float32."""
    import numpy as np

    import llama_cpp
    import llama_cpp.mtmd_cpp as mtmd

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(str(text_gguf).encode(), params)
    if not model:
        raise RuntimeError("llama.cpp cannot load the text GGUF")
    ctx_params = mtmd.mtmd_context_params_default()
    ctx_params.use_gpu = False
    ctx_params.n_threads = 2
    ctx_params.print_timings = False
    ctx = mtmd.mtmd_init_from_file(str(mmproj).encode(), model, ctx_params)
    if not ctx:
        raise RuntimeError("llama.cpp's mtmd_init_from_file refuses the mmproj")
    try:
        height, width = rgb.shape[:2]
        data = (ctypes.c_uint8 * rgb.size).from_buffer_copy(np.ascontiguousarray(rgb).tobytes())
        bitmap = mtmd.mtmd_bitmap_init(width, height, data)
        chunks = mtmd.mtmd_input_chunks_init()
        prompt = b"look: " + mtmd.mtmd_default_marker() + b" done"
        text = mtmd.mtmd_input_text(prompt, len(prompt), True, True)
        bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
        rc = mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1)
        if rc != 0:
            raise RuntimeError(f"mtmd_tokenize returned {rc}")
        n_embd = llama_cpp.llama_model_n_embd(model)
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            if mtmd.mtmd_input_chunk_get_type(chunk) != 1:  # MTMD_INPUT_CHUNK_TYPE_IMAGE
                continue
            n = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
            if mtmd.mtmd_encode_chunk(ctx, chunk) != 0:
                raise RuntimeError("mtmd_encode_chunk failed")
            out = mtmd.mtmd_get_output_embd(ctx)
            return np.ctypeslib.as_array(out, shape=(n * n_embd,)).copy().reshape(n, n_embd)
        raise RuntimeError("llama.cpp made no image chunk")
    finally:
        mtmd.mtmd_free(ctx)
        llama_cpp.llama_model_free(model)


def transformers_embeddings(model, name: str, rgb, pre: dict, np, torch):
    """transformers' embeddings of the image, preprocessed as llama.cpp does (no resize at this size)."""
    mean = np.array(pre["image_mean"], dtype=np.float32)
    std = np.array(pre["image_std"], dtype=np.float32)
    x = ((rgb.astype(np.float32) / 255.0 - mean) / std).transpose(2, 0, 1)  # C, H, W
    inner = model.model
    with torch.no_grad():
        if name in ("mistral3", "llava"):  # PixtralImageProcessor's pixels and the image's size
            h, w = x.shape[1:]
            t = _tensor(inner.get_image_features(pixel_values=torch.from_numpy(x[None].copy()), image_sizes=torch.tensor([[h, w]])))
            unit = model.config.vision_config.patch_size * getattr(model.config, "spatial_merge_size", 1)
            return with_breaks(model, t.reshape(h // unit, w // unit, -1), np)
        if name == "gemma3":
            out = inner.get_image_features(torch.from_numpy(x[None].copy()))
            return _tensor(out).reshape(-1, _tensor(out).shape[-1]).numpy()
        if name.startswith("gemma4"):  # Gemma4ImageProcessor's patches (p, p, C order) and their (x, y) positions, no padding
            p = model.config.vision_config.patch_size
            c, h, w = x.shape
            patches = x.reshape(c, h // p, p, w // p, p).transpose(1, 3, 2, 4, 0).reshape((h // p) * (w // p), -1)
            gx, gy = np.meshgrid(np.arange(w // p), np.arange(h // p), indexing="xy")
            pos = np.stack([gx, gy], axis=-1).reshape(-1, 2)
            out = inner.get_image_features(torch.from_numpy(np.ascontiguousarray(patches))[None], torch.from_numpy(pos)[None])
            t = _tensor(out)
            return t.reshape(-1, t.shape[-1]).numpy()
        vc = model.config.vision_config
        patch, merge, temporal = vc.patch_size, vc.spatial_merge_size, vc.temporal_patch_size
        frames = np.repeat(x[None], temporal, axis=0)  # one image: the frame repeated (Qwen2VLImageProcessor)
        c, h, w = x.shape
        gh, gw = h // patch, w // patch
        p = frames.reshape(1, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
        p = p.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(gh * gw, c * temporal * patch * patch)
        grid = torch.tensor([[1, gh, gw]])
        out = inner.get_image_features(torch.from_numpy(np.ascontiguousarray(p)), grid)
        t = _tensor(out)
        deep = getattr(out, "deepstack_features", None)
        if deep:  # Qwen3-VL: each deepstack merger's output beside the merger's, as llama.cpp lays them out
            t = torch.cat([t] + [_tensor(list(d)) for d in deep], dim=-1)
        return t.reshape(-1, t.shape[-1]).numpy()


def with_breaks(model, grid, np):
    """Pixtral as llama.cpp lays it out: each row of image tokens but the last followed by the embedding of the
    tokenizer's [IMG_BREAK] token (the processor puts that token there; transformers' get_image_features has none)."""
    import json

    added = json.loads((Path(model.name_or_path) / "tokenizer.json").read_text())["added_tokens"]
    token = next(t["id"] for t in added if t["content"] == "[IMG_BREAK]")
    brk = model.get_input_embeddings().weight[token].detach().numpy()[None]
    rows = [grid[i].numpy() for i in range(grid.shape[0])]
    return np.concatenate([part for i, r in enumerate(rows) for part in ([r, brk] if i < len(rows) - 1 else [r])])


def _tensor(out):
    import torch

    if isinstance(out, torch.Tensor):
        return out
    pooled = getattr(out, "pooler_output", None)
    if pooled is not None:
        out = pooled
    if isinstance(out, (list, tuple)):
        return torch.cat([o if o.ndim > 1 else o[None] for o in out], dim=0)
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
