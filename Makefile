# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv if needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
OUT := out
# the torchvision built for the installed torch (2.N takes 0.(N+15)): another replaces torch
TORCHVISION := $(BIN)/python -c 'import torch; print("torchvision==0.%d.*" % (int(torch.__version__.split(".")[1]) + 15))'

.PHONY: install demo test test-busy lint docs docs-serve bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev,hf]'
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[vision]' "$$($(TORCHVISION))"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	mkdir -p $(OUT)
	$(BIN)/actdesign list
	$(BIN)/actdesign fit gelu --bits 3 --out $(OUT)/gelu3.json
	$(BIN)/actdesign fit "x*sigmoid(1.702*x)" --bits 2 --weight uniform --domain -6 6 --out $(OUT)/quick2.json
	$(BIN)/actdesign show $(OUT)/gelu3.json --plot $(OUT)/gelu3.png
	$(BIN)/python examples/fit_tables.py
	$(BIN)/actdesign gen-kernel $(OUT)/gelu3.json --out $(OUT)/gelu3_ops.py
	$(BIN)/python examples/train_mlp.py $(OUT)/gelu3_ops.py
	$(BIN)/actdesign profile --model gpt2-tiny --policy fewbit3+msnorm --batch 8 --seq 256 \
		--plot $(OUT)/profile.png
	$(BIN)/actdesign profile --model llama-tiny --policy llm --batch 8 --seq 256 \
		--precision bf16-autocast
	$(BIN)/python examples/finetune_lora.py --plot $(OUT)/finetune_lora.png

test: $(STAMP)
	$(BIN)/pytest -q

test-busy: $(STAMP)  # the suite beside two busy loops: a loaded machine fails no test
	bash tests/busy.sh $(BIN)/pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

DOCS_STAMP := $(VENV)/.docs-stamp

$(DOCS_STAMP): $(STAMP)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev,hf,docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)  # the site, into out/site; a broken link or a page left out fails it
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

bench: $(STAMP)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev,hf,bench]'
	$(BIN)/python benchmarks/designer.py --quick
	$(BIN)/python benchmarks/runtime.py --quick
	$(BIN)/python benchmarks/pwl.py
	$(BIN)/python benchmarks/transformer_block.py --quick
	$(BIN)/python benchmarks/allocate.py
	$(BIN)/python benchmarks/compressed_layers.py --quick
	$(BIN)/python benchmarks/models.py --quick
	$(BIN)/python benchmarks/models.py --quick --precision bf16-autocast --policies fewbit3+msnorm llm
	$(BIN)/python benchmarks/llm_memory.py --quick --repeats 1
	$(BIN)/python benchmarks/lora_memory.py --quick --repeats 1
	$(BIN)/python benchmarks/convergence.py --quick
	$(BIN)/python benchmarks/convergence.py --quick --arch llama --variants llm --precision bf16-autocast
	$(BIN)/python benchmarks/convergence.py --quick --noise-floor --arch llama --precision bf16-autocast
	$(BIN)/python benchmarks/loss_accuracy.py --tokens 64 --seq 4
	$(BIN)/python benchmarks/gradient_bias.py --batches 4 --models llama
	$(BIN)/python benchmarks/norm_bytes.py
	$(BIN)/python benchmarks/liger_yardstick.py --models mini_llama3 --shrink 16 --seq 16

clean:
	rm -rf $(VENV) $(OUT) build *.egg-info
