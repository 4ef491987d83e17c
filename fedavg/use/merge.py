"""``fedavg merge``: merge saved models offline with any registered strategy."""

from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path
from typing import Any, Sequence

import strategies
from fedavg.config.settings import RunConfig
from fedavg.data.held_out import saved_merge_samples, unused_data
from fedavg.data.text import model_tokenizer
from fedavg.models.registry import ModelSpec
from fedavg.models.sources import saved_model_name
from fedavg.run import checkpoint
from fedavg.run.lifecycle import check_output, make_output
from fedavg.run.merge_context import merge_context
from fedavg.run.output import clear_previous_run, release_output, remove_if_empty
from fedavg.use.inference import evaluation_data, load_model, score
from fedavg.util.errors import UserError
from strategies import MergeError
from strategies.fedavg import check_weight


def model_dirs(paths: Sequence[str | Path]) -> list[Path]:
    """Expand inputs: a model folder, or a folder of model folders (e.g. a run's ``nodes/``).

    Raises
    ------
    UserError
        A missing path, a folder holding no model, a model given twice (say, as a folder and
        inside a folder of models), or a single model.
    TypeError
        ``paths`` is a single path, not a list.
    """
    if isinstance(paths, (str, Path)):
        raise TypeError(f"models must be a list of model folders, got the single {paths!r}: "
                        f"pass [{str(paths)!r}]")
    if not isinstance(paths, (list, tuple)) or not all(
            isinstance(p, (str, os.PathLike)) for p in paths):
        raise TypeError(f"models must be a list of model folders, got {paths!r}")
    found: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if not path.is_dir():
            raise UserError(f"{raw} is a file, not a model folder: pass its folder"
                            if path.is_file() else f"no such model folder: {raw}")
        if (path / checkpoint.WEIGHTS).exists():
            found.append(path)
            continue
        inner = sorted(p.parent for p in path.glob(f"*/{checkpoint.WEIGHTS}"))
        if not inner:
            raise UserError(f"{raw} holds no model.safetensors (nor do its subfolders)")
        found.extend(inner)
    if not found:
        raise UserError("no models to merge: pass model folders")
    seen: dict[Any, Path] = {}
    for path in found:
        if path.resolve() in seen:
            raise UserError(f"{path} is given twice (also as {seen[path.resolve()]}); a model "
                            "given twice would count twice: pass each model once")
        seen[path.resolve()] = path
        digest = _digest(path / checkpoint.WEIGHTS)  # a copy, or a link inside a folder
        if digest in seen:
            raise UserError(f"{path} holds the same weights as {seen[digest]} (a copy?); a model "
                            "given twice would count twice: pass each model once")
        seen[digest] = path
    if len(found) == 1:
        raise UserError(f"one model found ({found[0]}); a merge needs two or more: pass several "
                        "model folders, or a run's nodes/ folder (--save-node-models)")
    return found


def _digest(path: Path) -> str:
    """SHA-256 of a file (a file that cannot be read: its own key)."""
    import hashlib

    try:
        with open(path, "rb") as fh:
            return hashlib.file_digest(fh, "sha256").hexdigest()
    except OSError:
        return f"unreadable {path}"


