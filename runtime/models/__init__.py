"""Models to profile: transformers architectures from a config (random weights, nothing
downloaded), or the user's own builder; and random inputs of a given shape for either.

A model name is one of:
- a built-in config: `gpt2`, `llama`, ... (BUILTIN);
- a local Hugging Face model directory, or its `config.json`: the architecture it names, built
  from the config alone (any weights there are not loaded);
- `hf:<repo id>`: the config of a Hub model, from the local Hub cache only;
- `timm:<name>` or `torchvision:<name>`: an image classifier of timm or torchvision, built
  with random weights (never downloaded);
- `package.module:function` or `path/to/file.py:function`: a builder, called with no arguments,
  returning a model or a (model, make_batch) pair where `make_batch(batch, seq)` returns the
  model's inputs: a tensor, a tuple of positional arguments or a dict of keyword arguments.
  The current directory is importable, as with `python -m`.
transformers, timm and torchvision models need no make_batch: their inputs follow from the
config or the name. An image model's images are `image_size` pixels square when given, else
the config's (timm's) own size, else 224. Remote code is never run (`trust_remote_code` stays
off).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path

import torch

from actdesign.errors import ActdesignError

from .batches import call as call  # every batch form, read one way (models.batches)
from .batches import loss_of as loss_of

# name -> (config class, model class, config arguments); "-tiny" variants: 2 layers, d=64.
_TINY = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
         "intermediate_size": 256}
BUILTIN = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}),
    "gpt2-tiny": ("GPT2Config", "GPT2LMHeadModel",
                  {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512,
                   "n_positions": 1024, "bos_token_id": 0, "eos_token_id": 0}),
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              {"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12,
               "num_key_value_heads": 12, "intermediate_size": 2048, "vocab_size": 32000}),
    "llama-tiny": ("LlamaConfig", "LlamaForCausalLM",
                   _TINY | {"num_key_value_heads": 2, "vocab_size": 512}),
    "llama-1b": ("LlamaConfig", "LlamaForCausalLM",  # TinyLlama-1.1B's shape
                 {"num_hidden_layers": 22, "hidden_size": 2048, "num_attention_heads": 32,
                  "num_key_value_heads": 4, "intermediate_size": 5632, "vocab_size": 32000,
                  "max_position_embeddings": 4096}),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                {"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12,
                 "num_key_value_heads": 4, "intermediate_size": 2048, "vocab_size": 32000}),
    "mistral-tiny": ("MistralConfig", "MistralForCausalLM",
                     _TINY | {"num_key_value_heads": 2, "vocab_size": 512}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              {"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12,
               "num_key_value_heads": 2, "intermediate_size": 2048, "vocab_size": 151936,
               "tie_word_embeddings": True}),
    "qwen2-tiny": ("Qwen2Config", "Qwen2ForCausalLM",
                   _TINY | {"num_key_value_heads": 2, "vocab_size": 512,
                            "tie_word_embeddings": True}),
    "bert": ("BertConfig", "BertForMaskedLM", {}),
    "bert-tiny": ("BertConfig", "BertForMaskedLM", _TINY | {"vocab_size": 512}),
    "vit": ("ViTConfig", "ViTForImageClassification", {"num_labels": 1000}),
    "vit-tiny": ("ViTConfig", "ViTForImageClassification",
                 _TINY | {"image_size": 32, "patch_size": 8, "num_labels": 10}),
}


# image classifiers by library and name, built with random weights; images 224 pixels square
# where neither the caller nor the model says otherwise
VISION_LIBRARIES = ("timm", "torchvision")
IMAGE_SIZE = 224


def config_of(name: str, image_size: int | None = None):
    """The transformers config a model name gives (a built-in, a local directory or config.json,
    `hf:<repo id>`), an image model's at `image_size` (`sized`); None for a `module:function`
    builder or a timm or torchvision name."""
    if name in BUILTIN:
        transformers = require_transformers(name)
        config_cls, _, args = BUILTIN[name]
        return sized(name, getattr(transformers, config_cls)(**args), image_size)
    if name.startswith("hf:"):
        return sized(name, _hub_config(name, name.removeprefix("hf:")), image_size)
    path = Path(name)
    if path.is_dir() or (path.suffix == ".json" and path.is_file()):
        return sized(name, _local_config(name, path), image_size)
    if ":" in name:
        return None
    if _looks_like_a_path(name):
        what = "file" if name.endswith(".json") else "directory"
        raise ActdesignError(f"model {name!r}: no such {what}; give a local model directory "
                             "or its config.json")
    hint = f"; for a Hub model, write hf:{name}" if name.count("/") == 1 else ""
    raise ActdesignError(f"unknown model {name!r}: use a built-in ({', '.join(BUILTIN)}), a "
                         "local model directory or config.json, hf:<repo id>, "
                         "timm:<name>, torchvision:<name>, "
                         f"package.module:function or file.py:function{hint}")


def sized(name: str, config, image_size: int | None):
    """`config`, an image model's (one with `num_channels`) set to take images `image_size`
    pixels square, else its own size, else IMAGE_SIZE; a text model's refuses an image size."""
    if not hasattr(config, "num_channels"):
        if image_size is not None:
            raise ActdesignError(f"model {name!r} reads text, not images: an image size is for "
                                 "image models (give a sequence length)")
        return config
    config.image_size = image_size or getattr(config, "image_size", None) or IMAGE_SIZE
    return config


