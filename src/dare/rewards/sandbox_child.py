"""The code that runs *inside* the sandbox: ``python -I -S -c <this file's source> ROLE ARGS...``.

It is an ordinary module too (the parent imports the wire codec from it, and tests exercise it), but it must stay
runnable by a bare interpreter: standard library only, Python 3.8+ (a dropped uid may get the system python3).

Stdin starts with one line: the view to build under ``unshare`` (``sandbox_mounts.enter_view``, whose source is
prepended to this one) or ``null``; the role's own input follows. Roles (limits are ``mem cpu fsize nofile
extra_procs``):

``run``        ``token_fd LIMITS program``: run one program; its own file holds everything (``run_python``).
``candidate``  ``req_fd resp_fd LIMITS program``: run the model's program (prefix + extracted code, *no tests*),
               then serve calls into it: every request and every answer is a frame of data (see below).
``judge``      ``token_fd req_fd resp_fd LIMITS``; stdin: the token line, then the JSON spec ``{prefix, tests,
               entry_point}``. Runs trusted code only: the task's prefix and tests. A name the tests read is their
               own, a builtin, a standard-library module (imported here), or the candidate's function or class,
               bound to a proxy that calls across the boundary and gets data back; never a candidate value.

Wire format: a frame is a 4-byte big-endian length and a JSON document; values are tagged trees (``encode_value``)
that ``decode_value`` turns into *fresh* objects of exact builtin (and a few standard-library value) types. A value
of any other type stays in the candidate and crosses as a handle, which the judge can only pass back, iterate,
measure, print, test for truth, read attributes or items of, or call (a handle returned by a call; never one reached
through an attribute or item, such as a method), each answer again as data. An exception the candidate raises comes
back as the builtin of its name (a StopIteration as a RuntimeError: it must not end the judge's loops). Nothing the
candidate sends can run code in the judge, and nothing in the judge (its token, its files, its memory) is reachable
from the candidate's process.
"""
import json
import os
import sys

if __name__ != "__main__":  # imported as a module; as the bootstrap, the prepended sources define these
    from .sandbox_mounts import enter_view
    from .sandbox_wire import MAX_FRAME, WireError, decode_value, encode_value, recv_frame, send_frame  # noqa: F401


# ------------------------------------------------------------------------------------------------ roles
def _set_limits(mem, cpu, fsize, nofile, extra):
    import resource
    uid, running = os.getuid(), 0 if os.path.isdir("/proc/self") else 1  # a sandbox without /proc: this process
    for name in os.listdir("/proc") if running == 0 else ():
        if name.isdigit():
            try:
                running += os.stat("/proc/" + name).st_uid == uid
            except OSError:
                pass
    # No POSIX message queues (RLIMIT_MSGQUEUE 0): they would outlive the sample in the fallback's IPC namespace.
    for res, value in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, fsize),
                       (resource.RLIMIT_NOFILE, nofile), (resource.RLIMIT_NPROC, running + extra),
                       (resource.RLIMIT_CORE, 0), (resource.RLIMIT_MSGQUEUE, 0)):
        resource.setrlimit(res, (value, value))


def _fresh_main(path):
    """A new ``__main__`` module for the program (our own functions stay out of its globals)."""
    import types
    module = types.ModuleType("__main__")
    module.__dict__.update({"__file__": path, "__builtins__": __builtins__})
    sys.modules["__main__"] = module
    sys.argv = [path]
    return module.__dict__


def _read_token():
    return sys.stdin.buffer.readline().strip()


def _stdin_to_devnull():
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)


def _exec_file(path, namespace):
    with open(path, encoding="utf-8") as f:
        code = compile(f.read(), path, "exec")
    exec(code, namespace)


def role_run(argv):
    token = _read_token()
    _stdin_to_devnull()
    token_fd = int(argv[0])
    _set_limits(*(int(v) for v in argv[1:6]))
    _exec_file(argv[6], _fresh_main(argv[6]))
    os.write(token_fd, token)


def _describe(exc):
    try:
        text = str(exc)
    except BaseException:
        text = "?"
    return [str(type(exc).__name__), text[:500]]


def role_candidate(argv):
    _stdin_to_devnull()
    req_fd, resp_fd = int(argv[0]), int(argv[1])
    _set_limits(*(int(v) for v in argv[2:7]))
    namespace = _fresh_main(argv[7])
    try:
        _exec_file(argv[7], namespace)
    except BaseException as e:
        import traceback
        traceback.print_exc()
        send_frame(resp_fd, ["failed"] + _describe(e))
        return 1
    for stream in (sys.stdout, sys.stderr):  # what the program printed shows in the result even if it is killed later
        try:
            stream.flush()
        except Exception:
            pass
    send_frame(resp_fd, ["ready"])
    handles = {}
    while True:
        request = recv_frame(req_fd)
        if request is None:
            return 0
        try:
            reply = ["ok", encode_value(_serve(request, namespace, handles), handles)]
        except BaseException as e:  # the program's own exception (or SystemExit) goes back as data
            reply = ["raise"] + _describe(e)
        send_frame(resp_fd, reply)


