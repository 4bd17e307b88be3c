"""scripts/generate.py: every generated artifact on disk is what the one command renders from its source, and its
check names a stale file and the command."""
import subprocess
import sys
from pathlib import Path

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


def test_every_generated_artifact_is_up_to_date():
    """A fresh process, so only the package's own algorithms are registered (tests register doubles)."""
    r = subprocess.run([sys.executable, "scripts/generate.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"generated artifacts are stale: run `python scripts/generate.py`\n{r.stdout}{r.stderr}"


def test_check_names_each_stale_file_and_writing_fixes_it(tmp_path):
    gen = load_script("scripts/generate.py")
    fresh, stale, gone = tmp_path / "fresh.md", tmp_path / "stale.md", tmp_path / "gone.yaml"
    fresh.write_text("same\n")
    stale.write_text("before <!-- a -->\nold\n<!-- b --> after\n")
    gone.write_text("x: 1\n")
    body = gen.replace_between(stale.read_text(), ("<!-- a -->", "<!-- b -->"), "new", "stale.md")
    assert body == "before <!-- a -->\nnew\n<!-- b --> after\n"
    fake = {"fake": lambda: {fresh: "same\n", stale: body, gone: None}}
    changes = gen.stale(fake)
    assert [(name, path) for name, path, _ in changes] == [("fake", stale), ("fake", gone)]
    gen.write(changes)
    assert stale.read_text() == body and not gone.exists() and gen.stale(fake) == []
    try:
        gen.replace_between("no markers", ("<!-- a -->", "<!-- b -->"), "x", "doc.md")
    except ValueError as e:
        assert "doc.md" in str(e) and "<!-- a -->" in str(e)
    else:
        raise AssertionError("a file without the markers must be an error naming it")


def test_check_output_names_the_artifact_and_the_command(monkeypatch, tmp_path, capsys):
    gen = load_script("scripts/generate.py")
    doc = tmp_path / "doc.md"
    doc.write_text("old\n")
    monkeypatch.setattr(gen, "ARTIFACTS", {"fake": lambda: {doc: "new\n"}})
    assert gen.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert f"{doc}: stale (fake)" in out and "python scripts/generate.py" in out
    assert doc.read_text() == "old\n"  # --check writes nothing
    assert gen.main([]) == 0 and doc.read_text() == "new\n" and gen.main(["--check"]) == 0
