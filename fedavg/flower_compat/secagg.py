"""Flower's SecAgg+ (``SecAggPlusWorkflow``, ``secaggplus_mod``) under the Message API.

Flower 1.42 ships SecAgg+ (Bell et al. 2020, Secure Single-Server Aggregation with
(Poly)Logarithmic Overhead, doi:10.1145/3372297.3417885) for its legacy strategies only: the
workflow asks a legacy ``Strategy`` for ``FitIns`` (``configure_fit``) and hands it the
unmasked aggregate as every node's ``FitRes`` (``aggregate_fit``); the node mod hands the
ClientApp a legacy ``fitins.*`` message and masks the ``fitres.parameters`` it returns. This
module is that seam and nothing more: the protocol, its masks, shares, quantisation and
unmasking are Flower's, run as they are.

- coordinator: :func:`secure_mean` runs one round of ``SecAggPlusWorkflow`` over a grid, with
  a legacy strategy of two methods that hands the workflow the round's instructions and keeps
  what it unmasked: the **weighted mean** ``sum_k w_k x_k / sum_k w_k`` of the vectors the
  nodes sent, with ``w_k`` their ``num_examples`` (quantised, see below);
- node: :func:`secaggplus_mod` is Flower's mod; :func:`train_inputs` and :func:`train_reply`
  translate the legacy records of its collect stage.

Flower's quantisation (``flwr.common.secure_aggregation``): node ``k`` scales its vector by
``r_k = round(w_k / max_weight * Q) / Q`` (``Q = quantization_range``), clips each entry to
``[-clipping_range, clipping_range]``, maps it onto ``[0, Q]`` with stochastic rounding, adds
its masks modulo ``modulus_range`` and sends ``r_k Q`` along as a first entry; the coordinator
divides the unmasked sum by ``sum_k r_k``. So an entry's step is
``2 clipping_range / Q / r_k`` (3.8e-6 / r_k with Flower's defaults), unbiased; an entry
``|r_k x| > clipping_range`` is clipped; ``w_k`` and the node's metrics travel in clear.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.common import (
    Code,
    FitIns,
    FitRes,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
)
from flwr.compat.common.recorddict_compat import (
    fitres_to_recorddict,
    recorddict_to_fitins,
)
from flwr.server import LegacyContext
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey

__all__ = ["SecureMean", "is_protocol_message", "protocol_limits", "secaggplus_mod",
           "secure_mean", "train_inputs", "train_reply", "workflow"]

#: ``SecAggPlusWorkflow``'s keyword defaults in flwr 1.42 (its ``num_shares`` and
#: ``reconstruction_threshold`` have none; Flower's secure-aggregation example uses 3 and 2).
DEFAULTS = {"max_weight": 1000.0, "clipping_range": 8.0, "quantization_range": 4194304,
            "modulus_range": 4294967296}


#: Config key of a legacy ``FitIns``: the names of the entries that hold a list as JSON text
#: (legacy configs take scalars only).
_JSON_LISTS = "fedavg-json-lists"


def _legacy_config(config: dict[str, Any]) -> dict[str, Any]:
    """Return ``config`` with every list as JSON text, their names under :data:`_JSON_LISTS`."""
    lists = sorted(k for k, v in config.items() if isinstance(v, list))
    out = {k: json.dumps(v) if k in lists else v for k, v in config.items()}
    out[_JSON_LISTS] = ",".join(lists)
    return out


def _config_from_legacy(config: dict[str, Any]) -> dict[str, Any]:
    """Invert :func:`_legacy_config`."""
    lists = [k for k in str(config.pop(_JSON_LISTS, "")).split(",") if k]
    return {k: json.loads(v) if k in lists else v for k, v in config.items()}


def _count_or_share(value: float) -> int | float:
    """Flower's convention: an int is a count, a float in (0, 1] a share of the nodes."""
    return int(value) if value > 1 and float(value).is_integer() else float(value)


def workflow(num_shares: float, reconstruction_threshold: float, *, max_weight: float,
             clipping_range: float, quantization_range: int, modulus_range: int,
             timeout: float | None = None) -> SecAggPlusWorkflow:
    """Build Flower's ``SecAggPlusWorkflow`` (its own checks apply).

    ``num_shares`` and ``reconstruction_threshold``: above 1, a count (an integer); at most
    1, a share of the round's nodes (``num_shares``) or of the shares (the threshold).

    Raises
    ------
    ValueError
        A value Flower refuses (its message), or a count above 1 that is not an integer.
    """
    for name, value in (("num_shares", num_shares),
                        ("reconstruction_threshold", reconstruction_threshold)):
        if value > 1 and not float(value).is_integer():
            raise ValueError(f"`{name}` above 1 is a count and must be an integer")
    return SecAggPlusWorkflow(_count_or_share(num_shares),
                              _count_or_share(reconstruction_threshold),
                              max_weight=float(max_weight), clipping_range=float(clipping_range),
                              quantization_range=int(quantization_range),
                              modulus_range=int(modulus_range), timeout=timeout)


