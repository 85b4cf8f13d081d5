"""The code of the README and of every page of docs/ runs as written.

Every ```python block either runs, offline, in a temporary directory where the pages' cheap
shell commands (`actdesign fit/show/list/gen-kernel`) ran first, in the site's order, or is in
SKIP with the reason.
A block may assume names its surrounding text introduces (`model`, `x`, `batches`): GIVEN
defines them before the block runs. A line that needs the Hugging Face Hub carries an
`# offline: ...` comment telling the reader what to change; OFFLINE holds the change this test
makes to it. Every entry of these tables must still match a block or a line of the pages.
"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from actdesign.activation import builtin_names
from actdesign.runtime import compress, models
from actdesign.runtime.methods.fewbit import table_name

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def pages() -> list[Path]:
    """The README, then docs/ in the site's order (mkdocs.yml's nav), then any page the nav
    leaves out (mkdocs --strict refuses those, but their code still runs here)."""
    nav = re.findall(r"^\s*- (?:[^:\n]+: )?([\w./-]+\.md)$", (ROOT / "mkdocs.yml").read_text(),
                     re.M)
    listed = [ROOT / "docs" / name for name in nav]
    return [README, *listed, *sorted(set((ROOT / "docs").glob("*.md")) - set(listed))]


def text_of_pages() -> str:
    return "\n".join(page.read_text() for page in pages())
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.M | re.S)

# A block is named by a substring only it contains.
SKIP = {
    "compress(model, \"llm\")                               # 1. compress":
        "needs a dataset and trains with Trainer; tests/test_clients.py runs these calls",
    "trainer = SFTTrainer(": "needs a dataset and trains; tests/test_clients.py runs SFTTrainer",
    "fully_shard(layer)": "needs a distributed process group; tests/test_distributed.py",
    "print(compress(model, \"llm\"))                        # PEFT first":
        "trains with Trainer on a dataset; tests/test_lora.py runs PEFT with compress",
    "result = plan(": "the planner calibrates every option on real batches; "
                      "tests/test_planner.py runs plan()",
}
TINY_LLAMA = "model = models.build('llama-tiny')[0].train()\n"
GIVEN = {
    'report = compress(model, "fewbit3+msnorm")': "model = models.build('gpt2-tiny')[0]\n",
    "y = ops.apply(x)": "x = torch.randn(64, requires_grad=True)\n"
                        "codes = torch.randint(0, 8, (100,))\n",
    "fused_linear_cross_entropy(hidden, head_weight, labels)":
        TINY_LLAMA + "ids = torch.randint(0, 512, (2, 16))\n"
        "hidden = torch.randn(2, 16, 64, requires_grad=True)\n"
        "head_weight = torch.randn(512, 64, requires_grad=True)\nlabels = ids\n",
    "block.ln1 = ms_norm(block.ln1)":
        "block = torch.nn.Module()\nblock.ln1 = torch.nn.LayerNorm(32)\n"
        "block.q, block.k, block.v = (torch.nn.Linear(32, 32) for _ in range(3))\n",
    "QLinear.from_module(model.fc":
        "model = torch.nn.Sequential()\nmodel.fc = torch.nn.Linear(16, 4)\n"
        "batches = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(2)]\n",
    "SparseLinear.from_module(linear":
        "linear = torch.nn.Linear(16, 8)\nconv = torch.nn.Conv2d(3, 4, 3)\n",
    "quantization_config=four_bit": "",  # OFFLINE points it at a saved tiny LLaMA
}
OFFLINE = {
    'model = AutoModelForCausalLM.from_pretrained("Qwen/Qwen2.5-0.5B", '
    'quantization_config=four_bit)':
        "model = AutoModelForCausalLM.from_pretrained(FOLDER, quantization_config=four_bit, "
        "device_map='cpu')",
}
# Shell commands not run, with the reason.
SKIP_COMMANDS = {
    "actdesign fit mish --kind pwl --bits 3": "a 3-bit piecewise-linear fit takes about 25 s",
}
CHEAP = ("list", "fit", "show", "gen-kernel")


def blocks(lang):
    text = text_of_pages()
    for m in FENCE.finditer(text):
        if m.group(2) == lang:
            indent = len(m.group(1))
            yield "\n".join(line[indent:] for line in m.group(3).splitlines())


PYTHON = list(blocks("python"))


def entry(block, table):
    found = [key for key in table if key in block]
    assert len(found) <= 1, f"several entries name one block: {found}"
    return found[0] if found else None


def test_every_table_entry_names_one_block_or_line():
    for table in (SKIP, GIVEN):
        for key in table:
            assert sum(key in b for b in PYTHON) == 1, f"{key!r} names no single block"
    for block in PYTHON:
        assert not (entry(block, SKIP) and entry(block, GIVEN)), block
    lines = [line.split("#")[0].rstrip() for b in PYTHON for line in b.splitlines()]
    for line in OFFLINE:
        assert line in lines, f"no README line {line!r}"
    commands = [c for b in blocks("") for c in b.splitlines()]
    for command in SKIP_COMMANDS:
        assert any(c.startswith(command) for c in commands), command


def test_every_hub_line_says_what_to_change_offline():
    for block in PYTHON:
        for line in block.splitlines():
            if "from_pretrained(" in line and "import" not in line:
                assert "# offline:" in line, line


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A directory where the pages' cheap `actdesign` commands have run, in order."""
    folder = tmp_path_factory.mktemp("readme")
    np.save(folder / "preacts.npy", np.random.default_rng(0).standard_normal(20_000))
    cli = shutil.which("actdesign", path=str(Path(sys.executable).parent))
    assert cli is not None
    for block in blocks(""):
        for line in block.splitlines():
            command = line.split("  #")[0].strip()
            words = command.split()
            if len(words) < 2 or words[0] != "actdesign" or words[1] not in CHEAP:
                continue
            if any(command.startswith(c) for c in SKIP_COMMANDS):
                continue
            args = [w.strip('"') for w in re.findall(r'"[^"]*"|\S+', command)[1:]]
            done = subprocess.run([cli, *args], cwd=folder, capture_output=True, text=True,
                                  timeout=120)
            assert done.returncode == 0, f"{command}: {done.stderr}"
    return folder


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    models.build("llama-tiny")[0].save_pretrained(folder)
    return folder


