"""A node's side of secure aggregation: Flower's ``secaggplus_mod`` around the node's training.

Under ``--secure-aggregation`` a round is four stages of Flower's SecAgg+ protocol, all
``train`` messages that Flower's mod answers itself; only its third stage (collect masked
vectors) reaches the node's training, through :func:`node_mod`, which

1. turns the legacy ``fitins.*`` records Flower's workflow sends into the usual message
   (``arrays`` named by the round's :data:`~fedavg.node.keys.SECAGG_KEYS`, ``config``);
2. trains as in any round (:func:`fedavg.node.clientapp.run_train`);
3. returns the node's **update** (trained minus received weights, float64, in the received
   order) and ``num-examples`` as the legacy ``fitres.*`` reply the mod quantises and masks.
   Sending the update rather than the weights keeps the entries far inside Flower's clipping
   range and makes its quantisation step small relative to them.

A node refuses to send what Flower would clip or overflow (a weight above ``max_weight``, an
update entry above the clipping range once weighted), rather than have it merged wrongly:
it drops out of the round, which SecAgg+ tolerates. A node started with
``--secure-aggregation`` refuses every ``train`` message outside the protocol.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MessageType, RecordDict

from fedavg.flower_compat import secagg
from fedavg.node import keys


def _required(require: bool | None, context: Context) -> bool:
    if require is not None:
        return require
    value = context.node_config.get(keys.SECURE_AGGREGATION, False)
    return value is True or str(value).lower() == "true"


def node_mod(require: bool | None = None) -> Callable[[Message, Context, Callable], Message]:
    """Return the ClientApp mod that answers SecAgg+ rounds with Flower's ``secaggplus_mod``.

    Parameters
    ----------
    require : bool, optional
        Refuse ``train`` messages outside the protocol; ``None``: as the node config's
        :data:`~fedavg.node.keys.SECURE_AGGREGATION` says (``fedavg node``).
    """

    def mod(msg: Message, context: Context, call_next) -> Message:
        if msg.metadata.message_type != MessageType.TRAIN:
            return call_next(msg, context)
        if secagg.is_protocol_message(msg):
            return secagg.secaggplus_mod(
                msg, context, lambda m, c: masked_train(m, c, call_next))
        if _required(require, context):
            raise RuntimeError("this node sends its model only under secure aggregation "
                               "(fedavg node --secure-aggregation): start the coordinator "
                               "with --secure-aggregation")
        return call_next(msg, context)

    return mod


def masked_train(msg: Message, context: Context, call_next) -> Message:
    """Train on a collect-stage message; return the update as the reply the mod masks.

    Raises
    ------
    ValueError
        The node's weight exceeds the round's ``max_weight``, or a weighted update entry its
        ``clipping_range`` (Flower would clip it), saying which option to raise.
    """
    import torch  # lazy: a node's process imports this module before it trains

    arrays, config = secagg.train_inputs(msg)
    names = [str(n) for n in config.pop(keys.SECAGG_KEYS)]
    received = {name: torch.from_numpy(np.array(a, copy=True)) for name, a in zip(names, arrays)}
    msg.content = RecordDict({keys.ARRAYS: ArrayRecord(received), keys.CONFIG: config})
    reply = call_next(msg, context)
    trained = reply.content[keys.ARRAYS].to_torch_state_dict()
    metrics = reply.content[keys.METRICS]
    weight = metrics[keys.NUM_EXAMPLES]
    if set(trained) != set(names):
        raise ValueError("the node's model does not send back the tensors it received "
                         f"({sorted(set(names) ^ set(trained))[:3]}): not a secure sum")
    # 0-d tensors (BatchNorm's num_batches_tracked) as 1-d: Flower's masking mishandles 0-d
    update = [np.atleast_1d((trained[n].double() - received[n].double()).numpy())
              for n in names]
    check_limits(update, weight, *secagg.protocol_limits(context))
    return secagg.train_reply(msg, update, int(weight), metrics)


def check_limits(update: list[np.ndarray], weight: float, max_weight: float,
                 clipping_range: float) -> None:
    """Refuse an update Flower's quantisation would clip (see :mod:`fedavg.flower_compat.secagg`).

    Raises
    ------
    ValueError
        ``weight > max_weight``, or ``weight / max_weight * |entry| > clipping_range``.
    """
    if weight > max_weight:
        raise ValueError(f"this node's {weight:g} samples exceed --secagg-max-weight "
                         f"{max_weight:g}: raise it to at least the largest node's samples")
    ratio = weight / max_weight
    worst = max((float(np.abs(u).max()) for u in update if u.size), default=0.0)
    if worst * ratio > clipping_range:
        raise ValueError(f"an update entry of {worst:.3g} times the weight {ratio:.3g} exceeds "
                         f"--secagg-clipping-range {clipping_range:g}: raise it, or lower --lr")