def merge_models(
    models: Sequence[str | Path],
    output: str | Path,
    config: RunConfig | None = None,
    *,
    dataset: str | None = None,
    overwrite: bool = False,
    model: str | None = None,
    start: str | Path | None = None,
) -> dict[str, Any]:
    """Merge saved single models (e.g. a run's ``nodes/*``) into one artifact in ``output``.

    Parameters
    ----------
    models : sequence of path
        Model folders, or folders of model folders.
    output : path
        Where the merged artifact goes (``model.safetensors``, ``model.json``, ``summary.json``).
    config : RunConfig
        ``merge.strategy`` and its options; ``merge.validation`` / ``merge.distill_data``
        name the held-out and unlabeled datasets for data-driven strategies.
    dataset : str, optional
        Evaluate the merged model on this dataset's test split.
    overwrite : bool
        Allow ``output`` to hold a previous run or merge, whose files are replaced.
    model : str, optional
        For models built by your code: that code (``file.py:function``, the file where it
        is now, or ``module:function``); saved models never make fedavg import code.
    start : path, optional
        For the task-vector strategies (``task-arithmetic``, ``ties``, ``dare``,
        ``dare-ties``): the model folder every merged model started from. Default: the
        ``start/`` folder a ``--save-node-models`` run keeps beside its ``nodes/``.

    Returns
    -------
    dict
        ``num_models``, ``strategy``, ``wall_s``, ``members`` (the folders a greedy soup or
        Krum kept), ``notes`` (if any) and, with ``dataset``, ``accuracy`` and ``loss``.

    Raises
    ------
    UserError
        Missing, damaged, repeated (the same weights twice) or unlike models (architecture,
        classes, input statistics, node models mixed with others); a strategy that lacks or
        does not use the data given, trains nodes or steps from a round's start (server
        optimisers); a task-vector strategy without a start model, or a start given to
        another strategy or unlike the models; a NaN/Inf merge; a
        bad ``dataset`` (checked first); an output folder that holds a run (without
        ``overwrite``), is an input or cannot be written; code ``model`` does not name.
    TypeError
        ``models`` is a single path, ``config`` is not a RunConfig, or ``overwrite`` not a
        bool.
    """
    t0 = time.monotonic()
    dirs, config, strategy = _one_merge(config, models)
    start_dir = _start_folder(strategy, dirs, start)
    out = _check_output(output, dirs + ([start_dir] if start_dir is not None else []),
                        overwrite)
    loaded = [checkpoint.load(d) for d in dirs]
    first = _check_alike(dirs, [meta for _, meta in loaded])
    name = saved_model_name(str(first["model"]["name"]), model, str(dirs[0]))
    start_model, start_notes = _start_model(start_dir, dirs[0], first, loaded)
    held = _test_data(first, dirs[0], dataset)  # a wrong --dataset: nothing merged or written
    validation, distill_x = _merge_data(config, strategy, first, dirs[0])
    merged = _merge(strategy, config, dirs, loaded, first, validation, distill_x, name,
                    start_model)
    meta = {**{k: v for k, v in first.items() if k not in _NOT_INHERITED},
            "strategy": config.merge.strategy, "merged_from": [str(d) for d in dirs],
            **({"start": str(start_dir)} if start_dir is not None else {})}
    with _output_folder(out, overwrite):  # made only now: a refused merge leaves none
        checkpoint.save_merged(out, merged, meta)
        result = _result(config.merge.strategy, len(dirs), merged.info,
                         _skipped(models, dirs) + start_notes
                         + _seed_notes([m for _, m in loaded], merged.is_ensemble, held)
                         + _privacy_notes(dirs, [m for _, m in loaded]))
        if held is not None:
            ev = score(load_model(out, model=model), held, device=config.train.device)
            notes = {"notes": result.get("notes", []) + ev["notes"]} if ev["notes"] else {}
            result.update(accuracy=ev["accuracy"], loss=ev["loss"], **notes)  # inputs resized
            meta["metrics"] = {"accuracy": ev["accuracy"], "loss": ev["loss"]}
            checkpoint.save_merged(out, merged, meta)
        result["wall_s"] = round(time.monotonic() - t0, 3)
        checkpoint.write_json(out / "summary.json", {**result, "merge_info": merged.info,
                                                     "models": [str(d) for d in dirs]})
    return result


@contextlib.contextmanager
def _output_folder(out: Path, overwrite: bool):
    """Hold ``out`` (made, locked: no run writes into it meanwhile) while a merge writes it.

    ``overwrite``: a previous run's files go first, as a whole. A folder made here goes
    again if the merge fails before writing into it (a full disk).
    """
    made = not out.exists()
    make_output(out, lock=True, overwrite=overwrite)
    try:
        if overwrite:
            clear_previous_run(out)
        yield
    except BaseException:
        if made:
            remove_if_empty(out)
        raise
    finally:
        release_output(out)


def _skipped(models: Sequence[str | Path], dirs: list[Path]) -> list[str]:
    """Name the subfolders of folders of models that hold no model (left out of the merge)."""
    empty = [sub for raw in models if not (Path(raw).expanduser() / checkpoint.WEIGHTS).exists()
             for sub in sorted(Path(raw).expanduser().iterdir())
             if sub.is_dir() and not sub.name.startswith(".") and sub not in dirs]
    return [f"left out {len(empty)} folder(s) without a model.safetensors: "
            f"{', '.join(map(str, empty[:5]))}{' ...' * (len(empty) > 5)}"] if empty else []


