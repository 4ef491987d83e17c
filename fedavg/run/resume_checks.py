"""Checks before a run resumes: the data and model it trained are those it finds now."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedavg.config.values import format_value
from fedavg.data.text import TOKENIZER_FILE, same_tokenization
from fedavg.util.errors import UserError


def check_same_data(output, input_spec: dict, dataset: dict | None = None) -> None:
    """Refuse to resume a run whose data are now other samples, or tokenized otherwise.

    Raises
    ------
    fedavg.util.errors.UserError
        Other train or test sample counts than the saved model's ``dataset`` entry (another
        file at the data's path), or another tokenizer (file, buckets, length).
    """
    try:
        saved_meta = json.loads((output / "model.json").read_text())
        saved, before = saved_meta["input"], dict(saved_meta.get("dataset") or {})
    except (OSError, ValueError, KeyError, TypeError):
        return  # no saved model yet: nothing to compare
    for key in ("train_samples", "test_samples") if dataset else ():
        if isinstance(before.get(key), int) and before[key] != dataset.get(key):
            raise UserError(f"{output} was trained on {before[key]} {key.replace('_', ' ')}; "
                            f"its data now has {dataset.get(key)} (the files changed?): "
                            "resume with the data it was trained on, or start a new run")
    if input_spec.get("kind") != "text" or saved.get("kind") != "text":
        return
    diff = same_tokenization(saved.get("tokenizer", {}), input_spec["tokenizer"])
    if diff:
        copy = Path(output) / TOKENIZER_FILE
        fix = (f"copy {copy} (the run's copy) back over that file, or pass --tokenizer "
               f"{copy}" if copy.is_file() else "resume with the tokenizer it was trained with")
        raise UserError(f"{output} was trained on texts tokenized otherwise ({diff}); {fix}")


def check_same_model(output: Path, spec: dict[str, Any] | None) -> None:
    """Refuse to resume a run whose model would now be built otherwise than before.

    An ``hf:`` folder's ``config.json`` (stored whole in the model's arguments) or a
    builder's arguments edited since the run started would change the model mid-run:
    the weights may still fit, so nothing else would notice. ``spec`` is the model spec
    built now (:meth:`fedavg.models.registry.ModelSpec.as_dict`); the run's is its ``model.json``'s.

    Raises
    ------
    fedavg.util.errors.UserError
        Naming the first argument that differs; or ``model.json`` is of another model than
        the checkpoint (a checkpoint copied in from another run).
    """
    try:
        saved = json.loads((Path(output) / "model.json").read_text())["model"]
        before = dict(saved["args"])
        now = json.loads(json.dumps((spec or {})["args"]))  # tuples as lists, as saved
    except (OSError, ValueError, KeyError, TypeError):
        return  # no (readable) saved model yet: nothing to compare
    # lazy: loads torch, which only this path needs
    from fedavg.models.sources import names_same_code

    if saved.get("name") != spec.get("name"):
        if isinstance(saved.get("name"), str) and names_same_code(spec["name"], saved["name"]):
            return  # the run's own code file, moved
        raise UserError(f"{output}/model.json is a model {saved.get('name')}, its checkpoint "
                        f"of model {spec['name']}: the folder mixes two runs; resume a folder "
                        "of one run")
    if before == now:
        return

    def flat(args: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in args.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
        return out

    b, n = flat(before), flat(now)
    key = next(k for k in sorted(set(b) | set(n)) if b.get(k) != n.get(k))
    raise UserError(f"{output} was trained with model {spec['name']} built with {key} = "
                    f"{format_value(b.get(key))}, which is now {format_value(n.get(key))} "
                    "(its files or --model-arg changed): restore them to resume, or start a "
                    "new run")
