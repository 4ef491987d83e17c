"""Start Flower's SuperLink or SuperNode in this interpreter (``python -m`` this module).

``supernode`` first shortens the SuperNode's fixed sleeps (see
:func:`fedavg.flower_compat.run_supernode`).
"""

import sys


def main() -> None:
    """Run ``python -m fedavg.engines.deployment.launch ROLE ARGS...`` as ``flower-ROLE ...``."""
    role, sys.argv = sys.argv[1], [f"flower-{sys.argv[1]}", *sys.argv[2:]]
    from fedavg import flower_compat  # lazy: the role's process imports only what it runs

    if role == "superlink":
        flower_compat.run_superlink()
    elif role == "supernode":
        flower_compat.run_supernode()
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main()