def is_vision_name(name) -> bool:
    """A `timm:<name>` or `torchvision:<name>` model name."""
    return isinstance(name, str) and name.partition(":")[0] in VISION_LIBRARIES \
        and ":" in name


def vision_model(name: str, image_size: int | None = None):
    """(the image classifier `timm:<name>` or `torchvision:<name>` names, with random weights;
    make_batch(batch, seq) -> a batch of random images, `image_size` pixels square (timm's
    model's own size, else IMAGE_SIZE, when not given); `seq` is not read)."""
    library, _, arch = name.partition(":")
    try:
        lib = importlib.import_module(library)
    except ImportError:
        raise ActdesignError(f"model {name!r} needs {library}: pip install "
                             "'actdesign[vision]'") from None
    if library == "timm":
        if arch not in lib.list_models():
            raise ActdesignError(f"model {name!r}: timm has no model {arch!r} "
                                 "(timm.list_models() lists them)")
        model = lib.create_model(arch, pretrained=False)
        own = (getattr(model, "pretrained_cfg", None) or {}).get("input_size")
    else:
        if arch not in lib.models.list_models(module=lib.models):
            raise ActdesignError(f"model {name!r}: torchvision has no image classifier "
                                 f"{arch!r} (torchvision.models.list_models(module="
                                 "torchvision.models) lists them)")
        model = lib.models.get_model(arch, weights=None)
        own = None
    side = image_size or (own[-1] if own else IMAGE_SIZE)

    def make_batch(batch, seq):
        return torch.randn(batch, 3, side, side)

    make_batch.image_size = side
    return model, make_batch


def _looks_like_a_path(name: str) -> bool:
    """A name written as a path (absolute, relative with ./ or ../, in the home, or a .json
    file), not as a Hub repo id (owner/name)."""
    return name.startswith(("/", "./", "../", "~", ".\\")) or name.endswith(".json") \
        or name.count("/") > 1


def build(name: str, seed: int = 0, say=None, device=None, image_size: int | None = None):
    """(model, make_batch or None) for a model name (see the module's docstring); a config
    builds its architecture with random weights, on `device` when given (a billion weights
    initialise far faster on a GPU). An image model takes images `image_size` pixels square
    (see `sized`). `say(message)`, when given, hears when the name is resolved and building
    starts."""
    torch.manual_seed(seed)
    if is_vision_name(name):
        if say is not None:
            say(f"building {name}")
        return vision_model(name, image_size)
    config = config_of(name, image_size)
    builder = load_callable(name, "model") if config is None else None
    if builder is not None and image_size is not None:
        raise ActdesignError(f"model {name!r}: a builder's make_batch makes its own inputs; "
                             "an image size is for transformers, timm and torchvision models")
    if say is not None:
        say(f"building {name}")
    if config is not None:
        with torch.device(device) if device is not None else contextlib.nullcontext():
            return from_config(name, config), None
    made = builder()
    if isinstance(made, tuple) and len(made) == 2 and callable(made[1]):
        model, make_batch = made
    else:
        model, make_batch = made, None
    if not isinstance(model, torch.nn.Module):
        raise ActdesignError(f"{name} returned {type(model).__name__}, not a torch module")
    return model, make_batch


