"""Deploy: what ``moepipe deploy`` writes and runs, by concern.

* :mod:`~moepipe.deploy.render` - the deployment folder: the Triton model repository of every
  target (strict templates, each target's values, the fallback model); its face is
  :func:`moepipe.deploy.render.repository.render_deployment`.
* :mod:`~moepipe.deploy.cluster` - what runs and watches it in a cluster: Kubernetes objects,
  Prometheus rules and scrape config, the Grafana dashboard; its face is
  :func:`moepipe.deploy.cluster.operate.render_operations`.
* :mod:`~moepipe.deploy.local` - the local ``tritonserver`` process and its supervisor; its face
  is :mod:`moepipe.deploy.local.lifecycle` (start, status, stop).
* :mod:`~moepipe.deploy.tritonserver` and :mod:`~moepipe.deploy.metric_names`, below them: the
  server's command-line facts and the metric names each target exports.

The client of a live deployment lives with its only user, :mod:`moepipe.validate.client`.
"""
