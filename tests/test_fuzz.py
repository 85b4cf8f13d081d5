"""Fuzzing the readers of user input: random expression trees, and mutated JSON specs and
policies. Every input must parse or raise ActdesignError, each within a time bound.

Seeded, so a failure repeats; the failing input is in the assertion message.
"""

import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from actdesign import spec as spec_mod
from actdesign.activation import resolve
from actdesign.errors import ActdesignError
from actdesign.expr import FUNCTIONS
from actdesign.files import loads_json
from actdesign.runtime.apply import policy as P

sys.path.insert(0, str(Path(__file__).parent))
from bounds import within  # noqa: E402
from conftest import synthetic_spec  # noqa: E402

# Parsing has a budget of 1 s (expr.PARSE_SECONDS); evaluating f, f', f'' and finding the
# breakpoints takes milliseconds more. Unbounded inputs took minutes, or hung, before.
BOUND = 2.0
NUMBERS = ["0", "1", "2", "0.5", "3", "64", "65", "-64", "1e-300", "1e300", "9007199254740992",
           "1.702", "pi", "e", "0.044715", "100"]
CONDITIONS = ["<", "<=", ">", ">="]


def random_expression(rng, depth: int) -> str:
    """A random text of the expression language, with the shapes that once blew up: nested
    abs/max/where (subtrees repeated), powers of powers and products of powers."""
    if depth <= 0 or rng.random() < 0.15:
        return "x" if rng.random() < 0.6 else str(rng.choice(NUMBERS))
    kind = rng.integers(0, 6)
    sub = lambda: random_expression(rng, depth - 1)  # noqa: E731
    if kind == 0:
        return f"({sub()} {rng.choice(['+', '-', '*', '/'])} {sub()})"
    if kind == 1:
        return f"({sub()})**{rng.choice(NUMBERS + ['x', '-0.5', '33'])}"
    if kind == 2:
        return f"-{sub()}"
    if kind == 3:
        chain = int(rng.integers(1, 16))
        name = str(rng.choice(["abs", "relu", "sin", "exp", "sigmoid", "softplus", "tanh"]))
        return f"{name}(" * chain + sub() + ")" * chain
    name = str(rng.choice(sorted(FUNCTIONS)))
    if name == "where":
        cond = f"{sub()} {rng.choice(CONDITIONS)} {sub()}"
        if rng.random() < 0.2:
            cond = f"({cond}) {rng.choice(['and', 'or'])} (x {rng.choice(CONDITIONS)} 1)"
        return f"where({cond}, {sub()}, {sub()})"
    if name == "clip":
        lo = float(rng.normal(0, 3))
        return f"clip({sub()}, {lo:.3g}, {lo + float(rng.exponential(2)):.3g})"
    arity = FUNCTIONS[name][0]
    return f"{name}({', '.join(sub() for _ in range(arity))})"


def _expression_inputs():
    rng = np.random.default_rng(2026)
    return [random_expression(rng, int(rng.integers(1, 7))) for _ in range(240)]


def _bounded(call, text):
    """call() within BOUND; a result or an ActdesignError of one line, nothing else."""
    start = time.perf_counter()
    try:
        with within(BOUND, text[:200]):
            result = call()
    except ActdesignError as exc:
        assert "\n" not in str(exc), text[:200]
        result = exc
    except Exception as exc:  # noqa: BLE001  (the assertion names the input)
        pytest.fail(f"{type(exc).__name__}: {str(exc)[:200]} for input {text[:300]!r}")
    return result, time.perf_counter() - start


def test_random_expressions_parse_or_refuse_in_time():
    def use(text):
        act = resolve(text)
        xs = np.linspace(-8, 8, 257)
        act.f(xs), act.df(xs), act.d2f(xs)
        act.breakpoints(-8.0, 8.0)
        return act

    outcomes = [_bounded(lambda t=t: use(t), t) for t in _expression_inputs()]
    parsed = sum(not isinstance(r, ActdesignError) for r, _ in outcomes)
    assert 40 <= parsed <= len(outcomes) - 40  # the fuzz reaches both sides


def _hostile_values(rng):
    return [10**400, -(10**400), 1e308, -0.0, 0, 5000, "x", "", None, True, [], {},
            [[[[[]]]]], "abs(" * 14 + "x" + ")" * 14, "(x**64)**64", list(range(300)),
            {"expr": "(x**64)**64"}, {"name": "gelu"}, float(rng.normal()),
            {"type": "empirical", "edges": list(range(5002)), "counts": [1] * 5001},
            {"type": "normal", "mean": 1e300, "std": 1.0}]


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value[:4]):
            yield from _paths(v, prefix + (i,))


