"""What runs a deployment in a cluster and watches it: ``<deploy>/k8s`` (:mod:`.k8s`) and
``<deploy>/monitoring`` (:mod:`.monitoring`, :mod:`.grafana`), from the same config. The face:
:func:`moepipe.deploy.cluster.operate.render_operations`."""
