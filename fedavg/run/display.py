"""What a run shows in the terminal: the partition table, round progress, the rounds table.

Every command (``simulate``, ``coordinator``, ``node``) prints through these, so the output of
one engine reads like the other's. Nothing here touches Flower or Ray.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from fedavg.config.checks import node_value
from fedavg.config.values import format_value
from fedavg.data.partition import label_counts, values_per_node
from fedavg.run import privacy
from fedavg.util.units import size

if TYPE_CHECKING:
    from fedavg.config.settings import RunConfig
    from fedavg.run.lifecycle import Prepared, RoundRecord

log = logging.getLogger("fedavg")


def reporter(console, insecure: bool = False) -> Callable[[str], None]:
    """``say(text)``: print rich markup to ``console`` (unwrapped) and log it.

    Parameters
    ----------
    console : rich.console.Console or None
        Where to print; ``None`` only logs.
    insecure : bool
        Warn first that traffic between coordinator and nodes is not encrypted.
    """
    def say(text: str) -> None:
        if console is not None:
            console.print(text, highlight=False, soft_wrap=True)
        log.info(re.sub(r"\[/?[a-z ]*\]", "", text))

    if insecure:
        say("[yellow]warning:[/] --insecure: traffic between coordinator and nodes is NOT "
            "encrypted")
    return say


def partition_table(prepared: Prepared, max_rows: int = 12, counts: np.ndarray | None = None):
    """Return a rich Table: samples per node and label spread (at most ``max_rows`` rows).

    ``counts``: the ``(nodes, classes)`` label counts when the caller has them already.
    """
    from rich.table import Table

    classes = prepared.data.classes
    if counts is None:
        counts = label_counts(prepared.data.train.y, prepared.parts, len(classes))
    partitioner = prepared.meta["config"]["data"]["partitioner"]
    values = natural_values(prepared)
    table = Table(title=f"{len(prepared.parts)} nodes, {partitioner} partition of "
                  f"{len(prepared.data.train)} samples", title_justify="left")
    for column in ("node", "samples", *(("values",) if values else ()), "labels",
                   "top label (share)", "smallest label (share)"):
        table.add_column(column, justify="right")
    rows = list(range(len(prepared.parts)))
    if len(rows) > max_rows:
        rows = rows[: max_rows - 2] + rows[-2:]
    for i in rows:
        row = _partition_row(i, counts[i], classes)
        table.add_row(*(row[:2] + [str(values[i])] + row[2:] if values else row))
    if len(prepared.parts) > max_rows:
        table.caption = f"{len(prepared.parts) - max_rows} more nodes not shown"
    return table


def natural_values(prepared: Prepared) -> list[int] | None:
    """Distinct ``--partition-by`` values per node of a natural partition, else ``None``."""
    groups = prepared.data.train.groups
    if prepared.meta["config"]["data"]["partitioner"] != "natural" or groups is None:
        return None
    return values_per_node(groups, prepared.parts)


def natural_note(prepared: Prepared) -> str | None:
    """One line on how a natural partition grouped its values, when nodes hold several."""
    values = natural_values(prepared)
    if not values or max(values) == 1:
        return None
    column = prepared.meta["config"]["data"]["partition_by"]
    shown = ", ".join(map(str, values[:12])) + (", ..." if len(values) > 12 else "")
    return (f"{sum(values)} distinct --partition-by {column} values grouped into "
            f"{len(values)} nodes (each value on one node, balanced by samples): "
            f"{shown} values per node")


def _partition_row(node: int, counts: np.ndarray, classes: list[str]) -> list[str]:
    total = int(counts.sum())
    present = np.flatnonzero(counts)
    top = int(counts.argmax())
    others = present[present != top]  # the smallest is another label than the top one
    low = int(others[counts[others].argmin()]) if len(others) else None
    return [str(node), str(total), f"{len(present)}/{len(classes)}",
            f"{classes[top][:12]} ({counts[top] / max(total, 1):.0%})",
            "-" if low is None else f"{classes[low][:12]} ({counts[low] / max(total, 1):.0%})"]


def show_plan(console, prepared: Prepared, config: RunConfig, table: bool = True) -> None:
    """Print the data notes, the partition table and a one-line summary of the run."""
    if console is None:
        return
    for note in prepared.data.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    if note := privacy.plan_note(config, [len(p) for p in prepared.parts]):
        console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    if not table:
        return
    counts = label_counts(prepared.data.train.y, prepared.parts, len(prepared.data.classes))
    console.print(partition_table(prepared, counts=counts))
    if note := logit_adjust_note(counts, config):
        console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    tok = prepared.data.tokenizer
    inputs = (f"texts of {prepared.spec.input_shape[0]} tokens ({tok.kind} tokenizer, "
              f"{tok.vocab_size} ids)" if tok is not None
              else f"inputs {tuple(prepared.spec.input_shape)}")
    console.print(
        f"model [bold]{prepared.spec.name}[/] on {inputs}, "
        f"{prepared.spec.num_classes} classes; strategy [bold]{config.merge.strategy}[/]"
        f"{node_defaults_text(config)}, "
        f"{_plural(config.merge.rounds, 'round')}, "
        f"{config.nodes_per_round}/{config.merge.num_nodes} "
        f"nodes per round, {_local_work(config, prepared.strategy)}"
        + recipe_text(config, prepared)
    )


#: A node whose two most common labels hold this share of its samples or more is "narrow":
#: the logit-adjusted loss's label prior alone nearly fits its data.
NARROW_SHARE = 0.95


def logit_adjust_note(counts: np.ndarray, config: RunConfig) -> str | None:
    """Warn when ``--logit-adjust`` meets nodes that hold (almost) only one or two labels.

    On such a node the prior term ``tau * log(prior)`` (:class:`fedavg.node.recipe.LogitAdjustment`)
    already ranks the node's labels first, so its loss starts near 0 and the node learns
    little (``--partitioner pathological --classes-per-node 1`` on digits, 10 nodes, 5
    rounds: 0.17 accuracy against 0.83 without it). ``counts``: ``(nodes, classes)`` label
    counts (:func:`fedavg.data.partition.label_counts`). ``None`` when it is off or no node is
    narrow (:data:`NARROW_SHARE`).
    """
    if config.train.logit_adjust <= 0 or not len(counts):
        return None
    top2 = np.sort(counts, axis=1)[:, -2:].sum(axis=1)
    narrow = int(((top2 >= NARROW_SHARE * counts.sum(axis=1)) & (counts.sum(axis=1) > 0)).sum())
    if not narrow:
        return None
    return (f"--logit-adjust {config.train.logit_adjust:g}: {narrow} of {len(counts)} "
            f"nodes hold one or two labels for {NARROW_SHARE:.0%} or more of their samples; "
            "there the label prior alone nearly fits a node's data and it learns little: "
            "lower it (0.1) or leave it off")


def node_defaults_text(config: RunConfig) -> str:
    """`` (its node defaults: --momentum 0)`` when the strategy's own node settings apply."""
    applied = config.applied_node_defaults()
    if not applied:
        return ""
    said = ", ".join(f"--{k.replace('_', '-')} {format_value(v)}" for k, v in applied.items())
    return f" (its node defaults: {said})"


