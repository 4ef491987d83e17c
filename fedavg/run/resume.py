"""Checkpoints for ``--resume``: everything a run needs to go on as if it had never stopped.

After every round the coordinator writes ``checkpoint.safetensors`` into the run folder,
atomically (temporary file + rename), so a run killed at any moment leaves the last
completed round as the current checkpoint. One file holds:

- ``model.<key>``: the global model after the round (what the next round starts from);
- ``strategy.<name>``: the strategy's tensors (server optimiser moments, ...);
- ``rng.torch``: the coordinator's torch random state;
- ``swa.<key>``: with ``--swa-start``, the weight average of the rounds' models so far;
- the metadata entry ``state``: JSON with the round, the run's settings, the strategy's
  other state, Python's random state (Flower samples nodes with it), the rounds' metrics
  and the failures so far.

Flower's own ``Strategy.start`` has no start round; the run goes on from the checkpoint by
starting Flower's loop at the checkpoint's model with the remaining rounds, the round numbers
offset (:class:`fedavg.run.flower_adapter.FlowerAdapter`'s ``round_offset``).
"""

from __future__ import annotations

import json
import random
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

import strategies
from fedavg.config.settings import RunConfig, node_settings_filled, resumable_settings
from fedavg.config.values import format_value
from fedavg.data.text import TOKENIZER_FILE
from fedavg.models.sources import absolute_name, names_same_code
from fedavg.run.checkpoint import storable, tensor_digest
from fedavg.run.lifecycle import RoundRecord
from fedavg.util.atomic import atomic_write
from fedavg.util.errors import UserError

CHECKPOINT = "checkpoint.safetensors"
FORMAT = "fedavg-checkpoint/1"

#: Settings a resumed run may change: those declared ``resumable`` in
#: :mod:`fedavg.config.settings` (:func:`~fedavg.config.settings.resumable_settings`).
MAY_CHANGE = resumable_settings()
#: Settings naming data: a local path among them is kept absolute, so a run resumes from
#: any folder.
_PATHS = ("dataset", "validation", "distill-data", "tokenizer")


def absolute_paths(flat: dict[str, Any]) -> dict[str, Any]:
    """Return flat settings with every local data path made absolute (others unchanged)."""
    out = dict(flat)
    for key in _PATHS:
        value = out.get(key)
        if isinstance(value, str) and value not in ("digits", "hashed") \
                and Path(value).expanduser().exists():
            out[key] = str(Path(value).expanduser().resolve())
    if isinstance(out.get("model"), str):  # a model file or hf: folder, likewise
        out["model"] = absolute_name(out["model"])
    return out


@dataclass
class Checkpoint:
    """The state of a run after its last completed round.

    Attributes
    ----------
    round : int
        Rounds completed (from 1).
    model : dict of str to torch.Tensor
        The global model after ``round``.
    config : dict
        The run's settings (:meth:`fedavg.config.settings.RunConfig.to_flat`).
    strategy : dict
        :meth:`strategies.Strategy.state` after ``round``.
    rounds : list of dict
        One :class:`fedavg.run.lifecycle.RoundRecord` dict per completed round.
    failures : list of str
        Node replies left out so far.
    python_random : list
        ``random.getstate()`` as JSON lists.
    torch_random : torch.Tensor
        ``torch.get_rng_state()``, ``(N,)`` uint8.
    node_states : dict of int to state dict
        By partition id, the node state of methods that keep one on their nodes (SCAFFOLD's
        control variates, FedDyn's gradients, MOON's previous models), in simulation.
    swa : dict of str to torch.Tensor
        With ``--swa-start``: the exact weight average so far
        (:meth:`strategies.swa.WeightAverage.state`, float64) of
        :func:`averaged_rounds` models; empty before it starts.
    """

    round: int
    model: dict[str, torch.Tensor]
    config: dict[str, Any]
    strategy: dict[str, Any] = field(default_factory=dict)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    python_random: list = field(default_factory=list)
    torch_random: torch.Tensor | None = None
    node_states: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    swa: dict[str, torch.Tensor] = field(default_factory=dict)

    def run_config(self) -> RunConfig:
        """Return the checkpoint's settings as a :class:`~fedavg.config.settings.RunConfig`."""
        return RunConfig.from_flat(self.config)

    def restore_random(self) -> None:
        """Put Python's and torch's random generators back as they were after ``round``."""
        if self.python_random:
            version, internal, gauss = self.python_random
            random.setstate((version, tuple(internal), gauss))
        if self.torch_random is not None:
            torch.set_rng_state(self.torch_random)