def _privacy_notes(dirs: list[Path], metas: list[dict[str, Any]]) -> list[str]:
    """Say that a merge of differentially private models states no epsilon of its own."""
    private = [str(d) for d, m in zip(dirs, metas) if isinstance(m.get("privacy"), dict)]
    if not private:
        return []
    return [f"{len(private)} of the {len(dirs)} models were trained with differential "
            f"privacy ({', '.join(private[:3])}{', ...' if len(private) > 3 else ''}); the "
            "merged model.json states no epsilon: models that trained on the same data add "
            "their epsilons, and one without DP has none"]


def _seed_notes(metas: list[dict[str, Any]], ensemble: bool, held) -> list[str]:
    """Say what merging models of runs with other ``--seed`` s means, if they differ.

    The seed picks a run's initial weights and its test hold-out: weights from other starts
    rarely average into a good model, and another member may have trained on the samples
    the merged model is scored on.
    """
    seeds = sorted({int(m.get("dataset", {}).get("seed", 0)) for m in metas})
    if len(seeds) < 2:
        return []
    runs = f"the models come from runs of seeds {', '.join(map(str, seeds))}"
    notes = [] if ensemble else [
        f"{runs}, which start from other initial weights: an average of such weights is "
        "rarely a good model (merge node models of one run, or use --strategy ensemble)"]
    if held is not None and any("held out" in n for n in held[1].notes):
        notes.append(f"{runs}, which hold out other test samples: some samples the merged "
                     "model is scored on trained another member, so its accuracy is optimistic")
    return notes


def _result(strategy: str, num_models: int, info: dict[str, Any],
            notes: list[str]) -> dict[str, Any]:
    """Return a merge's result before evaluation: its models, those it kept, its notes."""
    result: dict[str, Any] = {"num_models": num_models, "strategy": strategy}
    if (kept := info.get("members", info.get("selected_nodes"))) is not None:
        result["members"] = list(kept)  # a greedy soup's, Krum's: the models it kept
    notes = ([info["note"]] if info.get("note") else []) + notes  # a distillation: no gain
    if notes:
        result["notes"] = notes
    return result


def _test_data(first: dict[str, Any], folder: Path, dataset: str | None):
    """Load ``dataset``'s test split for the models, or ``None`` without one.

    See :func:`fedavg.use.inference.evaluation_data`.
    """
    if not dataset:
        return None
    if not isinstance(dataset, str):
        raise TypeError(f"dataset must be a name or path (str), got {dataset!r}")

    return evaluation_data(first, folder, dataset)


def _one_merge(config: Any, models: Sequence[str | Path]):
    """Return the model folders, ``config`` set for one merge of them all, and its strategy.

    Raises
    ------
    TypeError
        ``config`` is not a RunConfig; ``models`` a single path.
    UserError
        See :func:`model_dirs`; invalid settings; a strategy that changes node training.
    """
    if config is not None and not isinstance(config, RunConfig):
        raise TypeError(f"config must be a RunConfig, got {type(config).__name__}: "
                        "RunConfig().replace(strategy=..., ...)")
    dirs = model_dirs(models)  # one merge of every model given, with any method
    config = (config or RunConfig()).replace(rounds=1, num_nodes=len(dirs), fraction=1.0)
    strategy = config.validate().build_strategy()
    if strategy.trains_nodes:
        raise UserError(f"{strategy.name} changes how nodes train in every round; saved models "
                        "are merged with another strategy (fedavg, a soup, an ensemble)")
    if strategy.steps_from_start:
        raise UserError(f"{strategy.name} steps from a round's starting model (a server "
                        "optimiser), which saved models do not have; merge them with "
                        "another strategy (average, a soup, an ensemble)")
    if note := strategy.nodes_note(len(dirs)):  # a merge of models chosen for it: refused
        raise UserError(f"{strategy.name}: {note}; or merge more models")
    if unused := unused_data(config, strategy):
        raise UserError(f"{strategy.name} does not use {unused[0][0]}: leave it out (see "
                        "`fedavg strategies` for the strategies that use data)")
    return dirs, config, strategy