def recipe_text(config: RunConfig, prepared) -> str:
    """Return the run's recipe as the plan's line ends it (``, cosine learning rate``; or "")."""
    return _recipe(config, {"kind": prepared.data.kind, "shape": list(prepared.spec.input_shape)})


def _recipe(config: RunConfig, input_spec: dict[str, Any]) -> str:
    """``, cosine learning rate, augmented batches`` when the node recipe is on.

    The server's weight average (``--swa-start``) is named too. Batches are augmented only
    where :func:`fedavg.node.recipe.augmenter` has an augmentation for ``input_spec`` (images);
    other inputs get a note instead.
    """
    from fedavg.node.recipe import augmenter  # lazy: loads torch, which only this path needs

    t = config.train
    parts = [f"{t.lr_schedule} learning rate"] if t.lr_schedule != "constant" else []
    if t.lr_decay != 1:
        parts.append(f"learning rate x{t.lr_decay:g} per round")
    if t.augment and augmenter(input_spec) is not None:
        parts.append("augmented batches")
    if t.sam_rho > 0:
        parts.append(f"SAM rho {t.sam_rho:g}")
    if t.logit_adjust > 0:
        parts.append(f"logit adjustment {t.logit_adjust:g}")
    if config.merge.swa_start is not None:
        parts.append(f"weight average of rounds >= {config.merge.swa_start} (SWA)")
    return "".join(f", {p}" for p in parts)


def _local_work(config, strategy) -> str:
    """``1 local epoch(s)``, or ``50 local steps`` with ``--local-steps``."""
    steps = node_value(config.train, "local_steps", strategy.node_defaults)
    return f"{steps} local steps" if steps else f"{config.train.local_epochs} local epoch(s)"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _figure(value: float | None) -> str:
    """Format an accuracy or loss with 4 decimals; ``nan`` for one JSON stored as ``null``."""
    return "nan" if value is None else f"{value:.4f}"


def predictions_table(rows: list[dict[str, Any]], shown: int = 50):
    """Return a rich table of the first ``shown`` predictions: input, class, confidence."""
    from rich.markup import escape
    from rich.table import Table

    table = Table()
    table.add_column("input", overflow="fold")
    table.add_column("prediction", overflow="fold")
    table.add_column("confidence", justify="right")
    for row in rows[:shown]:
        table.add_row(escape(row["input"]), escape(row["prediction"]),
                      f"{row['confidence']:.3f}")
    return table