@dataclass
class SecureMean:
    """What one round of SecAgg+ revealed to the coordinator.

    Attributes
    ----------
    mean : list of numpy.ndarray or None
        The weighted mean of the vectors the nodes in the sum sent (float64, in the order
        they sent them); ``None`` when the protocol halted.
    nodes : list of (int, int, dict)
        Each node in the sum: its id, its ``num_examples`` and metrics (sent in clear).
    sampled : list of int
        The nodes the round started with.
    errors : dict of int to str
        Nodes that replied with an error at some stage, with the error's reason.
    bytes_from_nodes : int
        The bytes of keys, shares and masked vectors the nodes sent over all stages.
    """

    mean: list[np.ndarray] | None = None
    nodes: list[tuple[int, int, dict[str, Any]]] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)
    bytes_from_nodes: int = 0


class _Instructions:
    """The legacy strategy the workflow drives: hands out FitIns, keeps the unmasked mean."""

    def __init__(self, grid, fitins: dict[int, FitIns], out: SecureMean) -> None:
        self.grid, self.fitins, self.out = grid, fitins, out

    def configure_fit(self, server_round, parameters, client_manager):
        run_id = getattr(getattr(self.grid, "run", None), "run_id", 0)
        return [(GridClientProxy(nid, self.grid, run_id), ins)
                for nid, ins in self.fitins.items()]

    def aggregate_fit(self, server_round, results, failures):
        # the workflow sets every result's parameters to the unmasked weighted mean
        self.out.nodes = [(proxy.node_id, int(res.num_examples), dict(res.metrics))
                          for proxy, res in results]
        if results:
            self.out.mean = parameters_to_ndarrays(results[0][1].parameters)
        return None, {}  # nothing for the workflow to store


class _Watched:
    """The grid as the workflow sees it: replies as a list, error replies noted per node."""

    def __init__(self, grid, out: SecureMean) -> None:
        self._grid, self._out = grid, out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def send_and_receive(self, messages, *, timeout=None):
        replies = list(self._grid.send_and_receive(messages, timeout=timeout))
        for msg in replies:
            if msg.has_error():
                self._out.errors.setdefault(int(msg.metadata.src_node_id), msg.error.reason)
                continue
            for record in msg.content.config_records.values():
                for value in record.values():
                    values = value if isinstance(value, list) else [value]
                    self._out.bytes_from_nodes += sum(len(v) for v in values
                                                      if isinstance(v, bytes))
        return replies


def secure_mean(grid, server_round: int, instructions: dict[int, tuple[list[np.ndarray],
                                                                      dict[str, Any]]],
                flow: SecAggPlusWorkflow) -> SecureMean:
    """Run one round of SecAgg+ and return the weighted mean it unmasked.

    Parameters
    ----------
    grid : flwr.serverapp.Grid
        The run's grid; its ``send_and_receive`` must return each stage's replies.
    server_round : int
        The round (Flower's ``group_id`` of the protocol's messages).
    instructions : dict
        Node id -> ``(arrays, config)``: what the node trains from, as the legacy
        ``FitIns`` of the workflow's collect stage carries it.
    flow : SecAggPlusWorkflow
        From :func:`workflow`.
    """
    out = SecureMean(sampled=sorted(instructions))
    serialised: dict[int, Any] = {}  # a model serialised once, however many nodes get it
    fitins = {}
    for nid, (arrays, config) in instructions.items():
        if id(arrays) not in serialised:
            serialised[id(arrays)] = ndarrays_to_parameters(arrays)
        fitins[nid] = FitIns(serialised[id(arrays)], _legacy_config(dict(config)))
    state = RecordDict({MAIN_CONFIGS_RECORD: ConfigRecord(
        {WorkflowKey.CURRENT_ROUND: int(server_round)})})
    state[MAIN_PARAMS_RECORD] = ArrayRecord()  # the workflow reads it; our FitIns carry all
    context = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=state,
                                    run_config={}),
                            strategy=_Instructions(grid, fitins, out))
    flow(_Watched(grid, out), context)
    return out


# --- node side ------------------------------------------------------------------------------


def is_protocol_message(msg: Message) -> bool:
    """Whether ``msg`` is a stage of Flower's SecAgg+ protocol."""
    return msg.has_content() and RECORD_KEY_CONFIGS in msg.content.config_records


def protocol_limits(context: Context) -> tuple[float, float]:
    """Return the round's ``(max_weight, clipping_range)``, as the setup stage gave them."""
    state = context.state.config_records[RECORD_KEY_STATE]
    return float(state["max_weight"]), float(state["clipping_range"])


def train_inputs(msg: Message) -> tuple[list[np.ndarray], ConfigRecord]:
    """Return the arrays and config of the legacy ``fitins.*`` records of a collect stage."""
    ins = recorddict_to_fitins(msg.content, keep_input=True)
    return (parameters_to_ndarrays(ins.parameters),
            ConfigRecord(_config_from_legacy(dict(ins.config))))


def train_reply(msg: Message, arrays: list[np.ndarray], num_examples: int,
                metrics: MetricRecord) -> Message:
    """Return the legacy ``fitres.*`` reply the mod masks: ``arrays``, weight, metrics."""
    res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), int(num_examples),
                 dict(metrics))
    return Message(fitres_to_recorddict(res, keep_input=False), reply_to=msg)