def require_transformers(name):
    try:
        import transformers
    except ImportError:
        raise ActdesignError(f"model {name!r} needs the transformers package: "
                             "pip install 'actdesign[hf]'") from None
    transformers.logging.set_verbosity_error()  # no advice about random-weight models
    return transformers


def _local_config(name, path: Path):
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ActdesignError(f"model {name!r}: no config.json in that directory; give a Hugging "
                             "Face model directory or its config.json")
    transformers = require_transformers(name)
    try:
        return transformers.AutoConfig.from_pretrained(str(file))
    except Exception as exc:  # noqa: BLE001  (transformers' validators raise their own types)
        raise ActdesignError(f"model {name!r}: cannot use {str(file)!r}: "
                             f"{reason(exc)}") from None


def reason(exc: BaseException) -> str:
    """The line of an exception that says what is wrong: the first of its innermost cause
    (a validator's, not the frame that wraps it; not the advice that follows it)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _hub_config(name, repo):
    if not repo:
        raise ActdesignError(f"model {name!r}: give a repo id, such as hf:gpt2")
    transformers = require_transformers(name)
    try:
        return transformers.AutoConfig.from_pretrained(repo, local_files_only=True)
    except OSError:
        raise ActdesignError(f"model {name!r}: its config is not in the local Hugging Face cache; "
                             f"fetch it once online with `hf download {repo} config.json`, or "
                             "give a local model directory") from None
    except Exception as exc:  # noqa: BLE001  (a type this transformers lacks, a bad config)
        raise ActdesignError(f"model {name!r}: cannot use its config (remote code is not "
                             f"run): {reason(exc)}") from None


# What sizes a causal LM's shape: a config file without one takes transformers' default.
_SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "intermediate_size", "vocab_size")


# Sizes a config may give before a model is built: past these, building alone would run
# for hours (a layer list of a billion) or sizes overflow torch's int64 shapes.
_COUNTS = {"num_hidden_layers": 4096, "num_experts": 4096, "num_local_experts": 4096}
_LARGEST = 2**31


def _check_sizes(name: str, config) -> None:
    """Each size an integer in its bounds; a vision model's may be one per stage (a list)."""
    for key in (*_SHAPE_KEYS, *_COUNTS):
        value = getattr(config, key, None)
        if value is None:
            continue
        bound = _COUNTS.get(key, _LARGEST)
        values = value if isinstance(value, list | tuple) and value else [value]
        if not all(not isinstance(v, bool) and isinstance(v, int) and 1 <= v <= bound
                   for v in values):
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
            raise ActdesignError(f"model {name!r}: its config's {key} must be an integer from "
                                 f"1 to {bound:,} (or a list of them), got {shown}")


def defaulted(name: str, config) -> list[str]:
    """Warnings, one per key of `_SHAPE_KEYS` the architecture has but the config file of a
    local or hf: model leaves out, so that transformers' default sizes the model."""
    if name.startswith("hf:"):
        source = name.removeprefix("hf:")
    else:
        path = Path(name)
        source = path / "config.json" if path.is_dir() else path
        if name in BUILTIN or not source.is_file():
            return []  # a built-in's sizes are ours, each given
    try:  # the file as written, read from disk only (never the network)
        given, _ = type(config).get_config_dict(str(source), local_files_only=True)
    except Exception:  # noqa: BLE001  (nothing more to read)
        return []
    aliases = {v: k for k, v in getattr(config, "attribute_map", {}).items()}
    out = []
    for key in _SHAPE_KEYS:
        if key in given or aliases.get(key) in given or not hasattr(config, key):
            continue
        value = getattr(config, key)
        if value is None:
            continue
        out.append(f"{source} sets no {key}: transformers' default for "
                   f"{type(config).__name__}, {value}, is used")
    return out


