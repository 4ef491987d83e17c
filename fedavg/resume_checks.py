"""Checks before a run resumes: the data it trained on are the data it finds now."""

from __future__ import annotations

import json

from fedavg.errors import UserError


def check_same_data(output, input_spec: dict, dataset: dict | None = None) -> None:
    """Refuse to resume a run whose data are now other samples, or tokenized otherwise.

    Raises
    ------
    fedavg.errors.UserError
        Other train or test sample counts than the saved model's ``dataset`` entry (another
        file at the data's path), or another tokenizer (file, buckets, length).
    """
    from fedavg.text import same_tokenization

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
        raise UserError(f"{output} was trained on texts tokenized otherwise ({diff}); resume "
                        f"with the tokenizer it was trained with (a copy is {output}/"
                        "tokenizer.json for a file tokenizer)")
