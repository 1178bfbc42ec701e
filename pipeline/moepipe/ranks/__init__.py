"""The rank group of a multi-process deployment (world size > 1): rank 0, the *leader*, runs
inside the serving process (Triton's ``tensorrt_llm`` model) and keeps the scheduling; ranks
1..W-1 are *workers*, one OS process each, each loading only its own ``rank{r}.safetensors``.

* :mod:`~moepipe.ranks.channel` - the control channel from the leader to each worker (a TCP
  connection: step descriptions and commands one way; timings and heartbeats back; its end is
  how a lost rank is noticed at once);
* :mod:`~moepipe.ranks.steps` - what a step description holds;
* :mod:`~moepipe.ranks.gloo` - the collectives of the runtime's forward over
  ``torch.distributed`` (gloo), timed per operation;
* :mod:`~moepipe.ranks.timings` - those timings per rank and step: communication share, the
  wait for the slowest rank;
* :mod:`~moepipe.ranks.leader` - forming (and re-forming) the group, its health;
* :mod:`~moepipe.ranks.worker` - a worker's process (``python -m moepipe.ranks.worker``).
"""