def _serve(request, namespace, handles):
    """The answer to one judge request, as a Python value (encoded by the caller)."""
    op, args = request[0], request[1:]
    if op == "lookup":
        if args[0] not in namespace:
            return ("absent",)
        value = namespace[args[0]]
        if type(value).__name__ == "module" or not callable(value):
            return ("absent",)  # the judge imports modules itself and builds the tests' values itself
        return ("callable",)
    target = namespace[args[0]] if op == "call" and type(args[0]) is str else handles[args[0]]
    resolve = handles.__getitem__
    if op == "call":
        return target(*[decode_value(v, resolve) for v in args[1]], **{k: decode_value(v, resolve) for k, v in args[2]})
    if op == "getattr":
        return getattr(target, args[1])
    if op == "setattr":
        return setattr(target, args[1], decode_value(args[2], resolve))
    if op == "getitem":
        return target[decode_value(args[1], resolve)]
    return {"iter": list, "len": len, "str": str, "repr": repr, "bool": bool}[op](target)


_CONTROL_FLOW = (StopIteration, StopAsyncIteration)


class _Link:
    """The judge's end of the channel: one request, one answer made of data."""

    def __init__(self, req_fd, resp_fd):
        self.req_fd, self.resp_fd = req_fd, resp_fd

    def ask(self, *request, reached=False):
        """The candidate's answer to ``request`` as data; ``reached``: handles in it were reached through an attribute
        or item of a candidate object (a method, say), so the tests may not call them."""
        send_frame(self.req_fd, list(request))
        reply = recv_frame(self.resp_fd)
        if reply is None:
            raise RuntimeError("the candidate program exited while a test was calling it")
        if type(reply) is list and len(reply) == 2 and reply[0] == "ok":
            return decode_value(reply[1], self.reached_handle if reached else self.handle)
        if type(reply) is list and len(reply) == 3 and reply[0] == "raise" and all(type(v) is str for v in reply[1:]):
            import builtins
            exc, message = getattr(builtins, reply[1], None), reply[2][:500]
            # The candidate's exception is a failed call: one that steers the judge's control flow (a StopIteration
            # ends the ``map`` it was raised in, so ``all(map(...))`` would see no item) becomes a RuntimeError.
            if not (isinstance(exc, type) and issubclass(exc, Exception)) or issubclass(exc, _CONTROL_FLOW):
                message = f"{reply[1]}: {message}"
                exc = RuntimeError
            try:
                error = exc(message)
            except Exception:
                error = RuntimeError(f"{reply[1]}: {message}")
            raise error
        raise WireError("malformed reply")

    def handle(self, key):
        return _Handle(self, key)

    def reached_handle(self, key):
        return _Handle(self, key, callable_=False)


def _arg(value):
    """A judge-side argument as a tagged tree: data, or a handle the candidate gave us (also inside containers)."""
    t = type(value)
    if t is _Handle:
        return ["h", value._key]
    if t is list or t is tuple or t is set or t is frozenset:
        return [{list: "l", tuple: "t", set: "S", frozenset: "Z"}[t], [_arg(v) for v in value]]
    if t is dict:
        return ["d", [[_arg(k), _arg(v)] for k, v in value.items()]]
    try:
        return encode_value(value)
    except WireError:
        raise TypeError(f"a {t.__name__} cannot be passed to the candidate's code (only data and its own objects)") from None


def _call(link, target, args, kwargs):
    return link.ask("call", target, [_arg(a) for a in args], [[k, _arg(v)] for k, v in kwargs.items()])


class _Remote:
    """A name the tests take from the candidate (a function or class): calls cross as data."""

    def __init__(self, link, name):
        self._link, self._name = link, name

    def __call__(self, *args, **kwargs):
        return _call(self._link, self._name, args, kwargs)

    def __repr__(self):
        return f"<candidate {self._name}>"


