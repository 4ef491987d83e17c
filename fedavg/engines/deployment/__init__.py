"""Training across machines on Flower's deployment engine: ``fedavg coordinator`` / ``node``.

Only what is SuperLink / SuperNode lives here; the rounds and the run folder are shared with
``fedavg simulate`` (:mod:`fedavg.run`), and every private Flower name is in
:mod:`fedavg.flower_compat`. This package imports nothing itself, so that
``python -m fedavg.engines.deployment.containers`` (the image's health check) and
``python -m fedavg.engines.deployment.launch`` stay light.

- :mod:`~fedavg.engines.deployment.processes`: the Flower child processes, their folder, addresses;
- :mod:`~fedavg.engines.deployment.tls`: certificates and node keys; :mod:`.certs` makes them;
- :mod:`~fedavg.engines.deployment.coordinator`: the coordinator role (``coordinate``), its
  options in :mod:`.coordinator_options`;
- :mod:`~fedavg.engines.deployment.launch`: a SuperLink or SuperNode in this interpreter;
- :mod:`~fedavg.engines.deployment.node`: the node role (``serve_node``), its options in
  :mod:`.node_options`, its SuperNode in :mod:`.supernode`;
- :mod:`~fedavg.engines.deployment.gpus`: one node per GPU (``serve_gpu_nodes``);
- :mod:`~fedavg.engines.deployment.containers`: what the container image runs besides ``fedavg``.
"""
