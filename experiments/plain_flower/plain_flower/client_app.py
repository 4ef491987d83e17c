"""The ClientApp: train the received model on this node's partition, send it back."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from plain_flower import task

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Local epochs of SGD on partition ``partition-id`` of ``num-partitions``."""
    cfg = context.run_config
    data = task.load_partition(str(cfg["dataset"]), int(context.node_config["partition-id"]),
                               int(context.node_config["num-partitions"]))
    net = task.Net()
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    loss = task.train(net, data, int(cfg["local-epochs"]), int(cfg["batch-size"]),
                      float(cfg["lr"]), float(cfg["momentum"]))
    content = RecordDict({"arrays": ArrayRecord(net.state_dict()),
                          "metrics": MetricRecord({"train_loss": loss,
                                                   "num-examples": len(data)})})
    return Message(content=content, reply_to=msg)
