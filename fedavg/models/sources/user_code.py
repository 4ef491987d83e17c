"""Models from your own code: ``package.module:function`` or ``path/to/file.py:function``.

The function is called as ``function(input_shape, num_classes, **args)`` and must return a
``torch.nn.Module``. A file is loaded on its own (once per process); a module is imported
as usual, so it must be importable (installed, or its folder on ``PYTHONPATH``).

Nodes of a deployment never import code named over the network: they build a user-code
model only when their operator started them with the same ``--model`` (see
:func:`fedavg.models.sources.node_model_name`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Mapping

from torch import nn

from fedavg.models.sources.args import DATA_ARGS, Takes, first_line
from fedavg.util.errors import UserError

_LOADED: dict[str, ModuleType] = {}


def code_ref(name: str) -> tuple[str, str, bool]:
    """Split ``module:function`` / ``file.py:function``: ``(module or path, function, is_file)``."""
    where, _, func = name.rpartition(":")
    if not where.strip():
        raise UserError(f"--model {name}: name the module or .py file before the colon, e.g. "
                        "my_models.py:build or my_package.models:build")
    if not func.isidentifier():
        raise UserError(f"--model {name}: name the builder function after the colon, e.g. "
                        "my_models.py:build or my_package.models:build")
    is_file = where.endswith(".py") or "/" in where or "\\" in where
    if not is_file and not all(part.isidentifier() for part in where.split(".")):
        raise UserError(f"--model {name}: {where!r} is neither a module (package.module) nor "
                        "a .py file")
    return where, func, is_file


def _failed(what: str, exc: BaseException) -> str:
    """Say that ``what`` (an import, a builder call) raised ``exc`` or called ``sys.exit``."""
    if isinstance(exc, SystemExit):
        return (f"{what} called sys.exit({exc.code!r}); model code must not exit (put script "
                "code under `if __name__ == \"__main__\":`)")
    return f"{what} failed: {first_line(exc)}"


def _import(where: str, is_file: bool, name: str) -> ModuleType:
    """Import the module of a ``module:function`` or ``file.py:function`` model (once)."""
    if not is_file:
        try:
            return importlib.import_module(where)
        except ModuleNotFoundError as exc:
            if exc.name and (where == exc.name or where.startswith(exc.name + ".")):
                raise UserError(f"the model is built by {name}, but module {where} is not "
                                "importable here: install it or add its folder to "
                                "PYTHONPATH") from None
            raise UserError(f"importing {where} (model {name}) failed: {first_line(exc)}") \
                from None
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's module raised
            raise UserError(_failed(f"importing {where} (model {name})", exc)) from None
    path = Path(where).expanduser().resolve()
    if path.is_dir():
        raise UserError(f"the model is built by {name}, but {path} is a folder: name the .py "
                        "file that holds the builder (--model FOLDER/FILE.py:FUNCTION)")
    if not path.is_file():
        raise UserError(f"the model is built by {name}, but {path} does not exist here: put "
                        "the file there, or pass --model with its path")
    stat = path.stat()  # a file edited since (in a notebook) is imported anew
    key = f"{path}:{stat.st_mtime_ns}:{stat.st_size}"
    if key not in _LOADED:
        module_name = f"_fedavg_user_{path.stem}_{hashlib.sha1(key.encode()).hexdigest()[:8]}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise UserError(f"the model is built by {name}, but {path} is not a Python file "
                            "(a .py file with the builder function)")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # classes defined in it resolve their module
        if str(path.parent) not in sys.path:  # its own modules beside it import, as with
            sys.path.append(str(path.parent))  # `python file.py` (last: none shadows ours)
        try:
            spec.loader.exec_module(module)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - SyntaxError ... in user code
            del sys.modules[module_name]
            raise UserError(_failed(f"importing {path} (model {name})", exc)) from None
        _LOADED[key] = module
    return _LOADED[key]


def user_builder(name: str) -> Callable[..., nn.Module]:
    """Import and return the builder function of a ``module:function`` / ``file.py:function``.

    Raises
    ------
    UserError
        A module that does not import, a file that is not there, or no such function.
    """
    where, func, is_file = code_ref(name)
    module = _import(where, is_file, name)
    fn = getattr(module, func, None)
    if fn is None:
        defined = sorted(k for k, v in vars(module).items()
                         if callable(v) and not k.startswith("_"))
        listed = ", ".join(defined[:8]) + (f" and {len(defined) - 8} more"
                                            if len(defined) > 8 else "")
        raise UserError(f"{where} has no function {func!r} (model {name}); it defines: "
                        f"{listed or 'nothing callable'}")
    if not callable(fn):
        raise UserError(f"model {name}: {func} is a {type(fn).__name__}, not a function")
    return fn


def build_user(name: str, input_shape: tuple[int, ...], num_classes: int,
               args: Mapping[str, Any]) -> nn.Module:
    """Call your builder: ``function(input_shape, num_classes, **args)``.

    Raises
    ------
    UserError
        See :func:`user_builder`; arguments it does not take; the builder raised; it
        returned something other than a ``torch.nn.Module``; or its lazy modules
        (``nn.LazyLinear`` ...) fail on a ``(2, *input_shape)`` batch.
    """
    fn = user_builder(name)
    kwargs = Takes.of(fn, f"{name}").kwargs(name, args)
    try:
        net = fn(tuple(input_shape), int(num_classes), **kwargs)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's builder raised
        raise UserError(_failed(f"{name}{(tuple(input_shape), int(num_classes))}", exc)) \
            from None
    if not isinstance(net, nn.Module):
        kind = type(net).__name__
        article = "an" if kind[:1].lower() in "aeiou" else "a"
        raise UserError(f"{name} returned {article} {kind}, not a torch.nn.Module")
    if any(isinstance(p, nn.parameter.UninitializedParameter) for p in net.parameters()):
        _materialize(net, name, tuple(input_shape), text=DATA_ARGS[0] in args)
    return net


def _materialize(net: nn.Module, name: str, input_shape: tuple[int, ...], text: bool) -> None:
    """Give lazy modules (``nn.LazyLinear`` ...) their shapes with one batch of zeros.

    A model's weights are sent, merged and saved by name and shape, which a lazy module has
    only after its first forward pass.
    """
    import torch

    was = net.training
    net.eval()
    try:
        with torch.no_grad():
            net(torch.zeros(2, *input_shape, dtype=torch.int64 if text else torch.float32))
    except Exception as exc:  # noqa: BLE001 - the user's model cannot take the data
        raise UserError(f"{name}: its lazy modules fail on a batch of shape "
                        f"{(2, *input_shape)}: {first_line(exc)}") from None
    finally:
        net.train(was)