def test_the_shell_commands_wrote_their_outputs(workdir):
    for name in ("gelu3.json", "gelu3_ops.py", "silu2.json", "quick.json", "tanh4.json",
                 "gelu3.png", "regelu2.json", "resilu2.json", "regelu2.png"):
        assert (workdir / name).is_file(), name


@pytest.mark.parametrize("block", PYTHON, ids=[b.splitlines()[0][:40] for b in PYTHON])
def test_python_block_runs(block, workdir, saved_llama, monkeypatch):
    reason = SKIP.get(entry(block, SKIP))
    if reason is not None:
        pytest.skip(reason)
    lines = []
    for line in block.splitlines():
        code = line.split("#")[0].rstrip()
        lines.append(OFFLINE.get(code, line) if "# offline:" in line else line)
    source = GIVEN.get(entry(block, GIVEN), "") + "\n".join(lines)
    monkeypatch.chdir(workdir)
    monkeypatch.syspath_prepend(str(workdir))
    namespace = {"torch": torch, "models": models, "FOLDER": str(saved_llama)}
    exec(compile(source, "the docs", "exec"), namespace)


def test_the_policy_example_fires_every_rule_on_gpt2():
    """Each rule of the README's policy file takes some module of GPT-2: without it, compress
    does something else."""
    (text,) = [b for b in blocks("json") if '"actdesign.policy/1"' in b]
    policy = json.loads(text)

    def report(rules):
        return str(compress(models.build("gpt2-tiny")[0], {**policy, "rules": rules}))

    full = report(policy["rules"])
    assert "left alone transformer.h" not in full, full  # nothing refused inside the layers
    for i in range(len(policy["rules"])):
        assert report(policy["rules"][:i] + policy["rules"][i + 1:]) != full, \
            f"rule {i} matches nothing: {policy['rules'][i]}"


TABLE_NAMES = {  # the forms the README lists -> (kind, activation, bits)
    "gelu3": ("stepwise", "gelu", 3), "gelu_tanh4": ("stepwise", "gelu_tanh", 4),
    "silu2": ("stepwise", "silu", 2), "quick_gelu3": ("stepwise", "quick_gelu", 3),
    "leaky_relu2": ("stepwise", "leaky_relu", 2), "gelu_tanh3": ("stepwise", "gelu_tanh", 3),
    "regelu2": ("pwl", "gelu", 2), "resilu2": ("pwl", "silu", 2),
    "regelu_tanh2": ("pwl", "gelu_tanh", 2), "relu3": ("stepwise", "relu", 3),
    "rerelu2": ("pwl", "relu", 2), "relu6": ("stepwise", "relu", 6),
    "relu63": ("stepwise", "relu6", 3),
}


def test_every_table_name_form_the_docs_list_parses():
    text = text_of_pages()
    for name, parsed in TABLE_NAMES.items():
        assert f"`{name}`" in text, name
        assert table_name(name) == parsed, name
    for name in builtin_names():  # every built-in, at every bit width its kind takes
        for bits in range(1, 9):
            assert table_name(f"{name}{bits}") == ("stepwise", name, bits)
    for bad in ("swish3", "regelu5", "gelu9", "gelu", "gelu0"):  # what the README rules out
        assert table_name(bad) is None, bad