class _Handle:
    """A candidate object that is not data (a class instance, a generator, ...). Equal only to itself; calls,
    iteration, ``len``, ``str``, truth, attributes and items are asked of the candidate and answered as data.

    Attributes and items give data (``root.left.data``) or further handles, but a handle reached that way cannot be
    called: ``candidate('hello').startswith('olleh')`` means ``str.startswith`` run on a returned str (which arrives
    as data, so it runs here); on an object of the candidate it would be the candidate's own method answering."""

    def __init__(self, link, key, callable_=True):
        object.__setattr__(self, "_link", link)
        object.__setattr__(self, "_key", key)
        object.__setattr__(self, "_callable", callable_)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._link.ask("getattr", self._key, name, reached=True)

    def __setattr__(self, name, value):
        self._link.ask("setattr", self._key, name, _arg(value))

    def __getitem__(self, key):
        return self._link.ask("getitem", self._key, _arg(key), reached=True)

    def __call__(self, *args, **kwargs):
        if not self._callable:
            raise TypeError("a method or item of a candidate object cannot be called by the tests: only the program's "
                            "functions and classes, and functions they return, are candidate code")
        return _call(self._link, self._key, args, kwargs)

    def __iter__(self):
        return iter(self._checked("iter", list))

    def __len__(self):
        return self._checked("len", int)

    def __str__(self):
        return self._checked("str", str)

    def __repr__(self):
        return self._checked("repr", str)

    def __bool__(self):
        return self._checked("bool", bool)

    def __eq__(self, other):
        return self is other

    def __hash__(self):
        return id(self)

    def _checked(self, op, kind):
        value = self._link.ask(op, self._key)
        if type(value) is not kind:
            raise TypeError(f"{op}() of a candidate object gave a {type(value).__name__}")
        return value


def _names_used(source):
    """(names the code reads, names it defines anywhere: assignments, defs, classes, imports, arguments)."""
    import ast
    read, defined = set(), set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else defined).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            defined.add(node.name)
    return read, defined


def _is_stdlib_module(name):
    names = getattr(sys, "stdlib_module_names", None)  # Python 3.10+
    if names is not None:
        return name in names
    import importlib.util
    try:  # the judge runs with -I -S: whatever it can import is the standard library
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _bind(link, namespace, names):
    """Bind the names the tests take from outside themselves. A standard-library module name is imported here (MBPP
    tests use ``math.isclose`` without importing it): never the candidate's object of that name, and never a module
    the candidate names. Otherwise only the candidate's functions and classes are bound (as proxies): a value the
    tests read but do not build would let the candidate choose the tests' inputs, so it stays unbound (NameError)."""
    import importlib
    for name in names:
        if _is_stdlib_module(name):
            try:
                namespace[name] = importlib.import_module(name)
            except ImportError:
                pass
            continue
        kind = link.ask("lookup", name)
        if type(kind) is not tuple or not kind or type(kind[0]) is not str:
            continue
        if kind[0] == "callable":
            namespace[name] = _Remote(link, name)


def role_judge(argv):
    token = _read_token()
    spec = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    _stdin_to_devnull()
    token_fd, req_fd, resp_fd = int(argv[0]), int(argv[1]), int(argv[2])
    _set_limits(*(int(v) for v in argv[3:8]))
    hello = recv_frame(resp_fd)
    if hello != ["ready"]:
        if type(hello) is list:
            detail = ": ".join(v for v in hello[1:3] if type(v) is str)[:500]
            print(f"the candidate program failed: {detail}", file=sys.stderr)
        else:
            print("the candidate program exited before its functions could be tested", file=sys.stderr)
        return 1
    import builtins
    namespace = _fresh_main("tests.py")
    prefix, tests, entry = spec.get("prefix") or "", spec["tests"], spec.get("entry_point")
    try:
        prefix_code = compile(prefix, "prefix.py", "exec")
    except SyntaxError:
        prefix_code = None  # not runnable on its own (it ends inside a statement): the candidate supplies it all
    if prefix_code is not None:
        exec(prefix_code, namespace)  # trusted: the task's own helpers (HumanEval's poly, encode_cyclic, ...)
    read, defined = _names_used(tests)
    # The tests' own names (their setup code, loop variables, helpers) are never looked up in the candidate.
    wanted = {n for n in read - defined if n not in namespace and not hasattr(builtins, n)}
    link = _Link(req_fd, resp_fd)
    _bind(link, namespace, sorted(wanted - {entry}))
    if entry:  # the prefix's stub of the entry point is replaced by the candidate's function, whatever its name
        kind = link.ask("lookup", entry)
        if kind == ("callable",):
            namespace[entry] = _Remote(link, entry)
        else:
            namespace.pop(entry, None)
    exec(compile(tests, "tests.py", "exec"), namespace)
    os.write(token_fd, token)
    return 0


ROLES = {"run": role_run, "candidate": role_candidate, "judge": role_judge}


def main():
    """The bootstrap: the first stdin line is the view to build (under unshare; ``enter_view`` comes from
    ``sandbox_mounts.py``, prepended to this source) or null; then the role runs with the rest of stdin."""
    view = json.loads(sys.stdin.buffer.readline() or b"null")
    if view:
        enter_view(view)
    os.umask(0o077)  # in the fallback, files in shared directories stay private to this sample's uid
    return ROLES[sys.argv[1]](sys.argv[2:]) or 0


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] in ROLES:
    sys.exit(main())
