"""Wire-contract constants shared by the coordinator and the nodes.

These are the record keys inside Flower messages; both sides of a run must agree on them.
A round's train settings are the entries of the ``config`` record, named after the fields
of :class:`fedavg.node.wire.TrainSettings` in kebab-case (``local-epochs``, ``proximal-mu`` ...).
"""

ARRAYS = "arrays"
"""Key of the :class:`flwr.app.ArrayRecord` carrying model weights (a state dict)."""

CONFIG = "config"
"""Key of the :class:`flwr.app.ConfigRecord` carrying the round's training settings."""

METRICS = "metrics"
"""Key of the :class:`flwr.app.MetricRecord` in a node's reply."""

NUM_EXAMPLES = "num-examples"
"""Number of training samples a node used; the FedAvg weight of its reply."""

TRAIN_LOSS = "train-loss"
"""Mean training loss over a node's local epochs (cross-entropy, nats per sample)."""

TRAIN_SECONDS = "train-seconds"
"""Seconds a node spent training in a round (reply metric)."""

PARTITION_ID = "partition-id"
"""Node config key: which partition of the dataset a node trains on."""

NUM_PARTITIONS = "num-partitions"
"""Node config key: into how many partitions the dataset is split."""

SERVER_ROUND = "server-round"
"""Config key set by Flower's strategies: the current round, starting at 1."""

RUN_FINISHED = "run-finished"
"""Config key of the coordinator's end-of-run ``query`` message to every node."""

RUN_FAILED = "run-failed"
"""Config key of the coordinator's end-of-run ``query`` message when the run failed: the
one-line reason (sent instead of :data:`RUN_FINISHED`)."""

STATE_ROUND = "node-state-round"
"""Reply metric of a method with node state: the round that state was kept in (0: none yet,
the node's first round)."""

NODE_STATE = "fedavg-node-state"
"""Key of the ArrayRecord in a node's ``Context.state`` holding its method state (SCAFFOLD's
control variate, FedDyn's gradient, MOON's previous model), kept between its rounds."""

NODE_STATE_INFO = "fedavg-node-state-info"
"""Key of the ConfigRecord beside :data:`NODE_STATE`: ``strategy`` and ``round`` it was made
by and in."""

LORA_BASE = "lora-base"
"""Key of the ConfigRecord of a ``--lora-merge exact`` round: ``from``, the round whose
adapted weights the message builds on (-1: they are in ``arrays``, in full), and ``to``, the
round whose weights the node trains on after adding :data:`LORA_DELTAS`."""

LORA_DELTAS = "lora-deltas"
"""Key of the ArrayRecord of low-rank updates of the adapted weights, ``r<round>:<layer>:P``
and ``...:Q`` (``W_round = W_(round-1) + P @ Q``), for the rounds after ``from``."""

LORA_BASE_ROUND = "lora-base-round"
"""Reply metric: the round whose adapted weights the node now holds in its state."""

COMPRESS_RESIDUAL = "fedavg-compress-residual"
"""Key of the ArrayRecord in a node's ``Context.state`` holding what ``--compress`` left out of
its last update, per tensor (error feedback, :mod:`fedavg.node.compression`)."""

LORA_STATE = "fedavg-lora-base"
"""Key of the ArrayRecord in a node's ``Context.state`` holding its adapted weights, and of
the ConfigRecord beside it (``<key>-info``: their ``round``)."""

DP_SAMPLE_RATE = "dp-sample-rate"
"""Reply metric with DP-SGD: each sample's chance to join one of the round's batches."""

DP_STEPS = "dp-steps"
"""Reply metric with DP-SGD: the noised steps the node took this round (empty batches too)."""
SECAGG_KEYS = "secagg-keys"
"""Config key of a round under secure aggregation: the state-dict keys of the arrays, in the
order Flower's legacy records carry them (those records keep no names)."""

SECURE_AGGREGATION = "secure-aggregation"
"""Node config key: ``true`` when the node sends its update only through SecAgg+
(``fedavg node --secure-aggregation``) and refuses a round that asks for it in clear."""