def capture(round_: int, model: dict[str, torch.Tensor], config: RunConfig, strategy,
            rounds: list[dict[str, Any]], failures: list[str],
            node_states: dict[int, dict[str, torch.Tensor]] | None = None,
            swa=None) -> Checkpoint:
    """Take a checkpoint of the run now (the random states are read here).

    ``swa`` is the run's :class:`strategies.swa.WeightAverage` (``--swa-start``) or ``None``.
    """
    version, internal, gauss = random.getstate()
    return Checkpoint(round=round_, model=model, config=absolute_paths(config.to_flat()),
                      strategy=strategy.state(), rounds=list(rounds), failures=list(failures),
                      python_random=[version, list(internal), gauss],
                      torch_random=torch.get_rng_state(), node_states=dict(node_states or {}),
                      swa={} if swa is None else swa.state())


def save(folder: str | Path, ckpt: Checkpoint) -> Path:
    """Write ``folder/checkpoint.safetensors`` atomically; return its path."""
    from safetensors.torch import save_file

    tensors = {f"model.{k}": v for k, v in storable(ckpt.model).items()}
    plain = {}
    for name, value in ckpt.strategy.items():
        if isinstance(value, torch.Tensor):
            tensors[f"strategy.{name}"] = value.detach().cpu().contiguous()
        else:
            plain[name] = value
    if ckpt.torch_random is not None:
        tensors["rng.torch"] = ckpt.torch_random
    for pid, node in sorted(ckpt.node_states.items()):
        for name, value in storable(node).items():
            tensors[f"node.{pid}.{name}"] = value
    for name, value in ckpt.swa.items():
        tensors[f"swa.{name}"] = value.detach().cpu().contiguous()
    state = {"round": ckpt.round, "config": ckpt.config, "strategy": plain,
             "rounds": ckpt.rounds, "failures": ckpt.failures,
             "python_random": ckpt.python_random}
    path = Path(folder) / CHECKPOINT
    meta = {"format": FORMAT, "state": json.dumps(state)}
    meta["sha256"] = tensor_digest(tensors, meta["state"])
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=meta))
    return path


def _not_a_run(folder: Path) -> str:
    """Why ``folder`` has no checkpoint, for :func:`load`'s error: a sweep's folder says so."""
    try:  # fedavg.sweeps.plan.RECORD
        config = json.loads((folder / "sweep.json").read_text()).get("config") or "CONFIG"
    except (OSError, ValueError, AttributeError):
        return "no round finished, or not a fedavg run folder"
    command = shlex.join(["fedavg", "sweep", str(config), "--output", str(folder)])
    return f"a sweep's folder: `{command}` goes on with its points"


