"""Policies: presets, validation, round trips and clear refusals."""

import json
import re

import pytest

from actdesign.errors import ActdesignError
from actdesign.runtime.apply import policy as P
from actdesign.runtime.methods.fewbit import table_name


@pytest.mark.parametrize("name", list(P.PRESETS))
def test_every_preset_loads_and_round_trips(name):
    policy = P.load(name)
    assert P.validate(policy.to_dict()) == P.Policy(policy.rules, "policy")


def test_presets_combine_in_order():
    policy = P.load("fewbit3+msnorm+actnn2")
    assert [(r.target, r.apply) for r in policy.rules] == [
        ("activation", "fewbit"), ("norm", "msnorm"), ("linear", "actnn"), ("conv2d", "actnn"),
        ("channel_norm", "actnn"), ("activation", "fewbit"), ("pool", "chain")]
    assert policy.label == "fewbit3+msnorm+actnn2"


def test_lean_rules_come_last_in_joined_presets():
    """llm's defaults for Linear layers and activations yield to any other preset's rule for
    them."""
    policy = P.load("llm+actnn2")
    assert [(r.target, r.apply) for r in policy.rules] == [
        ("norm", "msnorm"), ("glu", "msglu"), ("attention", "rope"), ("head", "fused_ce"),
        ("linear", "actnn"), ("conv2d", "actnn"), ("channel_norm", "actnn"),
        ("activation", "fewbit"), ("linear", "lean"), ("activation", "msact"), ("pool", "chain")]
    assert [r.apply for r in P.load("fewbit3+llm").rules] == [
        "fewbit", "msnorm", "msglu", "rope", "fused_ce", "lean", "msact"]


def test_file_round_trip_resolves_spec_paths(tmp_path, make_spec):
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "g.json").write_text(json.dumps(make_spec("gelu", 3)))
    data = {"format": P.FORMAT, "rules": [
        {"target": "activation", "name": ["*.mlp.*", "head.*"], "type": "GELU",
         "apply": "fewbit", "bits": 3, "spec": "specs/g.json"},
        {"target": "linear", "name": "*.attn.*", "apply": "keep"},
        {"target": "linear", "apply": "backrazor", "ratio": 0.75, "int8": True},
        {"target": "conv2d", "apply": "pooled", "pool": 4}]}
    (tmp_path / "policy.json").write_text(json.dumps(data))
    policy = P.load(str(tmp_path / "policy.json"))
    assert policy.rules[0].option("spec") == str((tmp_path / "specs" / "g.json").resolve())
    assert policy.rules[0].names == ("*.mlp.*", "head.*")
    P.save(policy, tmp_path / "again.json")
    again = P.load(str(tmp_path / "again.json"))
    assert again.rules == policy.rules
    assert P.load(policy) is policy


def test_defaults_are_filled_and_omitted_again():
    rule = P.load({"rules": [{"target": "linear", "apply": "actnn"}]}).rules[0]
    assert dict(rule.options) == {"bits": 2, "group_size": 256, "allocation": None}
    assert rule.to_dict() == {"target": "linear", "apply": "actnn"}


def test_inline_spec_and_table_names(make_spec):
    inline = P.load({"rules": [{"target": "activation", "apply": "fewbit",
                                "spec": make_spec("silu", 2)}]})
    assert inline.rules[0].option("spec")["activation"] == {"name": "silu"}
    assert table_name("gelu3") == ("stepwise", "gelu", 3)
    assert table_name("regelu2") == ("pwl", "gelu", 2)
    assert table_name("resilu2") == ("pwl", "silu", 2)
    assert table_name("relu1") == ("stepwise", "relu", 1)
    assert table_name("gelu_tanh4") == ("stepwise", "gelu_tanh", 4)
    assert table_name("nosuch3") is None
    assert table_name("regelu5") is None  # pwl fits stop at 4 bits


