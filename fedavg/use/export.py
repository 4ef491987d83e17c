"""``fedavg export``: fold a saved model's LoRA adapters into its base, as a plain full model.

A run with ``--lora-rank`` saves only what it trained: the adapters, the head and the
buffers, and with ``--lora-merge exact`` the adapted weights; ``model.json`` names the
pretrained base and the SHA-256 of its weights. Loading it needs that base installed.
:func:`export_model` writes the whole network instead, each adapted weight replaced by
``W + alpha / r * B @ A`` (:func:`strategies.lora.fold_into_base`): a folder that
``fedavg evaluate`` / ``predict`` and :func:`fedavg.load_model` load like any other run's,
with no adapters and no base package needed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from fedavg.data.text import TOKENIZER_FILE
from fedavg.models.registry import ModelSpec
from fedavg.run import checkpoint
from fedavg.run.output import check_output, clear_previous_run
from fedavg.use.inference import model_from_artifacts
from fedavg.util.errors import UserError
from strategies.lora import fold_into_base


def export_model(model_dir: str | Path, output: str | Path, *, overwrite: bool = False,
                 code: str | None = None) -> dict:
    """Write the saved LoRA model of ``model_dir`` as a plain full model into ``output``.

    Parameters
    ----------
    model_dir : path
        A run folder (or a ``fedavg merge`` output) whose model has LoRA adapters.
    output : path
        The folder to write (``model.safetensors``, ``model.json``, a text model's
        ``tokenizer.json``).
    overwrite : bool
        Replace a model already in ``output``.
    code : str, optional
        The model code of a model built by code (as ``--model`` of ``evaluate``).

    Returns
    -------
    dict
        ``parameters`` (of the full model), ``adapted_layers``, ``output``.

    Raises
    ------
    UserError
        No model in ``model_dir``, a model without adapters, an output ensemble, an output
        that holds a model (without ``overwrite``) or is the model's own folder.
    """
    model_dir, output = Path(model_dir), Path(output)
    if output.expanduser().resolve() == model_dir.expanduser().resolve():
        raise UserError(f"--output {output} is the model's own folder; export into another")
    state, meta = checkpoint.load(model_dir)
    spec = meta.get("model") if isinstance(meta.get("model"), dict) else {}
    if "lora" not in spec:
        raise UserError(f"the model in {model_dir} has no LoRA adapters: it is a full model "
                        "already (load it as it is)")
    if meta.get("kind") == "ensemble":
        raise UserError(f"the model in {model_dir} is an output ensemble of adapters; export "
                        "folds one model's adapters (merge them first with fedavg merge)")
    model = model_from_artifacts(state, meta, str(model_dir), code=code)
    full = fold_into_base(model.full_state_dict(), model.adapted_layers())
    full = {key.removeprefix("net."): tensor for key, tensor in full.items()}
    plain = {k: v for k, v in spec.items() if k != "lora"}
    net = ModelSpec.from_dict(plain).build()
    net.load_state_dict(full, strict=True)  # every tensor, nothing left over
    check_output(output, overwrite)
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create output folder {output}: {exc.strerror}") from None
    clear_previous_run(output)  # --overwrite: nothing of the run it replaces stays
    if (model_dir / TOKENIZER_FILE).is_file():  # kept as it is, not rebuilt
        shutil.copyfile(model_dir / TOKENIZER_FILE, output / TOKENIZER_FILE)
    checkpoint.save(output, full, {
        **{k: v for k, v in meta.items() if k not in ("format", "weights_sha256")},
        "model": plain,
        "exported_from": {"folder": str(model_dir.resolve()), "lora": spec["lora"],
                          "weights_sha256": meta.get("weights_sha256")}})
    return {"parameters": sum(t.numel() for t in full.values()),
            "adapted_layers": len(model.adapted_layers()), "output": output}
