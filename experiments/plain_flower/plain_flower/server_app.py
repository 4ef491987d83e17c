"""The ServerApp: Flower's FedAvg over every node, the merged model evaluated centrally."""

import json
import time

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from plain_flower import task

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run ``num-server-rounds`` rounds; append each evaluation to ``timing-file``."""
    cfg = context.run_config
    test = task.load_test(str(cfg["dataset"]))
    net = task.Net()
    timing = str(cfg["timing-file"])

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        net.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy = task.evaluate(net, test)
        if timing:
            with open(timing, "a") as fh:
                fh.write(json.dumps({"round": server_round, "time": time.time(),
                                     "accuracy": accuracy, "loss": loss}) + "\n")
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(net.state_dict()),
                   num_rounds=int(cfg["num-server-rounds"]), evaluate_fn=evaluate)
