"""What a plan depends on: the units that ran, the module skeletons and files they read, fingerprinted so that an edit
that can change a plan is seen and one that cannot (a comment, a docstring, a moved line) is not."""
import textwrap

import pytest

from dare.plan import provenance
from dare.plan.provenance import Fingerprinter, ModuleFingerprints, decode_indices, encode_indices, load, recording, store

SOURCE = textwrap.dedent('''
    """Module docstring."""
    import math

    SCALE = 2


    def helper(x):
        """Docstring."""
        return x * SCALE  # a comment


    class Shape:
        kind = "box"

        @staticmethod
        def area(w, h):
            inner = lambda v: v + 1
            return [inner(w) * h for _ in range(1)][0]


    if True:
        def conditional():
            return 1
''')


def _fp(source):
    return ModuleFingerprints(textwrap.dedent(source))


def test_units_are_functions_and_methods_with_their_lines():
    fp = _fp(SOURCE)
    assert set(fp.units) == {"helper", "Shape.area", "conditional"}
    lines = SOURCE.splitlines()
    area = next(i + 1 for i, line in enumerate(lines) if "def area" in line)
    assert fp.unit_at(area) == "Shape.area" and fp.unit_at(area - 1) == "Shape.area"  # the decorator's line
    assert fp.unit_at(area + 1) == "Shape.area"  # the lambda inside belongs to the method
    assert fp.unit_at(next(i + 1 for i, line in enumerate(lines) if 'kind = "box"' in line)) is None  # class body


@pytest.mark.parametrize("edit,moves", [
    (lambda s: s.replace("# a comment", "# another comment"), set()),
    (lambda s: s.replace('"""Docstring."""', '"""Another docstring, longer."""'), set()),
    (lambda s: s.replace("import math\n", "import math\n\n\n\n"), set()),  # every line below moves
    (lambda s: s.replace("x * SCALE", "x * SCALE + 1"), {"helper"}),
    (lambda s: s.replace("v + 1", "v + 2"), {"Shape.area"}),  # a nested lambda is its method's
    (lambda s: s.replace("    @staticmethod\n", ""), {"Shape.area"}),  # decorators are the function's
    (lambda s: s.replace("SCALE = 2", "SCALE = 3"), {"skeleton"}),
    (lambda s: s.replace('kind = "box"', 'kind = "ball"'), {"skeleton"}),
    (lambda s: s.replace("return 1", "return 2"), {"conditional"}),
])
def test_fingerprints_move_with_what_can_change_a_result(edit, moves):
    before, after = _fp(SOURCE), _fp(edit(SOURCE))
    moved = {u for u in before.units if before.digest(u) != after.digest(u)}
    moved |= {"skeleton"} if before.skeleton != after.skeleton else set()
    assert moved == moves