#: Seconds between two heartbeat lines of a long phase when the output is not a terminal
#: (``FEDAVG_HEARTBEAT_S`` sets another).
HEARTBEAT_S = 30.0


def heartbeat_seconds() -> float:
    """Return ``FEDAVG_HEARTBEAT_S`` when it is a number > 0, else :data:`HEARTBEAT_S`."""
    try:
        seconds = float(os.environ.get("FEDAVG_HEARTBEAT_S", HEARTBEAT_S))
    except ValueError:
        return HEARTBEAT_S
    return seconds if 0 < seconds < math.inf else HEARTBEAT_S


class Heartbeat:
    """Without a terminal, a line at least every :data:`HEARTBEAT_S` seconds of a long phase.

    A run written to a log file (``nohup``, CI) draws no progress bar; so that a round of
    minutes does not look like a hang, a thread prints ``... still training round 3 (65 s)``
    while a phase lasts.
    """

    def __init__(self, console, phase: str) -> None:
        self.console = console
        self.every = heartbeat_seconds()
        self._phase, self._since = phase, time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fedavg-heartbeat",
                                        daemon=True)

    def start(self) -> None:
        """Start the phase's clock and the thread."""
        self._since = time.monotonic()
        self._thread.start()

    def phase(self, name: str) -> None:
        """Begin a new phase (the next round): its clock starts now."""
        self._phase, self._since = name, time.monotonic()

    def stop(self) -> None:
        """Stop the thread (it prints nothing more)."""
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)

    def _run(self) -> None:
        while not self._done.wait(self.every):
            self.console.print(f"... still {self._phase} "
                               f"({time.monotonic() - self._since:.0f} s)", highlight=False)


class Progress:
    """A progress bar over the rounds plus one line per round and per failed node.

    With ``console=None`` every method does nothing, so callers need no checks.

    Parameters
    ----------
    console : rich.console.Console or None
        Where to draw.
    rounds : int
        Rounds of the run.
    done : int
        Rounds already done (a resumed run).
    listener : object, optional
        Also gets every finished round (``listener.on_round(record)``), with or without a
        console: the run's trackers (:class:`fedavg.run.tracking.Trackers`).
    """

    def __init__(self, console, rounds: int, done: int = 0, listener=None) -> None:
        self.rounds = rounds
        self.listener = listener
        self._bar = None
        self._beat = None
        if console is None:
            return
        if not console.is_terminal:  # a log file, a pipe: no bar is drawn there
            self._beat = Heartbeat(console, f"training round {done + 1}")
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.progress import Progress as Bar

        self._bar = Bar(TextColumn("[bold]rounds"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TextColumn("{task.description}"),
                        console=console, transient=True)
        self._task = self._bar.add_task(f"training round {done + 1}", total=rounds,
                                        completed=done)

    def start(self) -> None:
        """Show the bar (without a terminal: start the heartbeat lines)."""
        if self._bar is not None:
            self._bar.start()
        if self._beat is not None:
            self._beat.start()

    def stop(self) -> None:
        """Remove the bar (the printed lines stay); stop the heartbeat."""
        if self._bar is not None:
            self._bar.stop()
        if self._beat is not None:
            self._beat.stop()

    def on_round(self, rec: RoundRecord) -> None:
        """Print a finished round and advance the bar; tell the listener."""
        if self.listener is not None:
            self.listener.on_round(rec)
        if self._bar is None:
            return
        train_loss = "None" if rec.train_loss is None else _figure(rec.train_loss)
        own = ("" if rec.merged_accuracy is None
               else f" (weight average; round's model {_figure(rec.merged_accuracy)})")
        self._bar.console.print(
            f"round {rec.round:>3}/{self.rounds}: accuracy {_figure(rec.accuracy)}{own}  "
            f"loss {_figure(rec.loss)}  train loss {train_loss}  nodes {rec.num_nodes}  "
            f"sent {size(rec.bytes_to_nodes)}  got {size(rec.bytes_from_nodes)}  "
            + ("" if rec.epsilon is None else f"epsilon {rec.epsilon:.3g}  ")
            + f"{rec.wall_s:.2f} s")
        nxt = rec.round + 1
        phase = f"training round {nxt}" if nxt <= self.rounds else "finishing"
        self._bar.update(self._task, advance=1, description=phase)
        if self._beat is not None:
            self._beat.phase(phase)

    def on_note(self, text: str) -> None:
        """Print a note on the round just finished (the merge's)."""
        if self._bar is not None:
            from rich.markup import escape

            self._bar.console.print(f"[yellow]note:[/] {escape(text)}", highlight=False)

    def on_failure(self, server_round: int, node: int, reason: str) -> None:
        """Print a node left out of a round, and why."""
        if self._bar is not None:
            self._bar.console.print(f"[red]round {server_round}: node {node} failed:[/] {reason}")