@pytest.mark.parametrize("data, message", [
    ([], "not list"),
    ({"rules": [], "extra": 1}, "unknown key 'extra'"),
    ({"format": "other/1", "rules": []}, "format must be"),
    ({"rules": {}}, "'rules' must be a list"),
    ({"rules": [{"target": "embedding", "apply": "keep"}]}, "target must be one of"),
    ({"rules": [{"target": "linear", "apply": "quantize"}]}, "apply must be one of"),
    ({"rules": [{"target": "linear", "apply": "fewbit"}]}, "does not apply to 'linear'"),
    ({"rules": [{"target": "linear", "apply": "actnn", "bitz": 2}]}, "unknown key 'bitz'"),
    ({"rules": [{"target": "linear", "apply": "actnn", "bits": 9}]}, "integer in 1..8"),
    ({"rules": [{"target": "linear", "apply": "actnn", "bits": True}]}, "integer in 1..8"),
    ({"rules": [{"target": "linear", "apply": "actnn", "group_size": 100}]}, "power of two"),
    ({"rules": [{"target": "activation", "apply": "pwl", "bits": 5}]}, "integer in 1..4"),
    ({"rules": [{"target": "linear", "apply": "backrazor", "ratio": 1.0}]}, "in [0, 1)"),
    ({"rules": [{"target": "linear", "apply": "backrazor", "int8": 1}]}, "true or false"),
    ({"rules": [{"target": "linear", "apply": "keep", "name": 3}]}, "non-empty string"),
    ({"rules": [{"target": "head", "apply": "fused_ce", "chunk_size": 0}]}, "integer in 1.."),
    ({"rules": [{"target": "head", "apply": "lean"}]}, "does not apply to 'head'"),
    ({"rules": [{"target": "glu", "apply": "msglu", "act": "relu"}]}, "unknown key 'act'"),
    ({"rules": [{"target": "activation", "apply": "fewbit", "spec": "gelu"}]},
     "neither a built-in table name"),
    ({"rules": [{"target": "activation", "apply": "fewbit", "spec": "missing.json"}]},
     "not found"),
    ({"rules": [{"target": "activation", "apply": "fewbit", "spec": {"format": "x"}}]},
     "rules[0].spec"),
])
def test_bad_policies_are_refused_in_one_line(data, message):
    with pytest.raises(ActdesignError, match=re.escape(message)) as info:
        P.load(data)
    assert "\n" not in str(info.value)


def test_bad_names_and_files(tmp_path):
    with pytest.raises(ActdesignError, match="unknown policy 'fewbit9'"):
        P.load("fewbit9")
    with pytest.raises(ActdesignError, match="not found"):
        P.load(str(tmp_path / "none.json"))
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(ActdesignError, match="not valid JSON"):
        P.load(str(tmp_path / "bad.json"))
    (tmp_path / "nan.json").write_text('{"rules": [{"target": "linear", "apply": "backrazor", '
                                       '"ratio": NaN}]}')
    with pytest.raises(ActdesignError, match="not valid JSON"):
        P.load(str(tmp_path / "nan.json"))
    with pytest.raises(ActdesignError, match="not int"):
        P.load(3)
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ActdesignError, match="must be a JSON object"):
        P.load(str(tmp_path / "list.json"))


def test_hostile_policy_files_are_one_line(tmp_path, make_spec):
    big = "1" + "0" * 400
    inline = re.sub(r'"levels": \[[^,]+', '"levels": [' + big, json.dumps(make_spec("gelu", 2)))
    hostile = {
        "huge ratio": '{"rules": [{"target": "linear", "apply": "backrazor", "ratio": '
                      + big + "}]}",
        "huge level inline": '{"rules": [{"target": "activation", "apply": "fewbit", '
                             '"bits": 2, "spec": ' + inline + "}]}",
        "deep nesting": "[" * 100000,
    }
    for name, text in hostile.items():
        path = tmp_path / f"{name.replace(' ', '_')}.json"
        path.write_text(text)
        with pytest.raises(ActdesignError) as info:
            P.load(str(path))
        assert str(info.value).startswith(str(path)) and "\n" not in str(info.value), name
    spec = make_spec("gelu", 2)
    spec["levels"][0] = 10**400  # an inline spec given as a dict
    with pytest.raises(ActdesignError, match="must be finite"):
        P.load({"rules": [{"target": "activation", "apply": "fewbit", "bits": 2, "spec": spec}]})