def _traced_module(tmp_path, monkeypatch, source):
    """A throwaway module inside a fake ``dare`` root, so the recorder counts it as package code."""
    pkg = tmp_path / "dare"
    pkg.mkdir(exist_ok=True)
    (pkg / "probe_mod.py").write_text(textwrap.dedent(source))
    (pkg / "config.json").write_text('{"a": 1}')
    monkeypatch.setattr(provenance, "_package_roots", lambda: {"dare": tmp_path})
    import importlib.util
    spec = importlib.util.spec_from_file_location("probe_mod", pkg / "probe_mod.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, pkg


def test_recording_names_what_ran_and_what_was_read_and_a_change_is_seen(tmp_path, monkeypatch):
    mod, pkg = _traced_module(tmp_path, monkeypatch, SOURCE + textwrap.dedent('''
        def read_config(path):
            return open(path).read()


        def never_called():
            return 0
    '''))
    with recording() as rec:
        mod.helper(3)
        mod.Shape.area(2, 3)
        mod.read_config(pkg / "config.json")
    code = {k for k in rec if "::" in k}
    assert code == {"dare/probe_mod.py::helper", "dare/probe_mod.py::Shape.area",
                    "dare/probe_mod.py::read_config"}  # never_called and conditional did not run
    assert set(rec) - code == {"dare/probe_mod.py", "dare/config.json", "version:torch"}
    table, ranges = store({"plan": rec})
    stored = load(table, ranges["plan"])
    assert stored == rec
    assert Fingerprinter().changed(stored) == {}

    src = pkg / "probe_mod.py"
    src.write_text(src.read_text().replace("return 0", "return 1"))  # a unit the plan never ran
    assert Fingerprinter().changed(stored) == {}
    src.write_text(src.read_text().replace("x * SCALE", "x * SCALE * 2"))
    assert Fingerprinter().changed(stored) == {"dare/probe_mod.py::helper": "dare/probe_mod.py::helper changed"}
    (pkg / "config.json").write_text('{"a": 2}')
    assert Fingerprinter().changed(stored)["dare/config.json"] == "dare/config.json changed"
    src.write_text(src.read_text().replace("def read_config", "def load_config"))
    assert "dare/probe_mod.py::read_config is gone" in Fingerprinter().changed(stored).values()


def test_a_function_run_in_a_thread_started_while_recording_is_recorded(tmp_path, monkeypatch):
    import threading
    mod, _ = _traced_module(tmp_path, monkeypatch, SOURCE)
    with recording() as rec:
        worker = threading.Thread(target=mod.helper, args=(2,))
        worker.start()
        worker.join()
    assert "dare/probe_mod.py::helper" in rec and "dare/probe_mod.py::Shape.area" not in rec


def test_a_plan_made_under_another_torch_is_not_current():
    here = provenance._version("torch")
    assert Fingerprinter().changed({"version:torch": "0.0.1"}) == {
        "version:torch": f"torch 0.0.1 made the plan, this is torch {here}"}


def test_stored_records_share_one_table_and_keep_a_plan_made_before_a_change():
    a = {"dare/a.py::f": "1", "dare/a.py": "2", "version:torch": "2.13.0"}
    b = {"dare/a.py::f": "1", "dare/b.py::g": "3", "version:torch": "2.13.0"}
    c = {**b, "dare/a.py::f": "9"}  # made after f changed
    table, ranges = store({"a": a, "b": b, "c": c})
    assert table["keys"] == sorted([*set(a) | set(b), "dare/a.py::f"])  # f twice, each entry once
    assert {pid: load(table, r) for pid, r in ranges.items()} == {"a": a, "b": b, "c": c}


@pytest.mark.parametrize("indices", [[], [0], [0, 1, 2, 5, 7, 8, 9, 20], list(range(100)), [3, 1, 2, 1]])
def test_index_ranges_round_trip(indices):
    assert decode_indices(encode_indices(indices)) == sorted(set(indices))
    assert encode_indices([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_another_packages_code_is_compared_only_under_another_version():
    installed = provenance._version("transformers")
    record = {"version:transformers": installed, "transformers/not_a_module.py::f": "0"}
    assert Fingerprinter().changed(record) == {}  # a released version's files do not change: not read
    moved = Fingerprinter().changed({**record, "version:transformers": "0.0.1"})
    assert set(moved) == {"version:transformers", "transformers/not_a_module.py::f"}
    assert not any(provenance.is_own(k) for k in moved)
    assert provenance.is_own("dare/trainer/loop.py::Trainer.train_step") and provenance.is_own("no record")


# --- a module the plan only imported -----------------------------------------------------------------------------
BASE = textwrap.dedent('''
    class Base:
        def run(self, other):
            getattr(other, "looked_up", None)
            return self.hook()

        def hook(self):
            return 1


    def register(name):
        return lambda fn: fn
''')

OTHER = textwrap.dedent('''
    import json

    from probe_base import Base, register

    SIZE = 3


    class Encoder(json.JSONEncoder):  # another package's class: which of its methods ran is not recorded
        def _extra(self):
            return 0


    class Other(Base):
        kind = "other"

        def _private(self):
            return 0

        def hook(self):
            return 2


    @register("square")
    def square(x):
        return x * x
''')


def _import_probes(tmp_path, monkeypatch):
    """probe_base (its methods run) and probe_other (imported only) inside a fake ``dare`` root, imported while
    recording as a plan imports dare."""
    import importlib.util
    import sys
    pkg = tmp_path / "dare"
    mods = {}
    for name, source in (("probe_base", BASE), ("probe_other", OTHER)):
        (pkg / f"{name}.py").write_text(source)
        spec = importlib.util.spec_from_file_location(name, pkg / f"{name}.py")
        mods[name] = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, mods[name])
        spec.loader.exec_module(mods[name])
    mods["probe_base"].Base().run(object())
    return pkg


def _record(tmp_path, monkeypatch):
    (tmp_path / "dare").mkdir(exist_ok=True)
    monkeypatch.setattr(provenance, "_package_roots", lambda: {"dare": tmp_path})
    with recording() as rec:
        pkg = _import_probes(tmp_path, monkeypatch)
    return rec, pkg


def test_a_module_only_imported_is_narrowed_and_names_what_it_watches(tmp_path, monkeypatch):
    rec, _ = _record(tmp_path, monkeypatch)
    assert {"dare/probe_base.py", "dare/probe_base.py::Base.run", "dare/probe_base.py::Base.hook"} <= set(rec)
    (other,) = [k for k in rec if k.startswith("dare/probe_other.py")]
    rel, watched = provenance.parse_imported_key(other)
    assert rel == "dare/probe_other.py" and provenance.imported_key(rel, watched) == other
    # where a def here would change what ran: over Base's methods that ran and the class's attributes, over the names
    # the module imported or defines, over a name looked up by string; every def of a class with another package's base
    assert watched == {"": {"Base", "register", "Other", "Encoder"}, "?": {"looked_up"},
                       "Other": {"run", "hook", "kind"}, "Encoder": {"*"}}
    assert Fingerprinter().changed(rec) == {}


@pytest.mark.parametrize("edit,stale", [
    (lambda s: s.replace("return 0", "return 5"), False),  # a body: no function of the module ran
    (lambda s: s.replace("def _private", "def _renamed"), False),  # a helper added, one gone
    (lambda s: s.replace("    def hook(self):\n        return 2\n", ""), True),  # an override of what ran
    (lambda s: s.replace("return 2", "return 3"), False),  # its body did not run
    (lambda s: s.replace("def _private", "def run"), True),  # a new override of a method that ran
    (lambda s: s.replace("def _private", "def looked_up"), True),  # a name code that ran looks up by string
    (lambda s: s.replace("def _private", "def __post_init__"), True),  # run implicitly
    (lambda s: s.replace("def _private", "def kind"), True),  # overrides a class attribute
    (lambda s: s.replace("SIZE = 3", "SIZE = 4"), True),
    (lambda s: s.replace('kind = "other"', 'kind = "box"'), True),
    (lambda s: s.replace('"square"', '"cube"'), True),  # a registration
    (lambda s: s + "\n\n@register('cube')\ndef cube(x):\n    return x ** 3\n", True),
    (lambda s: s + "\n\ndef helper(x):\n    return x\n", False),
    (lambda s: s + "\n\ndef Base():\n    return None\n", True),  # shadows a class whose methods ran
    (lambda s: s.replace("def _extra", "def _other"), True),  # every def of a class with an untraced base
])
def test_an_imported_module_stales_a_plan_only_where_it_can_change_what_ran(tmp_path, monkeypatch, edit, stale):
    rec, pkg = _record(tmp_path, monkeypatch)
    src = pkg / "probe_other.py"
    src.write_text(edit(src.read_text()))
    changed = Fingerprinter().changed(rec)
    assert bool(changed) == stale, changed
    assert all(k.startswith("dare/probe_other.py#imported") for k in changed)


def test_a_stored_whole_skeleton_record_narrows_exactly_and_only_while_current(tmp_path, monkeypatch):
    """Plans stored before narrowing keep each imported module's whole skeleton; narrowing such a record (its modules
    as they were) gives the record a plan made now keeps, and narrowing twice changes nothing."""
    rec, pkg = _record(tmp_path, monkeypatch)
    narrow = provenance.narrow
    monkeypatch.setattr(provenance, "narrow", lambda record, *a, **k: record)
    with recording() as whole:
        _import_probes(tmp_path, monkeypatch)
    monkeypatch.setattr(provenance, "narrow", narrow)
    assert "dare/probe_other.py" in whole
    assert provenance.narrow(whole) == rec and provenance.narrow(rec) == rec
    src = pkg / "probe_other.py"
    src.write_text(src.read_text().replace("SIZE = 3", "SIZE = 4"))  # changed since: stays whole, and stale
    assert provenance.narrow(whole) == whole and "dare/probe_other.py" in Fingerprinter().changed(whole)
