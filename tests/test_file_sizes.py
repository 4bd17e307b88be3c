"""Every source file of the package stays under 500 lines (issue 27's rule: a file a contributor can read whole)."""
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "dare"
LIMIT = 500


def test_every_source_file_is_under_500_lines():
    long = {str(p.relative_to(SRC)): n for p in sorted(SRC.rglob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) >= LIMIT}
    assert not long, f"split these files (lines): {long}"