def _check_output(output: str | Path, dirs: list[Path], overwrite: bool) -> Path:
    """Return the output folder, refusing one that holds a run or an input (not created)."""
    if not isinstance(overwrite, bool):  # "no" would be true
        raise TypeError(f"overwrite must be bool, got {overwrite!r}")
    if not isinstance(output, (str, os.PathLike)):
        raise TypeError(f"output must be a folder path, got {output!r}")
    out = Path(output)
    if not str(output).strip():
        raise UserError("--output needs a folder name")
    resolved = out.expanduser().resolve()
    for d in dirs:
        if resolved == d.resolve() or d.resolve().is_relative_to(resolved):
            raise UserError(f"--output {out} holds the models being merged ({d}); choose "
                            "another folder")
    check_output(out, overwrite)
    return out


def _check_alike(dirs: list[Path], metas: list[dict[str, Any]]) -> dict[str, Any]:
    """Return the first model's metadata, once every model is a single network like it."""
    first = metas[0]
    for d, meta in zip(dirs, metas):
        if meta.get("kind") == "ensemble":
            raise UserError(f"{d} is an ensemble; merge its members' folders instead")
        for key in ("model", "classes"):
            if meta[key] != first[key]:
                raise UserError(f"{d} differs from {dirs[0]} in {key!r}: models must share "
                                "architecture, classes and input normalisation")
        n = min(int(m.get("dataset", {}).get("train_samples") or 0) for m in (meta, first))
        if problem := _input_difference(meta["input"], first["input"], max(
                INPUT_TOLERANCE, 3 / math.sqrt(n) if n else 0.0)):  # n unknown: the floor
            raise UserError(f"{d} differs from {dirs[0]} in its inputs: {problem}; models "
                            "trained on other data cannot be merged")
    return first


#: Input statistics that differ by less than this fraction of a standard deviation are
#: the same preparation (runs of one dataset with other seeds hold out other test samples);
#: for ``n`` train samples the bound is ``max(INPUT_TOLERANCE, 3 / sqrt(n))``, about three
#: standard errors, since a small table's statistics move more with its hold-out.
INPUT_TOLERANCE = 0.02


def _input_difference(a: dict[str, Any], b: dict[str, Any],
                      tolerance: float = INPUT_TOLERANCE) -> str | None:
    """Say how input spec ``a`` differs from ``b`` beyond ``tolerance``, or return ``None``.

    Per channel (or feature) means may differ by ``tolerance`` of ``b``'s standard
    deviation and standard deviations by that fraction of ``b``'s; all else must match.
    """
    import numpy as np

    stats = ("mean", "std")
    for key in sorted(set(a) | set(b)):
        if key not in stats and a.get(key) != b.get(key):
            return f"{key} {a.get(key)!r} against {b.get(key)!r}"
    if not all(k in a and k in b for k in stats):
        return None
    try:
        mean_a, mean_b, std_a, std_b = (np.asarray(v, dtype=np.float64) for v in
                                        (a["mean"], b["mean"], a["std"], b["std"]))
        far = (np.abs(mean_a - mean_b) > tolerance * std_b) \
            | (np.abs(std_a - std_b) > tolerance * std_b)
    except (TypeError, ValueError):  # other lengths or non-numbers: a damaged model.json
        return f"normalisation {a['mean']!r}/{a['std']!r} against {b['mean']!r}/{b['std']!r}"
    if far.any():
        i = int(np.argmax(far.reshape(-1)))
        return (f"mean/std of input {i} {mean_a.reshape(-1)[i]:.4g}/{std_a.reshape(-1)[i]:.4g} "
                f"against {mean_b.reshape(-1)[i]:.4g}/{std_b.reshape(-1)[i]:.4g}")
    return None


#: What a merged model's ``model.json`` does not take over from its first model's.
#: ``privacy``: a merge of models has no guarantee of its own (its inputs may have none, or
#: have trained on the same data, whose epsilons would add): :func:`_privacy_notes` says so.
_NOT_INHERITED = ("format", "kind", "node", "metrics", "member_weights", "members", "privacy")


