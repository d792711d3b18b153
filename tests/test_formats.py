"""The formats seam: a kind added as one module and one registry line is found by inspect, offered by
the assistant and dispatched by --backend, with no other file touched."""

from __future__ import annotations

import sys
import types

import pytest

from tui_merger.core.errors import MergeError
from tui_merger.core.formats import registry
from tui_merger.core.formats.base import ALL, Candidate, Format, Found

TOY = '''
from pathlib import Path

from tui_merger.core.errors import MergeError
from tui_merger.core.formats.base import ALL, Candidate, Format, Found


class ToyFormat(Format):
    kind = "toy-run"
    role = "checkpoint"
    backend = "toy"
    label = "a toy checkpoint"
    short = "a toy one"

    def detect(self, s, folder, names):
        if "toy.json" not in names:
            return None
        c = Candidate(self.kind, str(folder))
        c.notes.append(str(s.json(folder / "toy.json")))
        return Found(c, ALL)

    def recognizes(self, path):
        return (Path(path) / "toy.json").is_file()

    def locate(self, path):
        raise MergeError("no toy checkpoint here")

    def needs_base(self, c):
        return False

    def next_step(self, c, path, base_arg, out):
        return f"tui-merger merge --backend toy {path} --out {out}"

    def open(self, options):
        raise NotImplementedError

    def reference(self, inputs, options, tmp):
        return None
'''


@pytest.fixture
def toy_kind(monkeypatch):
    module = types.ModuleType("tui_merger.core.formats.toy")
    exec(TOY, module.__dict__)  # a kind module, as a file in formats/ would hold it
    monkeypatch.setitem(sys.modules, module.__name__, module)
    entries = (registry.Entry("toy-run", "checkpoint", "toy", "ToyFormat", backend="toy"), *registry.ENTRIES)
    monkeypatch.setattr(registry, "ENTRIES", entries)
    registry.formats.cache_clear()
    yield
    registry.formats.cache_clear()


def test_a_new_kind_is_found_by_inspect_offered_and_dispatched(toy_kind, tmp_path):
    from tui_merger.core.formats.scan import scan
    from tui_merger.core.plan.choices import is_checkpoint, needs_base, why_not_mergeable

    run = tmp_path / "run"
    run.mkdir()
    (run / "toy.json").write_text('{"steps": 3}')
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8, "base_model_name_or_path": "x"}')
    found = {c.kind: c for c in scan(tmp_path).candidates}
    assert set(found) == {"toy-run", "peft-adapter"}  # the known kinds still found beside it
    toy = found["toy-run"]
    assert toy.notes == ["{'steps': 3}"] and "format" not in toy.to_dict()
    assert why_not_mergeable(toy) is None and not needs_base(toy) and is_checkpoint(toy)
    assert registry.checkpoint_format(run).kind == "toy-run"
    registry.check_backend(run, "toy")
    with pytest.raises(MergeError, match="is a toy checkpoint, not an FSDP one; use --backend toy"):
        registry.check_backend(run, "fsdp")


def test_backend_disagreement_is_one_sentence_for_the_known_kinds(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(MergeError) as err:
        registry.check_backend(empty, "megatron")
    assert "\n" not in str(err.value) and str(empty) in str(err.value)
    registry.check_backend(empty, "auto")  # auto decides when opening


def test_an_unknown_kind_cannot_be_merged_in_one_sentence():
    from tui_merger.core.plan.choices import why_not_mergeable

    assert why_not_mergeable(Candidate("gguf-file", "/x")) == "tui-merger cannot merge a gguf-file."


def test_the_registry_holds_every_kind_once_with_a_role():
    kinds = [f.kind for f in registry.formats()]
    assert len(kinds) == len(set(kinds)) >= 5
    assert {f.role for f in registry.formats()} == {"checkpoint", "adapter", "model"}
    assert registry.model_format().role == "model"
    assert all(isinstance(f, Format) for f in registry.formats())
    assert Found(Candidate("x", "/x")).owned is ALL