def from_config(name, config):
    """The model class the name says (BUILTIN) or the config lists (`architectures`); else the
    causal LM for the config's type, else its bare model. A config its model refuses (a
    width that the heads do not divide, say) is refused in one line saying why."""
    transformers = require_transformers(name)
    if name in BUILTIN:
        build = getattr(transformers, BUILTIN[name][1])
    else:
        found = [getattr(transformers, arch, None)
                 for arch in getattr(config, "architectures", None) or ()]
        autos = [auto.from_config for auto in (transformers.AutoModelForCausalLM,
                                               transformers.AutoModelForImageClassification,
                                               transformers.AutoModel)
                 if type(config) in auto._model_mapping]
        build = next((c for c in found if c is not None), None) or next(iter(autos), None)
    if build is None:
        raise ActdesignError(f"model {name!r}: this transformers has no model for its config "
                             f"({type(config).__name__})")
    _check_sizes(name, config)
    try:
        return build(config)
    except Exception as exc:  # noqa: BLE001  (transformers' validators raise their own types)
        raise ActdesignError(f"model {name!r}: its config cannot build a model: "
                             f"{reason(exc)}") from None


def with_weights(name: str, model):
    """`model` with the trained weights of the local Hugging Face directory `name`, when it
    holds safetensors weights (no pickle is read); None otherwise."""
    path = Path(name)
    if not path.is_dir() or not any(path.glob("*.safetensors")):
        return None
    try:
        return type(model).from_pretrained(str(path), local_files_only=True,
                                           use_safetensors=True)
    except (OSError, ValueError) as exc:
        raise ActdesignError(f"model {name!r}: cannot load its weights: "
                             f"{str(exc).splitlines()[0]}") from None


def load_callable(ref: str, what: str):
    """The function named by `package.module:function` or `file.py:function`."""
    module_name, sep, attr = ref.rpartition(":")
    if not sep or not module_name or not attr.isidentifier():
        raise ActdesignError(f"{what} {ref!r}: expected package.module:function, "
                             "file.py:function or a built-in name")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ActdesignError(f"{what} {ref!r}: file {module_name!r} not found")
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules.setdefault(path.stem, module)
            spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:  # as `python -m` does
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ActdesignError(f"{what} {ref!r}: cannot import {module_name!r} ({exc})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ActdesignError(f"{what} {ref!r}: {module_name!r} has no function {attr!r}")
    return fn


def is_transformers(model) -> bool:
    return hasattr(model, "config") and type(model).__module__.startswith("transformers.")


def transformers_model(model):
    """The transformers model: `model` itself, or the one a PEFT model wraps; else None."""
    if is_transformers(model):
        return model
    inner = model.get_base_model() if type(model).__module__.startswith("peft.") \
        and hasattr(model, "get_base_model") else None
    return inner if inner is not None and is_transformers(inner) else None


def example_batch(model, batch: int, seq: int, make_batch=None, seed: int = 0):
    """Random inputs of the given shape, with labels where the model computes a loss (for a
    transformers model, or a PEFT model wrapping one)."""
    if make_batch is not None:
        return make_batch(batch, seq)
    outer, model = model, transformers_model(model)
    if model is None:
        raise ActdesignError(f"{type(outer).__name__} is not a transformers model: give its "
                             "inputs (example_inputs, or make_batch from the builder)")
    config = model.config
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    if model.main_input_name == "pixel_values":
        size = getattr(config, "image_size", None) or IMAGE_SIZE
        height, width = (size, size) if isinstance(size, int) else size
        inputs = {"pixel_values": torch.randn(batch, config.num_channels, height, width,
                                              generator=g)}
        if type(model).__name__.endswith("ForImageClassification"):
            inputs["labels"] = torch.randint(0, config.num_labels, (batch,), generator=g)
    else:
        ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
        inputs = {"input_ids": ids}
        if type(model).__name__.endswith(("LMHeadModel", "ForCausalLM", "ForMaskedLM")):
            inputs["labels"] = ids.clone()
    return {k: v.to(device) for k, v in inputs.items()}