def _merge_data(config: RunConfig, strategy, first: dict[str, Any], folder: Path):
    """Return the validation split and unlabeled inputs for a data-driven strategy.

    A text model's tokenizer comes from its ``folder`` (its ``tokenizer.json``).
    """
    tokenizer = model_tokenizer(first, folder)
    m = config.merge
    validation = distill_x = None
    lacking = [flag for flag, need, given in (
        ("--validation DATASET (held-out data)", strategy.needs_validation, m.validation),
        ("--distill-data DATASET (unlabeled inputs)", strategy.needs_unlabeled,
         m.distill_data)) if need and not given]
    if lacking:
        raise UserError(f"{m.strategy} needs data: pass {' and '.join(lacking)}")
    if strategy.needs_validation:
        validation = saved_merge_samples(m.validation, first, m.validation_fraction,
                                         tokenizer, held_out=True)
    if strategy.needs_unlabeled:
        distill_x = saved_merge_samples(m.distill_data, first, m.distill_fraction, tokenizer,
                                        unlabeled=True,
                                        validation_fraction=m.validation_fraction).x
    return validation, distill_x


def _start_folder(strategy, dirs: list[Path], start: str | Path | None) -> Path | None:
    """Return the folder of the model the merged models started from, for task vectors.

    Raises
    ------
    UserError
        A task-vector strategy without ``start`` whose models are not all node models of
        one run that kept its ``start/``; ``start`` given to another strategy.
    """
    if not strategy.needs_start:
        if start is not None:
            users = ", ".join(n for n, c in strategies.available().items() if c.needs_start)
            raise UserError(f"{strategy.name} does not use --start (only the task-vector "
                            f"strategies do: {users}): leave it out")
        return None
    if start is not None:
        return Path(start).expanduser()
    runs = {d.resolve().parent.parent for d in dirs}
    if len(runs) == 1 and (found := runs.pop() / checkpoint.START / checkpoint.WEIGHTS).is_file():
        return found.parent
    raise UserError(f"{strategy.name} merges task vectors (each model minus the model they all "
                    "started from): pass --start MODEL_FOLDER, or merge the nodes/ of one run "
                    "trained with --save-node-models, which keeps its start/")


def _start_model(start_dir: Path | None, first_dir: Path, first: dict[str, Any],
                 loaded: list) -> tuple[dict | None, list[str]]:
    """Load the start model, refusing one unlike the models merged; and notes on it.

    Raises
    ------
    UserError
        As :func:`_check_alike` (an ensemble; other architecture, classes or inputs), or
        other tensor shapes or dtypes than the merged models.
    """
    if start_dir is None:
        return None, []
    state, meta = checkpoint.load(start_dir)
    _check_alike([first_dir, start_dir], [first, meta])  # as the models match each other
    if problem := checkpoint.fit_problem(state, loaded[0][0]):
        raise UserError(f"--start {start_dir}/{checkpoint.WEIGHTS} does not fit the merged "
                        f"models: {problem}")
    for key, t in loaded[0][0].items():
        if state[key].dtype != t.dtype:
            raise UserError(f"--start {start_dir}: {key!r} is {state[key].dtype}, the merged "
                            f"models' is {t.dtype}; pass the start in the models' precision")
    return state, _start_notes(start_dir, meta, loaded)


def _start_notes(start_dir: Path, meta: dict[str, Any], loaded: list) -> list[str]:
    """Note a start that is not what the merged node models of one run started from."""
    rounds = {m.get("rounds") for _, m in loaded if isinstance(m.get("node"), dict)}
    seeds = {m.get("dataset", {}).get("seed") for _, m in loaded
             if isinstance(m.get("dataset"), dict)}
    notes = []
    if len(rounds) == 1 and isinstance(meta.get("rounds"), int) and \
            isinstance(r := next(iter(rounds)), int) and meta["rounds"] != r - 1:
        notes.append(f"the start {start_dir} is a model after round {meta['rounds']}, while "
                     f"the nodes trained in round {r} from the model after round {r - 1}: "
                     "their task vectors are measured from another point")
    own = meta.get("dataset", {}).get("seed") if isinstance(meta.get("dataset"), dict) else None
    if len(seeds) == 1 and own is not None and own not in seeds:
        notes.append(f"the start {start_dir} comes from a run of seed {own}, the models from seed "
                     f"{next(iter(seeds))}: is it the model they started from?")
    return notes


