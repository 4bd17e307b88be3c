"""The export is written beside and swapped in whole (dare/trainer/swap.py): a kill during a re-export leaves the
previous export loadable, and a reader never finds the folder without its weights."""
import shutil
import threading
import time

import pytest
import torch

import dare.models.checkpoint as checkpoint
from dare.models import load_model
from dare.trainer import swap
from dare.trainer.loop import Trainer
from dare.trainer.model_setup import export_pretrained
from tests.trainer.helpers import sft_recipe


def _folder(root, name, text):
    path = root / name
    path.mkdir()
    (path / "config.json").write_text(text)
    (path / "model.safetensors").write_text(text)
    return path


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_replace_puts_the_new_folder_in_place_and_leaves_nothing_beside_it(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(swap, "_exchange", lambda a, b: False)
    elif not swap._exchange(_folder(tmp_path, "x", "x"), _folder(tmp_path, "y", "y")):
        pytest.skip("no renameat2(RENAME_EXCHANGE) here")
    else:
        assert (tmp_path / "x" / "config.json").read_text() == "y"  # swapped
        for name in ("x", "y"):
            shutil.rmtree(tmp_path / name)
    out = tmp_path / "export"
    swap.replace(_folder(tmp_path, "a", "1"), out)
    assert (out / "config.json").read_text() == "1"
    (out / "stray.txt").write_text("from the old version")
    staged = swap.staging(out)
    (staged / "config.json").write_text("2")
    (staged / "model.safetensors").write_text("2")
    swap.replace(staged, out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert (out / "model.safetensors").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    (tmp_path / ".export.partial").mkdir()
    (tmp_path / ".export.partial" / "half.safetensors").write_text("a killed write")
    assert list(swap.staging(out).iterdir()) == []  # a leftover of a killed write is cleared first


def test_a_reader_never_finds_the_export_without_its_weights(tmp_path):
    out = tmp_path / "export"
    swap.replace(_folder(tmp_path, "first", "0"), out)
    misses, done = [], threading.Event()

    def read():
        while not done.is_set():
            if not ((out / "config.json").exists() and (out / "model.safetensors").exists()):
                misses.append(1)
            time.sleep(0)  # hand the GIL back: a spinning reader slowed the 200 swaps 20-fold (23 s in the tier)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(200):
            staged = swap.staging(out)
            (staged / "config.json").write_text(str(i))
            (staged / "model.safetensors").write_text(str(i))
            swap.replace(staged, out)
    finally:
        done.set()
        reader.join()
    assert misses == [] and (out / "config.json").read_text() == "199"


def test_a_failed_re_export_leaves_the_previous_export_loadable(tmp_path, monkeypatch):
    trainer = Trainer(sft_recipe(tmp_path, "train.export=true"))
    trainer.run()
    out = tmp_path / "export"
    before = load_model(out)
    ids = torch.randint(10, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = before(ids).logits
        for p in trainer.model.parameters():
            p.add_(0.5)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed while writing the weights")

    monkeypatch.setattr(checkpoint, "save_file", killed)
    with pytest.raises(KeyboardInterrupt):
        export_pretrained(trainer.model, trainer.tokenizer, out, trainer.env)
    with torch.no_grad():
        assert torch.equal(load_model(out)(ids).logits, expected)
    monkeypatch.undo()
    export_pretrained(trainer.model, trainer.tokenizer, out, trainer.env)
    with torch.no_grad():
        assert torch.allclose(load_model(out)(ids).logits, trainer.model(ids).logits, atol=1e-5)
    assert not (tmp_path / ".export.partial").exists()