def _mutate(rng, data):
    data = copy.deepcopy(data)
    paths = [p for p in _paths(data) if p]
    for _ in range(int(rng.integers(0, 3))):
        path = paths[int(rng.integers(len(paths)))]
        parent = data
        try:
            for key in path[:-1]:
                parent = parent[key]
            if rng.random() < 0.15 and isinstance(parent, dict):
                parent.pop(path[-1], None)
            else:
                values = _hostile_values(rng)
                parent[path[-1]] = values[int(rng.integers(len(values)))]
        except (KeyError, IndexError, TypeError):
            pass  # an earlier mutation changed the shape
    text = json.dumps(data)
    cut = int(rng.integers(0, len(text) + 1))
    edit = rng.integers(0, 10)  # 4 of 10: the JSON text itself is damaged
    if edit == 0:
        text = text[:cut]
    elif edit == 1:
        text = text[:cut] + "[" * int(rng.integers(1, 100000)) + text[cut:]
    elif edit == 2:
        text = text[:cut] + "9" * int(rng.integers(300, 500)) + text[cut:]
    elif edit == 3:
        text = text[:cut] + text[cut + 1:]
    return text


def _spec_inputs():
    rng = np.random.default_rng(7)
    bases = [synthetic_spec("gelu", 2), synthetic_spec("x*sigmoid(1.702*x)", 3),
             synthetic_spec("relu", 1) | {"objective": {"weight": {
                 "type": "empirical", "edges": [-1.0, 0.0, 1.0], "counts": [1.0, 2.0]}}}]
    return [_mutate(rng, bases[i % len(bases)]) for i in range(240)]


def _policy_inputs():
    rng = np.random.default_rng(11)
    base = {"format": "actdesign.policy/1", "rules": [
        {"target": "activation", "apply": "fewbit", "bits": 2,
         "spec": synthetic_spec("gelu", 2)},
        {"target": "linear", "name": ["*.attn.*"], "apply": "actnn", "bits": 2,
         "group_size": 256},
        {"target": "linear", "apply": "backrazor", "ratio": 0.5},
        {"target": "head", "apply": "fused_ce", "chunk_size": 1024}]}
    return [_mutate(rng, base) for _ in range(160)]


def test_mutated_specs_load_or_refuse_in_time():
    outcomes = [_bounded(lambda t=t: spec_mod.loads(t, "fuzz.json"), t)
                for t in _spec_inputs()]
    assert sum(not isinstance(r, ActdesignError) for r, _ in outcomes) >= 10


def test_mutated_policies_load_or_refuse_in_time():
    outcomes = [_bounded(lambda t=t: P.validate(loads_json(t, "fuzz.json"), "fuzz.json"), t)
                for t in _policy_inputs()]
    assert sum(not isinstance(r, ActdesignError) for r, _ in outcomes) >= 10


# --- estimate's and plan's options, and the configs estimate reads --------------------------

def _option_texts():
    rng = np.random.default_rng(40)
    numbers = ["0", "1", "-1", "0.5", "1.5", "24", "1e400", "-0", ".", "1e-400", "nan", "inf",
               "9" * 400, "2.4", "  3 ", "1_000", "٣"]
    units = ["", "GB", "GiB", "gib", "MiB", "KB", "TiB", "B", "parsecs", " GiB", "Gi", "%"]
    return [str(rng.choice(numbers)) + str(rng.choice(units)) for _ in range(200)]


def test_sizes_and_budgets_parse_or_refuse_in_time():
    """--gpu-memory and --budget values: a size with its unit, a fraction in (0, 1], or a
    one-line refusal; never another exception, never a size that is not a positive int."""
    from actdesign.options import parse_budget, parse_size

    for text in _option_texts():
        size, _ = _bounded(lambda t=text: parse_size(t), text)
        assert isinstance(size, ActdesignError) or (isinstance(size, int) and size >= 1), text
        budget, _ = _bounded(lambda t=text: parse_budget(t), text)
        assert isinstance(budget, ActdesignError) or (isinstance(budget, int) and budget >= 1) \
            or (isinstance(budget, float) and 0 < budget <= 1), text


def _config_inputs():
    rng = np.random.default_rng(41)
    base = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32,
            "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 1, "vocab_size": 64, "max_position_embeddings": 64}
    hostile = [10**400, -1, 0, 3, 7, 10**9, 1e308, 0.5, "x", "", None, True, [], {}, [4, 4]]
    out = []
    for _ in range(24):
        data = dict(base)
        for key in rng.choice(sorted(base), size=int(rng.integers(1, 3)), replace=False):
            data[str(key)] = hostile[int(rng.integers(len(hostile)))]
        out.append(json.dumps(data, allow_nan=True))
    return out


def test_mutated_configs_estimate_or_refuse_in_time(tmp_path):
    """A config.json with hostile sizes or types: estimated, or refused in one line naming
    what is wrong; never a traceback, never hours of building (BOUND per config)."""
    from actdesign.runtime.memory.estimate import estimate

    global BOUND
    done = 0
    for i, text in enumerate(_config_inputs()):
        folder = tmp_path / str(i)
        folder.mkdir()
        (folder / "config.json").write_text(text)
        previous, BOUND = BOUND, 60.0  # building and stepping a model, not parsing text
        try:
            result, _ = _bounded(lambda f=folder: estimate(str(f), 1, 8), text)
        finally:
            BOUND = previous
        done += not isinstance(result, ActdesignError)
    assert done >= 2  # some survive their mutation
