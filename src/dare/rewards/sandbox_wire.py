"""The judge's wire codec, shared by the parent and the sandboxed roles: frames (a 4-byte big-endian length and a JSON
document) and values as tagged trees that decode to *fresh* objects of exact builtin (and a few standard-library value)
types (``sandbox_child`` describes the protocol). Prepended to ``sandbox_child.py``'s source in the bootstrap, so it is
standard library only, Python 3.8+.
"""
import json
import os

MAX_FRAME = 16 << 20  # bytes of one JSON frame the judge accepts from the candidate
MAX_DEPTH = 100  # nesting of encoded values


class WireError(ValueError):
    """A frame or value that is not valid data (the judge treats it as a failed call)."""


# ------------------------------------------------------------------------------------------------ values
def _stdlib_value_types():
    import collections
    import decimal
    import fractions
    return collections, decimal.Decimal, fractions.Fraction


def _pairs(items, handles, depth):
    return [[encode_value(k, handles, depth), encode_value(v, handles, depth)] for k, v in items]


def encode_value(value, handles=None, depth=0):
    """A tagged JSON tree for ``value``. Exact types only (a subclass of int or list is not data): anything else
    becomes a handle registered in ``handles`` (``{id: object}``), or raises WireError when ``handles`` is None."""
    if depth > MAX_DEPTH:
        raise WireError(f"value nested deeper than {MAX_DEPTH}")
    depth += 1
    t = type(value)
    if value is None:
        return ["N"]
    if t is bool:
        return ["b", value]
    if t is int:
        return ["i", format(value, "x")]
    if t is float:
        return ["f", value.hex()]
    if t is complex:
        return ["c", value.real.hex(), value.imag.hex()]
    if t is str:
        return ["s", value]
    if t is bytes or t is bytearray:
        return ["y" if t is bytes else "Y", value.hex()]
    if t is list or t is tuple or t is set or t is frozenset:
        tag = {list: "l", tuple: "t", set: "S", frozenset: "Z"}[t]
        return [tag, [encode_value(v, handles, depth) for v in value]]
    if t is dict:
        return ["d", _pairs(value.items(), handles, depth)]
    if t is range:
        return ["r", format(value.start, "x"), format(value.stop, "x"), format(value.step, "x")]
    collections, Decimal, Fraction = _stdlib_value_types()
    if t is Fraction:
        return ["q", format(value.numerator, "x"), format(value.denominator, "x")]
    if t is Decimal:
        return ["D", str(value)]
    if t is collections.OrderedDict or t is collections.Counter or t is collections.defaultdict:
        tag = {collections.OrderedDict: "o", collections.Counter: "C", collections.defaultdict: "e"}[t]
        return [tag, _pairs(value.items(), handles, depth)]
    if t is collections.deque:
        return ["Q", [encode_value(v, handles, depth) for v in value]]
    if handles is None:
        raise WireError(f"a {t.__name__} is not data")
    key = len(handles)
    handles[key] = value
    return ["h", key]


def _int(text):
    if type(text) is not str or not text or len(text) > MAX_FRAME:
        raise WireError("bad int")
    body = text[1:] if text[0] == "-" else text
    if not body or any(c not in "0123456789abcdef" for c in body):
        raise WireError("bad int")
    return int(text, 16)


def _float(text):
    if type(text) is not str:
        raise WireError("bad float")
    try:
        return float.fromhex(text)
    except (ValueError, OverflowError):
        raise WireError("bad float") from None


def _list(tree):
    if type(tree) is not list:
        raise WireError("bad container")
    return tree


def decode_value(tree, resolve=None, depth=0):
    """The value a tagged tree describes, built from scratch: only exact builtin types (and Fraction, Decimal,
    OrderedDict, Counter, defaultdict without factory, deque). ``resolve(key)`` maps a handle; None = no handles."""
    if depth > MAX_DEPTH:
        raise WireError(f"value nested deeper than {MAX_DEPTH}")
    depth += 1
    if type(tree) is not list or not tree or type(tree[0]) is not str:
        raise WireError("not a tagged value")
    tag, args = tree[0], tree[1:]
    try:
        if tag == "N" and not args:
            return None
        if tag == "b" and len(args) == 1 and (args[0] is True or args[0] is False):
            return bool(args[0])
        if tag == "i" and len(args) == 1:
            return _int(args[0])
        if tag == "f" and len(args) == 1:
            return _float(args[0])
        if tag == "c" and len(args) == 2:
            return complex(_float(args[0]), _float(args[1]))
        if tag == "s" and len(args) == 1 and type(args[0]) is str:
            return str(args[0])
        if tag in ("y", "Y") and len(args) == 1 and type(args[0]) is str:
            raw = bytes.fromhex(args[0])
            return raw if tag == "y" else bytearray(raw)
        if tag in ("l", "t", "S", "Z", "Q") and len(args) == 1:
            items = [decode_value(v, resolve, depth) for v in _list(args[0])]
            if tag == "Q":
                return _stdlib_value_types()[0].deque(items)
            return {"l": list, "t": tuple, "S": set, "Z": frozenset}[tag](items)
        if tag in ("d", "o", "C", "e") and len(args) == 1:
            pairs = []
            for pair in _list(args[0]):
                if type(pair) is not list or len(pair) != 2:
                    raise WireError("bad mapping item")
                pairs.append((decode_value(pair[0], resolve, depth), decode_value(pair[1], resolve, depth)))
            collections = _stdlib_value_types()[0]
            if tag == "e":
                return collections.defaultdict(None, pairs)
            if tag == "C":
                return collections.Counter(dict(pairs))
            return {"d": dict, "o": collections.OrderedDict}[tag](pairs)
        if tag == "r" and len(args) == 3:
            return range(_int(args[0]), _int(args[1]), _int(args[2]))
        if tag == "q" and len(args) == 2:
            return _stdlib_value_types()[2](_int(args[0]), _int(args[1]))
        if tag == "D" and len(args) == 1 and type(args[0]) is str and len(args[0]) < 10000:
            return _stdlib_value_types()[1](args[0])
        if tag == "h" and len(args) == 1 and type(args[0]) is int and resolve is not None:
            return resolve(args[0])
    except WireError:
        raise
    except (TypeError, ValueError, ArithmeticError, RecursionError) as e:  # unhashable key, zero denominator, ...
        raise WireError(f"bad {tag!r} value: {type(e).__name__}") from None
    raise WireError(f"bad value tag {tag!r}")


# ------------------------------------------------------------------------------------------------ frames
def send_frame(fd, message):
    data = json.dumps(message, separators=(",", ":")).encode("utf-8")
    data = len(data).to_bytes(4, "big") + data
    while data:
        data = data[os.write(fd, data):]


def _read_exact(fd, n):
    chunks = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv_frame(fd, limit=MAX_FRAME):
    """The next JSON frame, or None at end of stream; WireError for an oversized or malformed frame."""
    head = _read_exact(fd, 4)
    if head is None:
        return None
    size = int.from_bytes(head, "big")
    if size > limit:
        raise WireError(f"frame of {size} bytes (limit {limit})")
    body = _read_exact(fd, size)
    if body is None:
        return None
    try:
        return json.loads(body.decode("utf-8"))
    except (ValueError, RecursionError):
        raise WireError("frame is not JSON") from None
