"""Start Flower's SuperLink or SuperNode in this interpreter: ``python -m fedavg._launch``.

``supernode`` first shortens the SuperNode's fixed sleeps (see :mod:`fedavg.runtime`).
"""

import sys


def main() -> None:
    role, sys.argv = sys.argv[1], [f"flower-{sys.argv[1]}", *sys.argv[2:]]
    if role == "superlink":
        from flwr.superlink.cli import flower_superlink

        flower_superlink()
    elif role == "supernode":
        from fedavg import runtime

        runtime.patch_supernode()
        runtime.patch_pull_backoff()
        from flwr.supernode.cli import flower_supernode

        flower_supernode()
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main()