def load(folder: str | Path) -> Checkpoint:
    """Read the checkpoint of the run in ``folder``.

    Raises
    ------
    UserError
        No such folder or checkpoint, or a file that is not a readable fedavg checkpoint.
    """
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    path = folder / CHECKPOINT
    if folder.is_file():
        raise UserError(f"--resume {folder} is a file; pass the run's folder")
    if not folder.is_dir():
        raise UserError(f"--resume {folder}: no such folder (pass a run's output folder)")
    if not path.is_file():
        raise UserError(f"--resume {folder}: no {CHECKPOINT} in it ({_not_a_run(folder)})")
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
        # checkpoints written before the checksum existed have none to check
        if "sha256" in meta and meta["sha256"] != tensor_digest(tensors, meta["state"]):
            raise ValueError("its contents do not match its SHA-256 checksum")
        state = json.loads(meta["state"])
        ckpt = _from_parts(state, tensors)
    except (SafetensorError, OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise UserError(f"{path} is damaged ({str(exc).splitlines()[0][:120]}); resume from "
                        "another copy or start a new run") from None
    except UserError as exc:  # settings that no longer pass
        raise UserError(f"{path} is damaged: its settings: {exc}") from None
    return ckpt


def _from_parts(state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Checkpoint:
    def group(prefix: str) -> dict[str, torch.Tensor]:
        return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}

    if not isinstance(state["round"], int) or isinstance(state["round"], bool):
        raise ValueError(f"round {state['round']!r} is not a whole number")
    if not isinstance(state["failures"], list) or \
            not all(isinstance(f, str) for f in state["failures"]):
        raise ValueError("'failures' is not a list of lines")
    if not isinstance(state["rounds"], list) or not all(isinstance(r, dict)
                                                        for r in state["rounds"]):
        raise ValueError("'rounds' is not a list of round records")
    records = [RoundRecord(**r).as_dict() for r in state["rounds"]]  # TypeError if not
    ckpt = Checkpoint(round=state["round"], model=group("model."),
                      config=dict(state["config"]),
                      strategy={**dict(state["strategy"]), **group("strategy.")},
                      rounds=records, failures=state["failures"],
                      python_random=list(state["python_random"]),
                      torch_random=tensors.get("rng.torch"), node_states=_node_states(tensors),
                      swa=group("swa."))
    if ckpt.round < 1 or len(ckpt.rounds) != ckpt.round or not ckpt.model:
        raise ValueError(f"round {ckpt.round} with {len(ckpt.rounds)} round records")
    _check_random(ckpt)
    start = ckpt.run_config().validate().merge.swa_start
    count = averaged_rounds(start, ckpt.round)
    if bool(ckpt.swa) != (count > 0):
        raise ValueError(f"a weight average in {len(ckpt.swa)} tensors where --swa-start "
                         f"{start} after round {ckpt.round} averages {count} models")
    return ckpt


def averaged_rounds(swa_start: int | None, round_: int) -> int:
    """Return how many rounds' models ``--swa-start`` has averaged after ``round_`` (0: none)."""
    return 0 if swa_start is None else max(0, round_ - swa_start + 1)


def _node_states(tensors: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """Group ``node.<partition>.<name>`` tensors by partition; ``ValueError`` if malformed."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("node."):
            pid, _, name = key[len("node."):].partition(".")
            if not pid.isdigit() or not name:
                raise ValueError(f"tensor {key!r} is not node.<partition>.<name>")
            out.setdefault(int(pid), {})[name] = value
    return out


def _check_random(ckpt: Checkpoint) -> None:
    """Raise ``ValueError`` unless both random states can be restored."""
    try:
        version, internal, gauss = ckpt.python_random
        random.Random().setstate((version, tuple(internal), gauss))
        if ckpt.torch_random is None:
            raise ValueError("no torch random state")
        torch.Generator().set_state(ckpt.torch_random)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"bad random state: {str(exc).splitlines()[0][:80]}") from None


def model_mismatch(model: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> str | None:
    """Say how the checkpoint's ``saved`` weights do not fit ``model``, or return ``None``."""
    missing, extra = sorted(set(model) - set(saved)), sorted(set(saved) - set(model))
    if missing or extra:
        return f"tensors missing {missing[:3]}, unexpected {extra[:3]}"
    for key, t in model.items():
        s = saved[key]
        if tuple(s.shape) != tuple(t.shape) or s.dtype != t.dtype:
            return (f"tensor {key!r} is {tuple(s.shape)} {s.dtype}, the model's is "
                    f"{tuple(t.shape)} {t.dtype}")
    bad = strategies.first_non_finite(saved)
    return None if bad is None else f"tensor {bad!r} holds NaN or infinite values"


def write_metrics(path: Path, rounds: list[dict[str, Any]]) -> None:
    """Rewrite ``metrics.jsonl`` with the checkpoint's rounds (dropping any later line)."""

    def _write(tmp: str) -> None:
        with open(tmp, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rounds)

    atomic_write(path, _write)


def _option_defaults(flat: dict[str, Any]) -> dict[str, Any]:
    """Return ``flat`` with unset strategy options and node settings at the run's values.

    Those are the strategy's defaults, else the settings' own.
    """
    defaults = strategies.option_defaults(flat.get("strategy"))
    given = {k.replace("-", "_"): v for k, v in flat.items()}
    filled = node_settings_filled(given, flat.get("strategy"))
    return {**{k.replace("_", "-"): v for k, v in defaults.items()}, **flat,
            **{k.replace("_", "-"): v for k, v in filled.items()}}


def resumed_config(ckpt: Checkpoint, config: RunConfig | None, where: str,
                   may_change: Iterable[str] = MAY_CHANGE) -> RunConfig:
    """Return the settings a resumed run goes on with, checked against the checkpoint.

    ``--tokenizer`` naming the run folder's copy of its tokenizer file (``tokenizer.json``)
    is the run's tokenizer (the original may have moved or changed).

    Parameters
    ----------
    ckpt : Checkpoint
        The run's checkpoint.
    config : RunConfig, optional
        The settings asked for; ``None`` takes the checkpoint's.
    where : str
        The run folder, for messages.
    may_change : iterable of str
        Kebab-case settings allowed to differ from the checkpoint's.

    Raises
    ------
    UserError
        A setting other than ``may_change`` differs (naming it and both values), the
        run's tokenizer file is gone (naming its copy), or the
        rounds asked for are already done (a run stopped after its last round but before
        its ``summary.json`` is not: resuming it with the same rounds finishes it).
    """
    config = ckpt.run_config() if config is None else config
    # a setting newer than the checkpoint is the default there: the behaviour it had then
    saved = _option_defaults(absolute_paths(ckpt.run_config().to_flat()))
    asked = _option_defaults(absolute_paths(config.to_flat()))
    allowed = set(may_change)

    own = Path(where) / TOKENIZER_FILE  # the run's copy of its tokenizer file: the same
    if own.is_file() and asked.get("tokenizer") == str(own.resolve()):  # file (SHA-256
        asked["tokenizer"] = saved.get("tokenizer")  # checked), with which it goes on

    if isinstance(asked.get("model"), str) and isinstance(saved.get("model"), str) and \
            names_same_code(asked["model"], saved["model"]):
        allowed.add("model")  # the run's own code file, moved: the same file name, function
    for key in sorted(set(saved) | set(asked), key=lambda k: (k != "strategy", k)):
        if key not in allowed and saved.get(key) != asked.get(key):
            missing = key in _PATHS and isinstance(saved.get(key), str) and \
                saved[key].startswith("/") and not Path(saved[key]).exists()
            hint = (f"; the run's {saved[key]} is gone: put it back there" if missing else
                    f"; {_changeable(may_change)}: start a new run with another --output for "
                    "other settings")
            flag = "model-arg" if key == "model-args" else key  # the option's own name
            given = (f"--{flag} {format_value(asked[key])}" if asked.get(key) is not None
                     else f"leaving out --{flag}")
            had = (f"the run's {format_value(saved[key])}" if saved.get(key) is not None
                   else f"the run, which had no --{flag}")
            raise UserError(f"--resume {where}: {given} differs from {had}{hint}")
    # every round done but no summary.json (stopped while finishing), or one that does not
    # read (cut short): the resume finishes it
    try:
        finished = isinstance(json.loads((Path(where) / "summary.json").read_text()), dict)
    except (OSError, ValueError):
        finished = False
    if config.merge.rounds < ckpt.round or (config.merge.rounds == ckpt.round and finished):
        least = (f"> {ckpt.round} to train longer" if finished else
                 f">= {ckpt.round} ({ckpt.round} finishes it there, more trains longer)")
        raise UserError(f"--resume {where}: the run has finished {ckpt.round} round(s); pass "
                        f"--rounds N with N {least}")
    path = Path(config.data.tokenizer).expanduser()
    if config.data.tokenizer != "hashed" and own.is_file() and not path.exists():
        raise UserError(f"--resume {where}: the run's tokenizer {path} is gone: copy "
                        f"{own} (the run's copy) there, or pass --tokenizer {own}")
    return config


def resume_command(argv: list[str], output: Path, drop: Iterable[str] = ()) -> str:
    """Return the command that resumes an interrupted run: ``argv`` with ``--resume OUTPUT``.

    ``--output`` and ``--overwrite`` are dropped (the run folder is the resumed one), and so
    are the options in ``drop`` with their values (each an option of :data:`MAY_CHANGE`);
    the other options stay, since settings equal to the run's are accepted.
    """
    valued = ("--output", "--resume", *drop)
    args, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in valued:
            skip = True
            continue
        if arg == "--overwrite" or arg.startswith(tuple(f"{v}=" for v in valued)):
            continue
        args.append(arg)
    return shlex.join(["fedavg", *args, "--resume", str(output)])


def resolve_settings(config: RunConfig | None, overrides: dict[str, Any],
                     resume: str | Path | None, output: str | Path | None, may_change=None,
                     overwrite: bool = False):
    """Return ``(config, checkpoint, output)`` of a new run, or of one continued with ``--resume``.

    Parameters
    ----------
    config : RunConfig, optional
        Settings asked for; ``None``: the defaults, or the checkpoint's when resuming.
    overrides : dict
        Flat settings applied on top (``rounds=20``).
    resume : path, optional
        The interrupted run's folder (holding ``checkpoint.safetensors``); ``None`` for a
        new run (the checkpoint returned is then ``None``).
    output : path, optional
        When resuming, ``resume`` itself or ``None``: a resumed run writes into its folder.
    may_change : iterable of str, optional
        Kebab-case settings that may differ from the checkpoint's (default
        :data:`MAY_CHANGE`).
    overwrite : bool
        ``--overwrite`` was asked for: refused with ``resume``.

    Raises
    ------
    UserError
        No readable checkpoint, another ``output``, ``overwrite``, a setting that differs,
        or no round left to run.
    """
    if resume is None:
        return (RunConfig() if config is None else config).replace(**overrides), None, output
    folder = Path(resume)
    if overwrite:
        raise UserError(f"--resume {folder} goes on with the run in that folder; drop "
                        "--overwrite (or start a new run with --output)")
    ckpt = load(folder)
    if output is not None and Path(output).resolve() != folder.resolve():
        raise UserError(f"--resume {folder} goes on in that folder; drop --output {output}")
    base = (ckpt.run_config() if config is None else config).replace(**overrides)
    config = resumed_config(ckpt, base, str(folder),
                                     MAY_CHANGE if may_change is None else may_change)
    return config, ckpt, folder


def _changeable(may_change: Iterable[str]) -> str:
    """Say which settings may change: ``only --rounds (and --device, ...) may change``."""
    flags = sorted((f"--{k}" for k in may_change if k != "num-nodes"),
                   key=lambda flag: (flag != "--rounds", flag))
    rest = f" (and {', '.join(flags[1:])})" if len(flags) > 1 else ""
    return f"only {flags[0]}{rest} may change"