def _merge(strategy, config: RunConfig, dirs, loaded, first, validation, distill_x, name,
           start_model=None):
    import dataclasses

    import torch

    spec = dataclasses.replace(ModelSpec.from_dict(first["model"]), name=name)  # the code named
    weights = _weights(dirs, [meta for _, meta in loaded])
    try:
        with torch.device("meta"):  # shapes only: a tampered model.json allocates nothing
            model = spec.build()
    except UserError as exc:
        raise UserError(f"{dirs[0]}/{checkpoint.META}: {exc}") from None
    _check_fit(dirs, [sd for sd, _ in loaded], model.state_dict(), spec.name)
    extras = [_saved_extras(strategy, d, meta) for d, (_, meta) in zip(dirs, loaded)]
    buffers = frozenset(name for name, _ in model.named_buffers())
    context = merge_context(spec, first["input"], config.data.seed, validation, distill_x,
                            config.train.device)
    try:
        merged = strategy.merge([sd for sd, _ in loaded], weights, [str(d) for d in dirs],
                                reference=start_model, buffers=buffers, context=context,
                                arrays=extras if strategy.saved_extras else None)
    except strategies.MergeError as exc:
        raise UserError(str(exc)) from None
    for i, state in enumerate([merged.state_dict, *(merged.members or [])]):
        if (bad := strategies.first_non_finite(state)) is not None:
            raise UserError(f"the {strategy.name} merge holds NaN or infinite values "
                            f"{f'(member {i - 1}) ' if i else ''}in {bad}; nothing was written")
    return merged


def _saved_extras(strategy, folder: Path, meta: dict[str, Any]) -> dict[str, dict]:
    """Return the reply records ``strategy`` merges with, read from a model's folder.

    Raises
    ------
    UserError
        A record's ``<name>.safetensors`` is missing, damaged, or not the one the model's
        ``model.json`` records (its SHA-256).
    """
    out = {}
    pinned = meta.get("extras_sha256") if isinstance(meta.get("extras_sha256"), dict) else {}
    for record in strategy.saved_extras:
        path = folder / f"{record}.safetensors"
        if not path.is_file():
            raise UserError(f"{folder} has no {path.name}: {strategy.name} merges node models "
                            f"saved by a run with --strategy {strategy.name} "
                            "--save-node-models, which keeps it beside each")
        out[record] = checkpoint.load_tensors(path)
        if checkpoint.tensor_digest(out[record]) != pinned.get(record):
            raise UserError(f"{path} is not the one saved with {folder}/{checkpoint.META} (its "
                            "SHA-256 differs): keep each node's files together")
    return out


def _weights(dirs: list[Path], metas: list[dict[str, Any]]) -> list[float]:
    """Return each model's merge weight: its node's sample count; 1 each for models of no node.

    Raises
    ------
    UserError
        Models of nodes mixed with models of no node (those would weigh one sample), or
        sample counts that are not finite numbers > 0 or whose sum is not finite.
    """
    counts = [_weight(d, meta) for d, meta in zip(dirs, metas)]
    if all(c is None for c in counts):
        return [1.0] * len(counts)
    if None in counts:
        lone, counted = dirs[counts.index(None)], next(d for d, c in zip(dirs, counts) if c)
        raise UserError(f"{lone} is no node's model (its model.json has no node sample count) "
                        f"while {counted} is: weighed by samples it would count as 1; merge "
                        "models of one kind (node models, or whole runs)")
    if not math.isfinite(sum(counts)):
        raise UserError("the models' node.num_examples sum beyond the float range; their "
                        f"{checkpoint.META} files are damaged")
    return counts


def _weight(folder: Path, meta: dict[str, Any]) -> float | None:
    """Return a saved model's node sample count (``None`` when of no node).

    Raises
    ------
    UserError
        ``node.num_examples`` in its ``model.json`` is not a finite number > 0.
    """
    node = meta.get("node")
    if not isinstance(node, dict) or "num_examples" not in node:
        return None
    try:
        return check_weight(node["num_examples"], str(folder))
    except MergeError as exc:
        raise UserError(f"{folder}/{checkpoint.META}: node.num_examples: {exc}") from None


def _check_fit(dirs: list[Path], states: list[dict], expected: dict, name: str) -> None:
    """Refuse an input whose weights do not fit the model its ``model.json`` describes."""
    for d, state in zip(dirs, states):
        problem = checkpoint.fit_problem(state, expected)
        if problem:
            raise UserError(f"{d}/{checkpoint.WEIGHTS} does not fit the {name!r} model "
                            f"described in {checkpoint.META}: {problem}")
